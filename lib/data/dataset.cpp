// JSONL datasets: the line formats, the prompt templates with their label masks, truncation,
// and the flat Dataset they fill.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <rapidjson/document.h>
#include <rapidjson/error/en.h>

#include "util/json.hpp"
#include "util/log.hpp"
#include "util/threads.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt {

DataOptions data_options_for(const TrainingArguments& args) {
  DataOptions o;
  o.template_name = args.template_name;
  o.max_length = args.max_length;
  o.train_on_prompt = args.train_on_prompt;
  o.skip_bad_lines = args.skip_bad_lines;
  return o;
}

// ---- Dataset -------------------------------------------------------------------------------

void Dataset::check_index(int64_t i) const {
  if (i < 0 || i >= size()) {
    throw InvalidArgument(
        fmt::format("example index {} is out of range: the dataset has {} examples", i, size()));
  }
}

namespace {

bool strictly_increasing(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(), std::greater_equal<int64_t>()) == v.end();
}

}  // namespace

Dataset Dataset::from_flat(std::vector<int32_t> ids, std::vector<int32_t> labels,
                           std::vector<int64_t> offsets, std::vector<int64_t> document_offsets) {
  const int64_t tokens = static_cast<int64_t>(ids.size());
  if (labels.size() != ids.size()) {
    throw InvalidArgument(fmt::format("{} labels for {} token ids", labels.size(), tokens));
  }
  if (offsets.empty() || offsets.front() != 0 || offsets.back() != tokens ||
      !strictly_increasing(offsets)) {
    throw InvalidArgument(fmt::format(
        "the {} offsets do not cut the {} tokens into nonempty examples", offsets.size(), tokens));
  }
  if (std::any_of(ids.begin(), ids.end(), [](int32_t id) { return id < 0; })) {
    throw InvalidArgument("negative token ids");
  }
  if (std::any_of(labels.begin(), labels.end(),
                  [](int32_t l) { return l < 0 && l != kIgnoreLabel; })) {
    throw InvalidArgument(fmt::format("negative labels other than {}", kIgnoreLabel));
  }
  const bool documents_ok =
      document_offsets.empty() ||
      (strictly_increasing(document_offsets) && document_offsets.back() == tokens &&
       std::includes(document_offsets.begin(), document_offsets.end(), offsets.begin(),
                     offsets.end()));
  if (!documents_ok) {
    throw InvalidArgument("the document offsets do not cut the examples into nonempty documents");
  }
  Dataset d;
  d.ids_ = std::move(ids);
  d.labels_ = std::move(labels);
  d.offsets_ = std::move(offsets);
  d.doc_offsets_ = std::move(document_offsets);
  return d;
}

void Dataset::add(const std::vector<int32_t>& ids, const std::vector<int32_t>& labels) {
  if (packed()) throw InvalidArgument("Dataset::add: the dataset is packed; add before packing");
  if (ids.empty() || ids.size() != labels.size()) {
    throw InvalidArgument(fmt::format(
        "Dataset::add: ids ({} tokens) and labels ({}) must have the same nonzero length",
        ids.size(), labels.size()));
  }
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
  offsets_.push_back(static_cast<int64_t>(ids_.size()));
}

int64_t Dataset::length(int64_t i) const {
  check_index(i);
  return offsets_[i + 1] - offsets_[i];
}

TokenView Dataset::ids(int64_t i) const {
  const int64_t n = length(i);  // checks i
  return {ids_.data() + offsets_[i], n};
}

TokenView Dataset::labels(int64_t i) const {
  const int64_t n = length(i);
  return {labels_.data() + offsets_[i], n};
}

std::vector<int64_t> Dataset::lengths() const {
  std::vector<int64_t> out(size());
  for (int64_t i = 0; i < size(); ++i) out[i] = offsets_[i + 1] - offsets_[i];
  return out;
}

std::vector<int64_t> Dataset::document_lengths(int64_t i) const {
  if (!packed()) return {length(i)};
  check_index(i);
  auto it = std::lower_bound(doc_offsets_.begin(), doc_offsets_.end(), offsets_[i]);
  std::vector<int64_t> out;
  for (; *it < offsets_[i + 1]; ++it) out.push_back(*(it + 1) - *it);
  return out;
}

