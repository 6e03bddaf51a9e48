// JSONL datasets: the line formats, the prompt templates with their label masks, truncation,
// and tokenize_jsonl, which fills a Dataset (the Dataset class itself: flat_dataset.cpp).
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "data/chat_templates.hpp"
#include "data/encoding.hpp"
#include "data/folder_template.hpp"
#include "data/record_layouts.hpp"
#include "data/records.hpp"
#include "data/stats.hpp"
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
  o.completion_only_loss = args.completion_only_loss.value_or(true);
  o.assistant_only_loss = args.assistant_only_loss.value_or(true);
  o.text_field = args.dataset_text_field;
  o.skip_bad_lines = args.skip_bad_lines;
  o.glm_prompt_layout = args.glm_prompt_layout;
  o.max_source_length = args.max_source_length;
  o.skip_truncated = args.skip_truncated;
  o.preference = args.stage == "dpo" || args.stage == "kto";
  o.kto = args.stage == "kto";
  o.truncation_mode = args.truncation_mode;
  o.max_prompt_length = args.max_prompt_length;
  return o;
}

namespace data {

// ---- encoding ------------------------------------------------------------------------------

namespace {

// How many leading ids two sequences share.
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

}  // namespace

// Every encoding below stops at `limit` ids (max_length): what truncation keeps is computed
// from as much text as it needs (encode_prefix), so a huge record costs memory in proportion to
// max_length, and the ids are those of encoding it whole and then truncating.
Example encode_chat(const Chat& chat, const ChatTemplate& t, const Tokenizer& tok,
                    bool train_on_prompt, size_t limit, size_t prompt_replies) {
  Example e;
  const std::vector<data::Piece> pieces = t.render(chat);
  // Which pieces train: each reply is one trained piece, and the first `prompt_replies` of
  // them belong to a prompt (a prompt-completion record's earlier turns).
  std::vector<bool> trained(pieces.size(), train_on_prompt);
  for (size_t k = 0, reply = 0; k < pieces.size(); ++k) {
    if (pieces[k].trained && reply++ >= prompt_replies) trained[k] = true;
  }
  if (!t.whole_text()) {
    // Instruction templates: prompt and response encoded separately and their ids concatenated
    // (as LLaMA-Factory does), so the mask boundary is exact for any tokenizer.
    e.append(tok.prefix_ids(), train_on_prompt);
    for (size_t k = 0; k < pieces.size() && e.ids.size() < limit; ++k) {
      e.append(encode_prefix(tok, pieces[k].text, limit - e.ids.size()), trained[k]);
      // Every reply ends with eos, trained with it.
      if (pieces[k].trained && t.appends_eos() && tok.eos_id() >= 0) {
        e.append({tok.eos_id()}, trained[k]);
      }
    }
    return e;
  }
  // A model's chat format: the whole text encoded at once, exactly as apply_chat_template's
  // ids. A piece boundary is found as the ids the text up to it shares with the whole: where a
  // token spans the boundary (" Hello" after "[/INST]"), it belongs to the piece it ends in.
  std::string text;
  for (const data::Piece& p : pieces) text += p.text;
  e.ids = encode_prefix(tok, text, limit);
  e.labels.assign(e.ids.size(), kIgnoreLabel);
  size_t offset = 0, start = 0;
  for (size_t k = 0; k < pieces.size() && start < e.ids.size(); ++k) {
    offset += pieces[k].text.size();
    const size_t end =
        k + 1 == pieces.size()
            ? e.ids.size()
            : common_prefix(encode_prefix(tok, std::string_view(text).substr(0, offset), limit),
                            e.ids);
    if (trained[k]) {
      for (size_t i = start; i < end; ++i) e.labels[i] = e.ids[i];
    }
    start = std::max(start, end);
  }
  // A format without an end of turn (GLM-4) ends a trained conversation with eos, trained.
  if (t.appends_eos() && tok.eos_id() >= 0 && e.ids.size() < limit && !pieces.empty() &&
      pieces.back().trained) {
    e.append({tok.eos_id()}, trained.back());
  }
  return e;
}

Example encode_text(const std::string& text, const Tokenizer& tok, size_t limit) {
  Example e;
  e.append(tok.prefix_ids(), true);
  e.append(encode_prefix(tok, text, limit - std::min(limit, e.ids.size())), true);
  if (tok.eos_id() >= 0) e.append({tok.eos_id()}, true);
  return e;
}

namespace {

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

}  // namespace

// The role a message's role text names, in the spellings the ShareGPT datasets in the wild use.
std::optional<std::string> normalized_role(const std::string& role) {
  if (role == "system") return std::string("system");
  if (role == "user" || role == "human") return std::string("user");
  if (role == "assistant" || role == "gpt" || role == "chatgpt" || role == "bard" ||
      role == "bing" || role == "model" || role == "bot") {
    return std::string("assistant");
  }
  return std::nullopt;
}

// A message's text: a string, or OpenAI's list of content parts ({"type": "text", "text"}).
std::string message_text(json::ObjectReader& m, const char* key) {
  const rapidjson::Value* v = m.find(key);
  if (v != nullptr && v->IsArray()) {
    std::string text;
    for (rapidjson::SizeType k = 0; k < v->Size(); ++k) {
      const rapidjson::Value& part = (*v)[k];
      if (!part.IsObject() || !part.HasMember("text") || !part["text"].IsString() ||
          (part.HasMember("type") &&
           !(part["type"].IsString() && json::text(part["type"]) == "text"))) {
        m.fail_value(
            key,
            fmt::format("part {} is not a {{\"type\": \"text\", \"text\": ...}} part (only text "
                        "content is supported)",
                        k));
      }
      text += json::text(part["text"]);
    }
    return text;
  }
  return m.required_string(key);
}

Chat parse_chat(json::ObjectReader& r, const std::string& where, const ChatLayout& layout,
                bool ends_with_user) {
  const rapidjson::Value* v = r.find(layout.list);
  if (v == nullptr || !v->IsArray() || v->Empty()) {
    r.fail(layout.list, fmt::format("a non-empty array of {{\"{}\", \"{}\"}} objects", layout.role,
                                    layout.content));
  }
  Chat c;
  if (layout.system_at_top) {
    if (auto system = r.string("system"); system && !system->empty()) c.system = *system;
  }
  std::optional<std::string> user;  // a user message waiting for its reply
  for (rapidjson::SizeType i = 0; i < v->Size(); ++i) {
    json::ObjectReader m((*v)[i], fmt::format("{}[{}]", layout.list, i), where);
    const std::string role_text = m.required_string(layout.role);
    std::optional<std::string> role = normalized_role(role_text);
    if (!role) {
      m.fail_value(
          layout.role,
          fmt::format("\"{}\" is not a role zerotrain trains: expected system, user (human) "
                      "or assistant (gpt)",
                      role_text));
    }
    std::string content = message_text(m, layout.content);
    if (*role == "system") {
      if (i != 0 || c.system)
        m.fail_value(layout.role, "a system message must be the first message, and only one");
      c.system = std::move(content);
    } else if (*role == "user") {
      if (user)
        m.fail_value(layout.role, "two user messages in a row; each needs an assistant reply");
      user = std::move(content);
    } else {
      if (!user) m.fail_value(layout.role, "an assistant message must follow a user message");
      c.messages.push_back({"user", std::move(*user), ""});
      c.messages.push_back({"assistant", std::move(content), ""});
      user.reset();
    }
  }
  if (ends_with_user) {
    if (!user) {
      r.fail_value(layout.list, "must end with a user message (the prompt the answers reply to)");
    }
    c.messages.push_back({"user", std::move(*user), ""});
  } else if (user || c.messages.empty()) {
    r.fail_value(layout.list, "must end with an assistant reply to a user message");
  }
  return c;
}

Chat parse_instruction_prompt(json::ObjectReader& r) {
  Chat c;
  if (auto system = r.string("system"); system && !system->empty()) c.system = *system;
  if (const rapidjson::Value* h = r.find("history"); h != nullptr && !h->IsNull()) {
    if (!h->IsArray()) r.fail("history", "a list of [instruction, output] pairs");
    for (rapidjson::SizeType k = 0; k < h->Size(); ++k) {
      const rapidjson::Value& pair = (*h)[k];
      if (!pair.IsArray() || pair.Size() != 2 || !pair[0].IsString() || !pair[1].IsString()) {
        r.fail_value("history",
                     fmt::format("entry {} is not an [instruction, output] pair of strings", k));
      }
      c.messages.push_back({"user", json::text(pair[0]), ""});
      c.messages.push_back({"assistant", json::text(pair[1]), ""});
    }
  }
  std::string instruction = r.required_string("instruction");
  std::string input = r.string("input").value_or("");
  c.messages.push_back({"user", std::move(instruction), std::move(input)});
  return c;
}

namespace {

// Alpaca-style instruction data: instruction, optional input, output, and (as LLaMA-Factory's
// alpaca layout) an optional system and earlier exchanges in history: [[instruction, output], ...].
Chat parse_instruction(json::ObjectReader& r) {
  Chat c = parse_instruction_prompt(r);
  c.messages.push_back({"assistant", r.required_string("output"), ""});
  return c;
}

// TRL's prompt-completion record in its standard (text) form: the prompt and the completion
// encoded as one text after the tokenizer's prefix (bos), then eos unless the completion ends
// with it (TRL's add_eos). The completion is what follows the prompt's own ids (TRL's
// completion_mask); every token trains unless `completion_only`.
Example encode_prompt_completion(const std::string& prompt, const std::string& completion,
                                 const Tokenizer& tok, bool completion_only, size_t limit) {
  Example e;
  e.append(tok.prefix_ids(), !completion_only);
  e.append(encode_prefix(tok, prompt + completion, limit - std::min(limit, e.ids.size())),
           !completion_only);
  if (tok.eos_id() >= 0 && (e.ids.empty() || e.ids.back() != tok.eos_id())) {
    e.append({tok.eos_id()}, true);
  }
  const size_t prompt_ids = tok.prefix_ids().size() + encode_prefix(tok, prompt, limit).size();
  for (size_t i = std::min(prompt_ids, e.ids.size()); i < e.ids.size(); ++i) e.labels[i] = e.ids[i];
  return e;
}

// TRL's conversational lists: the prompt's messages, and the completion's, which is the
// assistant's reply.
constexpr data::ChatLayout kPromptList{"prompt", "role", "content"};

std::string parse_completion_message(json::ObjectReader& r, const std::string& where) {
  const rapidjson::Value* v = r.find("completion");
  if (v != nullptr && v->IsArray() && v->Size() > 1) {
    r.fail_value("completion",
                 fmt::format("has {} messages: zerotrain trains a completion of one assistant "
                             "message (put earlier turns in the prompt)",
                             v->Size()));
  }
  if (v == nullptr || !v->IsArray() || v->Empty()) {
    r.fail("completion",
           "a list of one assistant message, as the prompt is a list of messages (TRL's "
           "conversational form)");
  }
  json::ObjectReader m((*v)[0], "completion[0]", where);
  const std::string role_text = m.required_string("role");
  if (data::normalized_role(role_text) != std::optional<std::string>("assistant")) {
    m.fail_value("role", fmt::format("\"{}\": a completion is the assistant's reply", role_text));
  }
  return data::message_text(m, "content");
}

// TRL's prompt-completion record (docs/data.md): text, or conversational — the chat of the
// prompt's messages and the completion's reply through the template, as the messages record
// of the same turns. The completion trains (TRL's completion_only_loss); without
// completion_only_loss every reply does (assistant_only_loss), or every token.
Example parse_prompt_completion(const rapidjson::Document& doc, json::ObjectReader& r,
                                const std::string& where, const Tokenizer& tok,
                                const ChatTemplate& t, const DataOptions& o, size_t limit) {
  if (!doc.HasMember("completion")) {
    throw ConfigError(fmt::format(
        "{}: a \"prompt\" record needs a \"completion\" (TRL's prompt-completion layout){}", where,
        doc.HasMember("chosen") ? "; preference pairs (\"chosen\", \"rejected\") train with "
                                  "--stage dpo"
                                : ""));
  }
  const bool completion_only = o.completion_only_loss && !o.train_on_prompt;
  const rapidjson::Value& prompt = doc["prompt"];
  if (prompt.IsString()) {
    if (!doc["completion"].IsString()) {
      r.fail("completion", "a string, as the prompt is (TRL's standard form)");
    }
    return encode_prompt_completion(json::text(prompt), json::text(doc["completion"]), tok,
                                    completion_only, limit);
  }
  if (!prompt.IsArray()) {
    r.fail("prompt", "a string (text) or a list of messages (conversational)");
  }
  Chat chat = data::parse_chat(r, where, kPromptList, /*ends_with_user=*/true);
  // The replies among the prompt's messages: as many trained pieces as the prompt renders.
  size_t prompt_replies = 0;
  for (const data::Piece& p : t.render(chat)) prompt_replies += p.trained ? 1 : 0;
  chat.messages.push_back({"assistant", parse_completion_message(r, where), ""});
  if (completion_only) {
    return data::encode_chat(chat, t, tok, /*train_on_prompt=*/false, limit, prompt_replies);
  }
  return data::encode_chat(chat, t, tok, o.train_on_prompt || !o.assistant_only_loss, limit);
}

// The example in one record, encoded up to `limit` ids. A malformed record throws ConfigError
// "<where>: ...". `truncated` is set when ChatGLM-Finetuning's layout cut the record,
// `pretokenized` for input_ids records (whole, whatever `limit`), `templated` for records the
// chat template formats.
Example parse_line(std::string_view line, const std::string& where, const Tokenizer& tok,
                   const ChatTemplate& t, const RecordLayout* layout, const DataOptions& o,
                   int64_t id_limit, size_t limit, bool* truncated, bool* pretokenized,
                   bool* templated) {
  rapidjson::Document doc = json::parse(line, where);
  json::ObjectReader r(doc, "", where);
  const bool train_on_prompt = o.train_on_prompt;
  // The first of these keys decides the format (docs/data.md).
  *pretokenized = doc.HasMember("input_ids");
  if (*pretokenized) return parse_tokens(r, id_limit);
  // Every layout below but plain text and TRL's text prompt + completion goes through the
  // template (ChatGLM-Finetuning's writes the template's prompt itself).
  *templated = true;
  if (tok.vocab_size() > id_limit) throw TextNeedsVocabulary{};  // this record has text to encode
  if (doc.HasMember("chosen") && doc.HasMember("rejected")) {
    throw RecordOfAnotherStage(fmt::format(
        "{}: a preference pair (\"chosen\" / \"rejected\"), which supervised fine-tuning "
        "cannot train; train it with --stage dpo (or --stage kto for unpaired feedback)",
        where));
  }
  if (doc.HasMember("kto_tag") || (doc.HasMember("completion") && doc.HasMember("label"))) {
    throw RecordOfAnotherStage(fmt::format(
        "{}: an example marked good or bad (\"{}\"), which supervised fine-tuning cannot "
        "train; train it with --stage kto",
        where, doc.HasMember("kto_tag") ? "kto_tag" : "label"));
  }
  if (layout != nullptr && doc.HasMember("instruction")) {
    // data_set.py reads exactly these three keys, instruction + input concatenated.
    const std::string instruction = r.required_string("instruction") + r.required_string("input");
    return layout->encode(instruction, r.required_string("output"), truncated);
  }
  // TRL's assistant_only_loss false trains every token of a conversation.
  const bool train_chat = train_on_prompt || !o.assistant_only_loss;
  if (doc.HasMember("messages"))
    return encode_chat(parse_chat(r, where, kOpenAi), t, tok, train_chat, limit);
  if (doc.HasMember("conversations")) {
    return encode_chat(parse_chat(r, where, kShareGpt), t, tok, train_chat, limit);
  }
  if (doc.HasMember("instruction"))
    return encode_chat(parse_instruction(r), t, tok, train_on_prompt, limit);
  if (doc.HasMember("prompt")) {
    *templated = !doc["prompt"].IsString();
    return parse_prompt_completion(doc, r, where, tok, t, o, limit);
  }
  const char* text_key = o.text_field.c_str();
  if (doc.HasMember(text_key)) {
    *templated = false;
    return encode_text(r.required_string(text_key), tok, limit);
  }
  std::string keys;
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    keys += fmt::format("{}\"{}\"", keys.empty() ? "" : ", ", json::text(it->name));
  }
  throw ConfigError(fmt::format(
      "{}: unknown layout: the layouts are \"{}\" (plain text{}), \"prompt\" + \"completion\" "
      "(TRL's, text or messages), \"instruction\" + \"output\" (alpaca, optional \"input\"), "
      "\"messages\" (OpenAI chat: role/content), \"conversations\" (ShareGPT: from/value) and "
      "\"input_ids\" (pre-tokenized, optional \"labels\"); found {}",
      where, o.text_field, o.text_field == "text" ? "" : ", dataset_text_field",
      keys.empty() ? "an empty object" : "keys " + keys));
}

}  // namespace

