// Preference data: the record layouts of TRL and LLaMA-Factory for pairs and for KTO's unpaired
// examples, each sequence with the prompt masked, TRL's truncation, KTO's KL sequences, and the
// records no loss can learn from dropped and counted (docs/preference.md).
#include <fmt/format.h>
#include <rapidjson/document.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "data/encoding.hpp"
#include "data/stats.hpp"
#include "util/log.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

using data::Chat;
using data::ChatTemplate;
using data::Example;

// Why a record is dropped (Parsed::dropped): what its answers are before any cut, then what
// the cut to max_length makes of them.
enum Drop { kKept = 0, kIdentical, kEmpty, kLongPrompt, kCutAnswer, kCutIdentical };

// A pair before encoding: the prompt as text (TRL's standard form) or as a chat, and the two
// answers.
struct Pair {
  std::optional<std::string> text_prompt;
  Chat chat;
  std::string chosen, rejected;
};

// TRL's conversational lists: OpenAI-style messages under the record's own keys.
constexpr data::ChatLayout kPromptList{"prompt", "role", "content"};
constexpr data::ChatLayout kChosenList{"chosen", "role", "content"};
constexpr data::ChatLayout kRejectedList{"rejected", "role", "content"};

// The one answer at `key`: a string, a message object, or a list holding one assistant message.
std::string parse_answer(json::ObjectReader& r, const char* key, const std::string& where) {
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) r.fail(key, "the answer: a string or an assistant message");
  if (v->IsString()) return json::text(*v);
  const rapidjson::Value* message = v;
  if (v->IsArray()) {
    if (v->Size() != 1) {
      r.fail_value(key, fmt::format("has {} messages: a preference answer is one assistant "
                                    "message",
                                    v->Size()));
    }
    message = &(*v)[0];
  }
  json::ObjectReader m(*message, key, where);
  const bool sharegpt = m.has("from");
  const char* role_key = sharegpt ? "from" : "role";
  const std::string role_text = m.required_string(role_key);
  if (data::normalized_role(role_text) != std::optional<std::string>("assistant")) {
    m.fail_value(role_key, fmt::format("\"{}\": an answer is an assistant message", role_text));
  }
  return data::message_text(m, sharegpt ? "value" : "content");
}

// TRL's extract_prompt for answers that hold their prompt: the longest common start; for text,
// a space before the split stays with the answers.
void extract_prompt(json::ObjectReader& r, const std::string& where, Pair& p) {
  const rapidjson::Value* c = r.find("chosen");
  const rapidjson::Value* j = r.find("rejected");
  if (c->IsString() && j != nullptr && j->IsString()) {
    const std::string a = json::text(*c), b = json::text(*j);
    size_t n = 0;
    while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
    if (n > 0 && a[n - 1] == ' ') --n;
    p.text_prompt = a.substr(0, n);
    p.chosen = a.substr(n);
    p.rejected = b.substr(n);
    return;
  }
  Chat ca = data::parse_chat(r, where, kChosenList);
  Chat cb = data::parse_chat(r, where, kRejectedList);
  if (ca.system != cb.system || ca.messages.size() != cb.messages.size()) {
    r.fail_value("rejected",
                 "holds another conversation than chosen: with no \"prompt\", both "
                 "must be the same conversation up to their last assistant message");
  }
  for (size_t k = 0; k + 1 < ca.messages.size(); ++k) {
    if (ca.messages[k].content != cb.messages[k].content) {
      r.fail_value("rejected",
                   fmt::format("message {} differs from chosen's: with no \"prompt\", only the "
                               "last assistant message may differ",
                               k));
    }
  }
  p.chosen = ca.messages.back().content;
  p.rejected = cb.messages.back().content;
  ca.messages.pop_back();
  p.chat = std::move(ca);
}