namespace {

// ---- templates (docs/data.md quotes them; the strings are specification) -------------------

enum class Template { kAlpacaZh, kAlpaca, kChatml, kPlain };

Template template_named(const std::string& name) {
  if (name == "alpaca_zh") return Template::kAlpacaZh;
  if (name == "alpaca") return Template::kAlpaca;
  if (name == "chatml") return Template::kChatml;
  if (name == "plain") return Template::kPlain;
  throw ConfigError(fmt::format(
      "template: unknown template \"{}\"; choose alpaca_zh, alpaca, chatml or plain", name));
}

// One exchange: what the user asks (instruction + optional input) and the reply, which is
// what gets trained.
struct Turn {
  std::string instruction;
  std::string input;
  std::string output;
};

struct Conversation {
  std::optional<std::string> system;
  std::vector<Turn> turns;
};

struct RenderedTurn {
  std::string prompt;
  std::string response;
};

RenderedTurn render_turn(Template t, const Conversation& c, size_t k) {
  const Turn& turn = c.turns[k];
  const bool first_with_system = k == 0 && c.system.has_value();
  if (t == Template::kChatml) {
    std::string prompt;
    if (first_with_system) prompt = "<|im_start|>system\n" + *c.system + "<|im_end|>\n";
    const std::string user =
        turn.input.empty() ? turn.instruction : turn.instruction + "\n" + turn.input;
    prompt += "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
    return {prompt, turn.output + "<|im_end|>\n"};
  }
  // The other templates have no system slot: it opens the first instruction.
  const std::string instruction =
      first_with_system ? *c.system + "\n" + turn.instruction : turn.instruction;
  std::string prompt;
  switch (t) {
    case Template::kAlpacaZh:
      prompt = "### 指令：" + instruction + "\n" + (turn.input.empty() ? "" : turn.input + "\n") +
               "### 回答：";
      break;
    case Template::kAlpaca:
      prompt = "### Instruction:\n" + instruction + "\n\n" +
               (turn.input.empty() ? "" : "### Input:\n" + turn.input + "\n\n") + "### Response:\n";
      break;
    case Template::kPlain:
      prompt = instruction + turn.input;
      break;
    case Template::kChatml:
      break;  // handled above
  }
  return {prompt, turn.output};
}

}  // namespace

std::string render_prompt(const std::string& template_name, const std::string& instruction,
                          const std::string& input) {
  Conversation c;
  c.turns.push_back(Turn{instruction, input, ""});
  return render_turn(template_named(template_name), c, 0).prompt;
}

namespace {

// ---- encoding ------------------------------------------------------------------------------

struct Example {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;

  void append(const std::vector<int32_t>& piece, bool trained) {
    ids.insert(ids.end(), piece.begin(), piece.end());
    if (trained) {
      labels.insert(labels.end(), piece.begin(), piece.end());
    } else {
      labels.insert(labels.end(), piece.size(), kIgnoreLabel);
    }
  }
};

// Prompt and response are encoded separately and their ids concatenated (as LLaMA-Factory
// does), so the boundary between masked and trained tokens is exact for any tokenizer.
Example encode_conversation(const Conversation& c, Template t, const Tokenizer& tok,
                            bool train_on_prompt) {
  Example e;
  if (tok.add_bos() && tok.bos_id() >= 0) e.append({tok.bos_id()}, train_on_prompt);
  for (size_t k = 0; k < c.turns.size(); ++k) {
    RenderedTurn r = render_turn(t, c, k);
    e.append(tok.encode(r.prompt), train_on_prompt);
    e.append(tok.encode(r.response), true);
    // ChatML's <|im_end|> already ends the turn.
    if (t != Template::kChatml && tok.eos_id() >= 0) e.append({tok.eos_id()}, true);
  }
  return e;
}

Example encode_text(const std::string& text, const Tokenizer& tok) {
  Example e;
  if (tok.add_bos() && tok.bos_id() >= 0) e.append({tok.bos_id()}, true);
  e.append(tok.encode(text), true);
  if (tok.eos_id() >= 0) e.append({tok.eos_id()}, true);
  return e;
}

// ---- line formats --------------------------------------------------------------------------

std::vector<int32_t> token_array(json::ObjectReader& r, const char* key, int64_t vocab_size,
                                 bool allow_ignore) {
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr || !v->IsArray() || v->Empty()) r.fail(key, "a non-empty array of token ids");
  std::vector<int32_t> out;
  out.reserve(v->Size());
  for (rapidjson::SizeType k = 0; k < v->Size(); ++k) {
    const rapidjson::Value& x = (*v)[k];
    std::optional<int64_t> id = x.IsNumber() ? json::as_integer(x) : std::nullopt;
    const bool ok = id && ((*id >= 0 && *id < vocab_size) || (allow_ignore && *id == kIgnoreLabel));
    if (!ok) {
      r.fail_value(key,
                   fmt::format("entry {} is {}: expected an integer in [0, {}){} (the "
                               "model's vocabulary)",
                               k, json::render(x), vocab_size, allow_ignore ? " or -100" : ""));
    }
    out.push_back(static_cast<int32_t>(*id));
  }
  return out;
}