bool has_trained_label(const Example& e) {
  return std::any_of(e.labels.begin(), e.labels.end(), [](int32_t l) { return l != kIgnoreLabel; });
}

}  // namespace data

using data::Chat;
using data::ChatTemplate;
using data::Example;

std::string render_prompt(const std::string& template_name, const std::string& instruction,
                          const std::string& input) {
  Chat c;
  c.messages.push_back({"user", instruction, input});
  return data::chat_template(template_name).prompt(c);
}

std::vector<int32_t> encode_prompt(const std::string& template_name, const Tokenizer& tok,
                                   const std::string& instruction, const std::string& input) {
  const ChatTemplate& t = data::chat_template(template_name);
  std::vector<int32_t> ids;
  if (!t.whole_text()) ids = tok.prefix_ids();
  const std::vector<int32_t> text = tok.encode(render_prompt(template_name, instruction, input));
  ids.insert(ids.end(), text.begin(), text.end());
  return ids;
}

std::vector<std::string> template_names() {
  return data::chat_template_names();
}

std::string resolve_template(const std::string& name, const std::string& model_dir,
                             const Tokenizer& tok, std::string* source,
                             const std::string& template_kwargs, const std::string& kwargs_option) {
  std::string chosen = name;
  const bool kwargs = !template_kwargs.empty() && template_kwargs != "{}";
  // LLaMA-Factory's names for formats that write what the model's own chat template writes
  // (its gemma3 is Gemma 3's turns, its phi4 Phi-4's): the folder's template, as auto reads it.
  static const std::set<std::string> kModelOwn{"gemma",         "gemma2",   "gemma3",
                                               "mistral_small", "phi4",     "phi4_mini",
                                               "gpt_oss",       "glm4_moe", "deepseek3"};
  if (name == "auto" || kModelOwn.count(name) != 0) {
    if (name != "auto" && !data::has_folder_chat_template(model_dir)) {
      throw ConfigError(fmt::format(
          "template {} (LLaMA-Factory's name) is the model's own chat format, read from its "
          "folder, but {}; give --template jinja:FILE with the model's chat template",
          name, model_dir.empty() ? "there is no model folder" : "'" + model_dir + "' has none"));
    }
    std::string why;
    chosen = data::detect_chat_template(model_dir, &why, /*as_written=*/kwargs);
    if (source != nullptr) {
      *source = name == "auto" ? why
                               : fmt::format(
                                     "--template {} (LLaMA-Factory's name for the model's "
                                     "own format): {}",
                                     name, why);
    }
  } else if (source != nullptr) {
    *source = "--template";
  }
  if (kwargs) {
    if (chosen.rfind(data::kFolderTemplatePrefix, 0) != 0) {
      throw ConfigError(fmt::format(
          "{}: template kwargs go to a chat template rendered as written (--template auto with "
          "the model folder's own, or jinja:FILE); {} takes none",
          kwargs_option, chosen));
    }
    // A name resumed from a checkpoint carries its kwargs already.
    const size_t at = chosen.find(data::kTemplateKwargsSeparator);
    chosen = data::with_template_kwargs(chosen.substr(0, at), template_kwargs, kwargs_option);
  }
  const ChatTemplate& t = data::chat_template(chosen);
  // Checked in the order the format writes them, together: ChatGLM's tokenizer reads "sop" as
  // its token only right after [gMASK], as the format writes it.
  const std::vector<std::string> specials = t.special_tokens();
  std::string joined;
  for (const std::string& special : specials) joined += special;
  if (!specials.empty() && tok.encode(joined).size() != specials.size()) {
    std::string missing = specials.front();
    for (const std::string& special : specials) {
      if (tok.encode(special).size() != 1) {
        missing = special;
        break;
      }
    }
    throw ConfigError(
        fmt::format("template {} writes the token {}, which this tokenizer does not have as one "
                    "token (a tokenizer of another model family?); choose another --template",
                    chosen, missing));
  }
  return chosen;
}