// Pair record `doc`, read through `r`.
Pair parse_pair(const rapidjson::Document& doc, json::ObjectReader& r, const std::string& where) {
  Pair p;
  if (!doc.HasMember("chosen") || !doc.HasMember("rejected")) {
    throw ConfigError(fmt::format(
        "{}: a preference record needs \"chosen\" and \"rejected\": the layouts are TRL's "
        "{{\"prompt\", \"chosen\", \"rejected\"}} (text or messages, \"prompt\" optional), "
        "LLaMA-Factory's alpaca (\"instruction\", \"input\", \"chosen\", \"rejected\") and "
        "sharegpt (\"conversations\", \"chosen\", \"rejected\")",
        where));
  }
  if (doc.HasMember("conversations")) {  // LLaMA-Factory's sharegpt
    p.chat = data::parse_chat(r, where, data::kShareGpt, /*ends_with_user=*/true);
  } else if (doc.HasMember("instruction")) {  // LLaMA-Factory's alpaca
    p.chat = data::parse_instruction_prompt(r);
  } else if (doc.HasMember("prompt")) {  // TRL's
    const rapidjson::Value& prompt = doc["prompt"];
    if (prompt.IsString()) {
      p.text_prompt = json::text(prompt);
      if (!doc["chosen"].IsString() || !doc["rejected"].IsString()) {
        r.fail_value(doc["chosen"].IsString() ? "rejected" : "chosen",
                     "must be text when the prompt is text (TRL's standard form)");
      }
    } else {
      p.chat = data::parse_chat(r, where, kPromptList, /*ends_with_user=*/true);
    }
  } else {
    extract_prompt(r, where, p);
    return p;
  }
  p.chosen = parse_answer(r, "chosen", where);
  p.rejected = parse_answer(r, "rejected", where);
  return p;
}

// One sequence: the prompt, then the answer, labelled on the answer only.
Example encode_sequence(const Pair& p, const std::string& answer, const ChatTemplate& t,
                        const Tokenizer& tok, size_t limit) {
  Example e;
  if (p.text_prompt) {
    // TRL's standard form: the tokenizer's own start (bos), the prompt and the answer encoded
    // as one text, eos after; the answer is what follows the prompt's own ids.
    std::vector<int32_t> prompt = tok.prefix_ids();
    const std::vector<int32_t> prompt_text = tok.encode(*p.text_prompt);
    prompt.insert(prompt.end(), prompt_text.begin(), prompt_text.end());
    e.append(tok.prefix_ids(), false);
    e.append(encode_prefix(tok, *p.text_prompt + answer, limit), false);
    if (tok.eos_id() >= 0 && (e.ids.empty() || e.ids.back() != tok.eos_id())) {
      e.append({tok.eos_id()}, false);
    }
    for (size_t i = std::min(prompt.size(), e.ids.size()); i < e.ids.size(); ++i) {
      e.labels[i] = e.ids[i];
    }
    return e;
  }
  Chat chat = p.chat;
  chat.messages.push_back({"assistant", answer, ""});
  e = data::encode_chat(chat, t, tok, /*train_on_prompt=*/false, limit);
  // Earlier replies are part of the prompt: only the last trained run (the answer, with its
  // end of turn) keeps its labels.
  size_t start = e.labels.size();
  while (start > 0 && e.labels[start - 1] == kIgnoreLabel) --start;
  while (start > 0 && e.labels[start - 1] != kIgnoreLabel) --start;
  std::fill(e.labels.begin(), e.labels.begin() + static_cast<std::ptrdiff_t>(start), kIgnoreLabel);
  return e;
}

size_t prompt_tokens(const Example& e) {
  size_t n = 0;
  while (n < e.labels.size() && e.labels[n] == kIgnoreLabel) ++n;
  return n;
}

// TRL's truncation of one sequence: the prompt to its last `max_prompt_length` tokens, then
// the first (keep_start) or last (keep_end) max_length tokens.
void truncate(Example& e, const DataOptions& o) {
  const size_t max_length = static_cast<size_t>(o.max_length);
  if (o.max_prompt_length > 0) {
    const size_t prompt = prompt_tokens(e), keep = static_cast<size_t>(o.max_prompt_length);
    if (prompt > keep) {
      e.ids.erase(e.ids.begin(), e.ids.begin() + static_cast<std::ptrdiff_t>(prompt - keep));
      e.labels.erase(e.labels.begin(),
                     e.labels.begin() + static_cast<std::ptrdiff_t>(prompt - keep));
    }
  }
  if (e.ids.size() <= max_length) return;
  if (o.truncation_mode == "keep_end") {
    const auto cut = static_cast<std::ptrdiff_t>(e.ids.size() - max_length);
    e.ids.erase(e.ids.begin(), e.ids.begin() + cut);
    e.labels.erase(e.labels.begin(), e.labels.begin() + cut);
  } else {
    e.ids.resize(max_length);
    e.labels.resize(max_length);
  }
}