Example parse_tokens(json::ObjectReader& r, int64_t id_limit) {
  Example e;
  e.ids = token_array(r, "input_ids", id_limit, false);
  e.labels = r.has("labels") ? token_array(r, "labels", id_limit, true) : e.ids;
  if (e.labels.size() != e.ids.size()) {
    r.fail_value("labels", fmt::format("has {} entries but input_ids has {}; give one label per "
                                       "token (or leave labels out to train every token)",
                                       e.labels.size(), e.ids.size()));
  }
  return e;
}

Conversation parse_messages(json::ObjectReader& r, const std::string& where) {
  const rapidjson::Value* v = r.find("messages");
  if (v == nullptr || !v->IsArray() || v->Empty()) {
    r.fail("messages", "a non-empty array of {\"role\", \"content\"} objects");
  }
  Conversation c;
  std::optional<std::string> user;  // a user message waiting for its reply
  for (rapidjson::SizeType i = 0; i < v->Size(); ++i) {
    json::ObjectReader m((*v)[i], fmt::format("messages[{}]", i), where);
    std::optional<std::string> role = m.choice("role", {"system", "user", "assistant"});
    if (!role) m.fail("role", "one of \"system\", \"user\", \"assistant\"");
    std::string content = m.required_string("content");
    if (*role == "system") {
      if (i != 0) m.fail_value("role", "a system message must be the first message");
      c.system = std::move(content);
    } else if (*role == "user") {
      if (user) m.fail_value("role", "two user messages in a row; each needs an assistant reply");
      user = std::move(content);
    } else {
      if (!user) m.fail_value("role", "an assistant message must follow a user message");
      c.turns.push_back({std::move(*user), "", std::move(content)});
      user.reset();
    }
  }
  if (user || c.turns.empty()) {
    r.fail_value("messages", "must end with an assistant reply to a user message");
  }
  return c;
}

// The example on one line. A malformed line throws ConfigError "<file>:<line>: ...".
Example parse_line(std::string_view line, const std::string& where, const Tokenizer& tok,
                   Template t, bool train_on_prompt, int64_t id_limit) {
  rapidjson::Document doc;
  doc.Parse(line.data(), line.size());
  if (doc.HasParseError()) {
    throw ConfigError(fmt::format("{}: invalid JSON at column {}: {}", where,
                                  doc.GetErrorOffset() + 1,
                                  rapidjson::GetParseError_En(doc.GetParseError())));
  }
  json::ObjectReader r(doc, "", where);
  // The first of these keys decides the format (docs/data.md).
  if (doc.HasMember("input_ids")) return parse_tokens(r, id_limit);
  if (doc.HasMember("messages")) {
    return encode_conversation(parse_messages(r, where), t, tok, train_on_prompt);
  }
  if (doc.HasMember("instruction")) {
    Conversation c;
    Turn turn;
    turn.instruction = r.required_string("instruction");
    turn.input = r.string("input").value_or("");
    turn.output = r.required_string("output");
    c.turns.push_back(std::move(turn));
    return encode_conversation(c, t, tok, train_on_prompt);
  }
  if (doc.HasMember("text")) return encode_text(r.required_string("text"), tok);
  std::string keys;
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    keys += fmt::format("{}\"{}\"", keys.empty() ? "" : ", ", it->name.GetString());
  }
  throw ConfigError(fmt::format(
      "{}: unknown format: expected a \"text\", \"instruction\" (with \"output\"), \"messages\" "
      "or \"input_ids\" key, found {}",
      where, keys.empty() ? "an empty object" : "keys " + keys));
}

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n'; });
}