std::optional<std::string> recorded_template(const std::string& dir) {
  return data::recorded_chat_template(dir);
}

void record_template(const std::string& dir, const std::string& name) {
  data::record_chat_template(dir, name);
}

void data::read_records(const std::string& path, const Tokenizer& tok, const DataOptions& o,
                        int64_t id_limit, const RecordParser& parse,
                        const std::function<void(Parsed&)>& take, DatasetStats& s) {
  RecordReader reader(path);
  std::string first_skipped;
  // Records are read in batches and parsed + encoded on all worker threads (the tokenizer is
  // thread-safe); the outcomes are then taken in file order.
  struct Outcome {
    Parsed parsed;
    std::string error;         // a malformed record's message
    std::exception_ptr fatal;  // anything else, rethrown where a sequential pass would throw it
  };
  // A batch ends at kBatchLines records or kBatchBytes of text: long records then still
  // report progress (and meet a stop) every few seconds.
  constexpr size_t kBatchLines = 8192;
  constexpr size_t kBatchBytes = size_t{4} << 20;
  const int threads = cpu_worker_threads();
  std::vector<Record> batch;
  size_t batch_bytes = 0;
  std::vector<Outcome> outcomes;
  auto work = [&](int64_t first, int64_t last) {
    for (size_t i = static_cast<size_t>(first); i < static_cast<size_t>(last); ++i) {
      try {
        outcomes[i].parsed = parse(batch[i].text, reader.where(batch[i]));
      } catch (const RecordOfAnotherStage&) {
        outcomes[i].fatal = std::current_exception();
      } catch (const ConfigError& error) {
        outcomes[i].error = error.what();
      } catch (const TextNeedsVocabulary&) {
        try {
          check_tokenizer_fits(tok, id_limit);
        } catch (...) {
          outcomes[i].fatal = std::current_exception();
        }
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
          // Skipping helps a file whose other records are good: not one whose first is bad.
          throw ConfigError(
              fmt::format("{} ({})", out.error,
                          s.lines - s.skipped_lines > 1
                              ? "fix the record, or set skip_bad_lines to skip malformed ones"
                              : "fix the record; docs/data.md lists the layouts"));
        }
        if (s.skipped_lines++ == 0) first_skipped = out.error;
        continue;
      }
      take(out.parsed);
    }
    batch.clear();
    batch_bytes = 0;
    if (o.on_progress) o.on_progress({s.lines, reader.bytes_read(), reader.size()});
  };
  for (Record record; reader.next(record);) {
    batch_bytes += record.text.size();
    batch.push_back(std::move(record));
    if (batch.size() == kBatchLines || batch_bytes >= kBatchBytes) flush();
  }
  flush();
  if (s.skipped_lines > 0) {
    log::warn("{}: skipped {} malformed line(s) (skip_bad_lines); the first: {}", path,
              s.skipped_lines, first_skipped);
  }
  if (s.lines == 0) {
    throw ConfigError(
        fmt::format("data file '{}' is empty: expected one JSON object per line (JSONL) or a "
                    "JSON array of objects",
                    path));
  }
}