// One answer's sequence, encoded whole (where the answer starts is only known then: an answer
// cut away would leave an earlier reply looking like the last one), truncated as TRL does;
// kKept, or why no answer token is left: the prompt alone fills max_length (keep_start), or
// (keep_end) what a template writes after the answer does (llama3_original's next header).
Drop truncate_answer(Example& e, const DataOptions& o) {
  if (o.truncation_mode != "keep_end") {
    const size_t prompt = prompt_tokens(e);
    const size_t kept_prompt = o.max_prompt_length > 0
                                   ? std::min(prompt, static_cast<size_t>(o.max_prompt_length))
                                   : prompt;
    if (kept_prompt >= static_cast<size_t>(o.max_length)) return kLongPrompt;
  }
  truncate(e, o);
  return data::has_trained_label(e) ? kKept : kCutAnswer;
}

// A record's answers, each with its KTO label (pairs: chosen 1, rejected 0), as sequences; the
// whole record dropped with the first cause found: an answer empty or identical to the other
// as text, then as tokens, then once cut to max_length.
data::Parsed encode_answers(const Pair& p, const std::vector<std::pair<std::string, bool>>& answers,
                            const Tokenizer& tok, const ChatTemplate& t, const DataOptions& o,
                            int64_t id_limit) {
  data::Parsed out;
  out.answers = static_cast<int>(answers.size());
  out.templated = !p.text_prompt.has_value();
  const auto drop = [&](Drop why) {
    out.examples.clear();
    out.desirable.clear();
    out.dropped = why;
    return out;
  };
  for (const auto& answer : answers) {
    if (answer.first.empty()) return drop(kEmpty);
  }
  if (answers.size() == 2 && answers[0].first == answers[1].first) return drop(kIdentical);
  if (tok.vocab_size() > id_limit) throw data::TextNeedsVocabulary{};
  for (const auto& answer : answers) {
    out.examples.push_back(encode_sequence(p, answer.first, t, tok, SIZE_MAX));
    out.desirable.push_back(answer.second ? 1 : 0);
    // Text that encodes to no token of its own (merged into the prompt's last one) is empty.
    if (!data::has_trained_label(out.examples.back())) return drop(kEmpty);
  }
  const bool pair = out.examples.size() == 2;
  if (pair && out.examples[0].ids == out.examples[1].ids) return drop(kIdentical);
  for (Example& e : out.examples) {
    if (const Drop why = truncate_answer(e, o); why != kKept) return drop(why);
  }
  if (pair && out.examples[0].ids == out.examples[1].ids) return drop(kCutIdentical);
  return out;
}

data::Parsed encode_pair(const Pair& p, const Tokenizer& tok, const ChatTemplate& t,
                         const DataOptions& o, int64_t id_limit) {
  return encode_answers(p, {{p.chosen, true}, {p.rejected, false}}, tok, t, o, id_limit);
}

data::Parsed encode_pair(std::string_view line, const std::string& where, const Tokenizer& tok,
                         const ChatTemplate& t, const DataOptions& o, int64_t id_limit) {
  const rapidjson::Document doc = json::parse(line, where);
  json::ObjectReader r(doc, "", where);
  if (!(r.has("chosen") && r.has("rejected")) && (r.has("kto_tag") || r.has("label"))) {
    throw data::RecordOfAnotherStage(
        fmt::format("{}: an example marked good or bad (\"{}\"), not a pair of answers: train such "
                    "examples with --stage kto",
                    where, r.has("kto_tag") ? "kto_tag" : "label"));
  }
  return encode_pair(parse_pair(doc, r, where), tok, t, o, id_limit);
}