bool has_trained_label(const Example& e) {
  return std::any_of(e.labels.begin(), e.labels.end(), [](int32_t l) { return l != kIgnoreLabel; });
}

}  // namespace

Dataset tokenize_jsonl(const std::string& path, const Tokenizer& tok, const DataOptions& o,
                       DatasetStats* stats) {
  const Template t = template_named(o.template_name);
  if (o.max_length < 1) {
    throw ConfigError(fmt::format("max_length: expected an integer >= 1, found {}", o.max_length));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw IoError(fmt::format("cannot open data file '{}': {}", path, std::strerror(errno)));
  }
  Dataset dataset;
  DatasetStats s;
  std::string first_skipped;
  const int64_t id_limit = o.token_id_limit > 0 ? o.token_id_limit : tok.vocab_size();
  // Lines are read in batches and parsed + encoded on all worker threads (the tokenizer is
  // thread-safe); the outcomes are then taken in file order, so errors, skips and the dataset
  // are exactly those of a sequential pass.
  struct Outcome {
    Example example;
    std::string error;         // a malformed line's message
    std::exception_ptr fatal;  // anything else, rethrown where a sequential pass would throw it
  };
  constexpr size_t kBatchLines = 8192;
  const int threads = cpu_worker_threads();
  std::vector<std::pair<int64_t, std::string>> batch;  // (line number, text)
  std::vector<Outcome> outcomes;
  auto work = [&](int64_t first, int64_t last) {
    for (size_t i = static_cast<size_t>(first); i < static_cast<size_t>(last); ++i) {
      try {
        outcomes[i].example = parse_line(batch[i].second, fmt::format("{}:{}", path, batch[i].first), tok, t,
                                         o.train_on_prompt, id_limit);
      } catch (const ConfigError& error) {
        outcomes[i].error = error.what();
      } catch (...) {
        outcomes[i].fatal = std::current_exception();
      }
    }
  };
  auto flush = [&] {
    outcomes.assign(batch.size(), Outcome());
    parallel_ranges(static_cast<int64_t>(batch.size()), threads, work);
    for (Outcome& out : outcomes) {
      if (out.fatal) std::rethrow_exception(out.fatal);
      ++s.lines;
      if (!out.error.empty()) {
        if (!o.skip_bad_lines) {
          throw ConfigError(fmt::format("{} (fix the line, or set skip_bad_lines to skip malformed lines)", out.error));
        }
        if (s.skipped_lines++ == 0) first_skipped = out.error;
        continue;
      }
      Example& e = out.example;
      if (static_cast<int64_t>(e.ids.size()) > o.max_length) {  // keep the start
        e.ids.resize(o.max_length);
        e.labels.resize(o.max_length);
      }
      if (!has_trained_label(e)) {
        ++s.dropped_examples;
        continue;
      }
      dataset.add(e.ids, e.labels);
    }
    batch.clear();
  };
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (number == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // UTF-8 BOM
    if (is_blank(line)) continue;
    batch.emplace_back(number, std::move(line));
    line.clear();
    if (batch.size() == kBatchLines) flush();
  }
  flush();
  if (in.bad()) throw IoError(fmt::format("cannot read data file '{}'", path));

  s.examples = dataset.size();
  s.tokens = dataset.total_tokens();
  if (s.skipped_lines > 0) {
    log::warn("{}: skipped {} malformed line(s) (skip_bad_lines); the first: {}", path,
              s.skipped_lines, first_skipped);
  }
  if (s.dropped_examples > 0) {
    log::warn(
        "{}: dropped {} example(s) left without a trained token by truncation to "
        "max_length {} (raise max_length, or set train_on_prompt)",
        path, s.dropped_examples, o.max_length);
  }
  if (s.lines == 0) {
    throw ConfigError(
        fmt::format("data file '{}' is empty: expected one JSON object per line", path));
  }
  if (dataset.empty()) {
    throw ConfigError(fmt::format(
        "data file '{}' has no usable example: {} line(s), {} skipped as malformed, {} dropped "
        "without a trained token after truncation to max_length {}",
        path, s.lines, s.skipped_lines, s.dropped_examples, o.max_length));
  }
  if (stats != nullptr) *stats = s;
  return dataset;
}

}  // namespace zt