Dataset tokenize_jsonl(const std::string& path, const Tokenizer& tok, const DataOptions& o,
                       DatasetStats* stats) {
  if (o.preference) return tokenize_preference_jsonl(path, tok, o, stats);
  const ChatTemplate& t = data::chat_template(o.template_name);
  if (o.max_length < 1) {
    throw ConfigError(fmt::format("max_length: expected an integer >= 1, found {}", o.max_length));
  }
  const std::unique_ptr<data::RecordLayout> layout = data::record_layout(o, tok);
  if (o.truncation_mode == "keep_end") {
    throw ConfigError(
        "truncation_mode keep_end: supervised fine-tuning keeps the start of a long example "
        "(TRL's default, keep_start); keep_end applies to preference data (--stage dpo, kto)");
  }
  for (const char* key : {"", "input_ids", "messages", "conversations", "instruction", "prompt"}) {
    if (o.text_field == key) {
      throw ConfigError(fmt::format(
          "dataset_text_field: \"{}\" {}; name the key of plain-text records (TRL's default: "
          "text)",
          o.text_field, *key == 0 ? "is empty" : "is the key of another layout"));
    }
  }
  Dataset dataset;
  DatasetStats s;
  const int64_t id_limit = o.token_id_limit > 0 ? o.token_id_limit : tok.vocab_size();
  // Why an example is dropped (Parsed::dropped).
  enum Drop { kKept = 0, kUntrained, kTruncated, kSkipTruncated };
  const size_t max_length = static_cast<size_t>(o.max_length);
  const auto parse = [&](std::string_view text, const std::string& where) {
    data::Parsed p;
    bool pretokenized = false;
    // Encoded one id past max_length: whether the cut takes anything is then known.
    Example e = data::parse_line(text, where, tok, t, layout.get(), o, id_limit, max_length + 1,
                                 &p.truncated, &pretokenized, &p.templated);
    const bool cut = e.ids.size() > max_length || p.truncated;
    // No trained label in the whole example: known when nothing was cut, or for ids given whole.
    const bool untrained = !data::has_trained_label(e) && (pretokenized || !cut);
    if (e.ids.size() > max_length) {  // keep the start
      e.ids.resize(max_length);
      e.labels.resize(max_length);
    }
    if (p.truncated && o.skip_truncated) {
      p.dropped = kSkipTruncated;
    } else if (!data::has_trained_label(e)) {
      p.dropped = untrained ? kUntrained : kTruncated;
    } else {
      p.examples.push_back(std::move(e));
    }
    return p;
  };
  const auto take = [&](data::Parsed& p) {
    switch (p.dropped) {
      case kUntrained:
        ++s.untrained_examples;
        break;
      case kTruncated:
        ++s.truncated_examples;
        break;
      case kSkipTruncated:
        ++s.skipped_truncated;
        break;
      default:
        dataset.add(p.examples.front().ids, p.examples.front().labels);
        s.templated_examples += p.templated ? 1 : 0;
        return;
    }
    ++s.dropped_examples;
  };
  data::read_records(path, tok, o, id_limit, parse, take, s);

  s.examples = dataset.size();
  s.tokens = dataset.total_tokens();
  if (s.dropped_examples > 0) {
    log::warn("{}: dropped {} example(s): {}{}", path, s.dropped_examples, data::drop_causes(s, o),
              s.truncated_examples > 0 ? " (raise max_length, or set train_on_prompt)" : "");
  }
  if (dataset.empty()) {
    throw ConfigError(fmt::format(
        "data file '{}' has no usable example: {} line(s), {} skipped as malformed, {} dropped{}",
        path, s.lines, s.skipped_lines, s.dropped_examples,
        s.dropped_examples > 0 ? " (" + data::drop_causes(s, o) + ")" : ""));
  }
  if (stats != nullptr) *stats = s;
  return dataset;
}

}  // namespace zt