// A KTO record: TRL's unpaired {"prompt", "completion", "label"}; a chat ending with the
// completion (OpenAI "messages" or ShareGPT "conversations", LLaMA-Factory's KTO layouts) or an
// alpaca record with its "output", each with a boolean "label" (or "kto_tag"); or a pair record,
// which is two examples as TRL's unpair_preference_dataset makes them: chosen desirable,
// rejected not.
data::Parsed encode_unpaired(std::string_view line, const std::string& where, const Tokenizer& tok,
                             const ChatTemplate& t, const DataOptions& o, int64_t id_limit) {
  rapidjson::Document doc = json::parse(line, where);
  json::ObjectReader r(doc, "", where);
  if (r.has("chosen") && r.has("rejected")) {
    return encode_pair(parse_pair(doc, r, where), tok, t, o, id_limit);
  }
  const char* tag = !r.has("label") && r.has("kto_tag") ? "kto_tag" : "label";
  const std::optional<bool> desirable = r.boolean(tag);
  if (!desirable) {
    r.fail(tag,
           "true or false: whether the completion is desirable (KTO's records are TRL's "
           "{\"prompt\", \"completion\", \"label\"}, LLaMA-Factory's \"messages\" or "
           "\"conversations\" with \"label\" / \"kto_tag\", an alpaca record with \"output\" "
           "and \"label\", or a preference pair)");
  }
  Pair p;
  std::string completion;
  if (r.has("completion")) {  // TRL's
    const rapidjson::Value* prompt = r.find("prompt");
    if (prompt == nullptr) r.fail("prompt", "the prompt the completion answers");
    if (prompt->IsString()) {
      p.text_prompt = json::text(*prompt);
      if (!doc["completion"].IsString()) {
        r.fail_value("completion", "must be text when the prompt is text (TRL's standard form)");
      }
    } else {
      p.chat = data::parse_chat(r, where, kPromptList, /*ends_with_user=*/true);
    }
    completion = parse_answer(r, "completion", where);
  } else if (r.has("messages") || r.has("conversations")) {  // the last reply is the completion
    p.chat = data::parse_chat(r, where, r.has("messages") ? data::kOpenAi : data::kShareGpt);
    completion = p.chat.messages.back().content;
    p.chat.messages.pop_back();
  } else if (r.has("instruction")) {  // alpaca
    p.chat = data::parse_instruction_prompt(r);
    completion = r.required_string("output");
  } else {
    throw ConfigError(fmt::format(
        "{}: a KTO record needs a completion: TRL's {{\"prompt\", \"completion\", \"label\"}}, "
        "\"messages\" / \"conversations\" ending with the reply, an alpaca record with "
        "\"output\", or a preference pair (\"chosen\", \"rejected\")",
        where));
  }
  return encode_answers(p, {{completion, *desirable}}, tok, t, o, id_limit);
}

// KTO's KL sequence of example i: its prompt with the completion of the example before it (the
// first takes the last's), cut as the sequences are.
Example kl_sequence(const Example& own, const Example& other, const DataOptions& o) {
  const size_t prompt = prompt_tokens(own), start = prompt_tokens(other);
  Example e;
  e.ids.assign(own.ids.begin(), own.ids.begin() + static_cast<std::ptrdiff_t>(prompt));
  e.labels.assign(prompt, kIgnoreLabel);
  e.ids.insert(e.ids.end(), other.ids.begin() + static_cast<std::ptrdiff_t>(start),
               other.ids.end());
  e.labels.insert(e.labels.end(), other.labels.begin() + static_cast<std::ptrdiff_t>(start),
                  other.labels.end());
  truncate(e, o);
  return e;
}

}  // namespace

Dataset tokenize_preference_jsonl(const std::string& path, const Tokenizer& tok,
                                  const DataOptions& o, DatasetStats* stats) {
  const ChatTemplate& t = data::chat_template(o.template_name);
  if (o.max_length < 2) {
    throw ConfigError(
        fmt::format("max_length: preference data needs at least 2 tokens (a prompt "
                    "token and an answer token), found {}",
                    o.max_length));
  }
  if (o.truncation_mode != "keep_start" && o.truncation_mode != "keep_end") {
    throw ConfigError(fmt::format("truncation_mode: expected keep_start or keep_end, found \"{}\"",
                                  o.truncation_mode));
  }
  if (o.max_prompt_length < 0) {
    throw ConfigError(
        fmt::format("max_prompt_length: expected an integer >= 0, found {}", o.max_prompt_length));
  }
  if (!o.glm_prompt_layout.empty()) {
    throw ConfigError("mode (ChatGLM-Finetuning's data layout) does not apply to preference data");
  }
  if (o.train_on_prompt) {
    throw ConfigError(
        "train_on_prompt: preference losses compare the answers; the prompt is never scored");
  }
  DatasetStats s;
  const int64_t id_limit = o.token_id_limit > 0 ? o.token_id_limit : tok.vocab_size();
  const auto parse = [&](std::string_view text, const std::string& where) {
    return o.kto ? encode_unpaired(text, where, tok, t, o, id_limit)
                 : encode_pair(text, where, tok, t, o, id_limit);
  };
  // Pairs are examples 2i (chosen) and 2i + 1 (rejected), as read. A KTO example i is example
  // 2i and its KL sequence 2i + 1, both with its label: its sequences wait for the rotation.
  Dataset dataset;
  std::vector<Example> sequences;
  std::vector<uint8_t> desirable;
  int64_t dropped = 0;
  const auto take = [&](data::Parsed& p) {
    switch (p.dropped) {
      case kIdentical:
        ++s.identical_pairs;
        break;
      case kEmpty:
        ++s.empty_answers;
        break;
      case kLongPrompt:
        ++s.long_prompts;
        break;
      case kCutAnswer:
        ++s.cut_answers;
        break;
      case kCutIdentical:
        ++s.cut_identical_pairs;
        break;
      default:
        // KTO: each example's KL sequence shares its prompt's format.
        s.templated_examples +=
            p.templated ? static_cast<int64_t>(p.examples.size()) * (o.kto ? 2 : 1) : 0;
        if (!o.kto) {
          for (const Example& e : p.examples) dataset.add(e.ids, e.labels);
          return;
        }
        for (Example& e : p.examples) sequences.push_back(std::move(e));
        desirable.insert(desirable.end(), p.desirable.begin(), p.desirable.end());
        return;
    }
    ++dropped;
    // The rows the record would have made: a pair's two sequences; per KTO example, its own and
    // its KL sequence.
    s.dropped_examples += o.kto ? 2 * p.answers : p.answers;
  };
  data::read_records(path, tok, o, id_limit, parse, take, s);
  if (o.kto) {
    std::vector<uint8_t> labels;
    const size_t n = sequences.size();
    for (size_t i = 0; i < n; ++i) {
      dataset.add(sequences[i].ids, sequences[i].labels);
      const Example kl = kl_sequence(sequences[i], sequences[(i + n - 1) % n], o);
      dataset.add(kl.ids, kl.labels);
      labels.insert(labels.end(), 2, desirable[i]);
    }
    dataset.set_desirable(std::move(labels));
  }
  const char* what = o.kto ? "KTO record(s)" : "preference pair(s)";
  s.examples = dataset.size();
  s.tokens = dataset.total_tokens();
  const std::string causes = data::drop_causes(s, o);
  if (dropped > 0) {
    log::warn("{}: dropped {} of {} {}{}, which no loss can learn from: {}", path, dropped,
              s.lines - s.skipped_lines, what,
              o.kto ? fmt::format(" ({} KTO examples)", s.dropped_examples / 2) : "", causes);
  }
  if (dataset.empty()) {
    throw ConfigError(
        fmt::format("data file '{}' has no usable {}: {} record(s), {} "
                    "skipped as malformed; dropped: {}",
                    path, o.kto ? "KTO example" : "preference pair", s.lines, s.skipped_lines,
                    causes.empty() ? "none" : causes));
  }
  if (stats != nullptr) *stats = s;
  return dataset;
}

}  // namespace zt
