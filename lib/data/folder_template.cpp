// A model folder's own chat template (or a template file the user names), rendered by the Jinja
// interpreter as transformers' apply_chat_template renders it. See chat_templates.hpp.
#include "data/folder_template.hpp"

#include <fmt/format.h>
#include <rapidjson/document.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>

#include "data/jinja.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"

namespace zt::data {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A special token in tokenizer_config.json: a string, or an AddedToken object's "content".
std::optional<std::string> token_text(const rapidjson::Value& v) {
  if (v.IsString()) return json::text(v);
  if (v.IsObject() && v.HasMember("content") && v["content"].IsString())
    return json::text(v["content"]);
  return std::nullopt;
}

class FolderTemplate final : public ChatTemplate {
 public:
  FolderTemplate(std::string name, const std::string& text, const std::string& source,
                 jinja::Dict specials)
      : name_(std::move(name)), template_(text, source), specials_(std::move(specials)) {
    marker_ = end_of_turn_marker();
  }

  const std::string& name() const override { return name_; }
  bool whole_text() const override { return true; }

  std::vector<Piece> render(const Chat& chat) const override {
    const jinja::List messages = to_messages(chat);
    const jinja::Rendered full = run(messages, messages.size(), false);
    const std::string& text = full.text;
    std::vector<std::pair<size_t, size_t>> spans = full.generation;
    if (spans.empty()) {
      // Each reply is where the conversation rendered with that reply replaced by a sentinel
      // parts from it (wherever the template writes the reply, and however it trims or splits
      // it), then the end-of-turn marker when it follows.
      for (size_t i = 0; i < messages.size(); ++i) {
        if (messages[i].get("role").str() != "assistant") continue;
        jinja::List probe = messages;
        probe[i] = with_content(messages[i], kSentinel);
        const std::string other = run(probe, probe.size(), false).text;
        size_t start = 0;
        while (start < text.size() && start < other.size() && text[start] == other[start]) ++start;
        // Where the renderings part before the reply's own text (a template that writes a
        // reply's reasoning between its markers: "<think>step</think>" for the reply,
        // "</think>" for the probe), they can part inside a tag; the reply starts at its "<",
        // never in the middle of a special token.
        if (start > 0 && start < other.size() && other[start] != kSentinel[0]) {
          const size_t open = text.rfind('<', start - 1);
          if (open != std::string::npos && start - open <= kMaxTag &&
              text.find_first_of("> \t\n", open) >= start)
            start = open;
        }
        size_t tail = 0;
        while (tail < text.size() - start && tail < other.size() - start &&
               text[text.size() - 1 - tail] == other[other.size() - 1 - tail])
          ++tail;
        size_t end = text.size() - tail;
        if (!marker_.empty() && text.compare(end, marker_.size(), marker_) == 0)
          end += marker_.size();
        spans.emplace_back(start, end);
      }
    }
    std::vector<Piece> pieces;
    size_t at = 0;
    for (const auto& [a, b] : spans) {
      if (a < at || b < a || b > text.size()) continue;
      if (a > at) pieces.push_back({text.substr(at, a - at), false});
      if (b > a) pieces.push_back({text.substr(a, b - a), true});
      at = b;
    }
    if (at < text.size()) pieces.push_back({text.substr(at), false});
    return pieces;
  }

  std::string prompt(const Chat& chat) const override {
    const jinja::List messages = to_messages(chat);
    return run(messages, messages.size(), true).text;
  }

 private:
  // Text no reply holds: where a rendering with it parts from the real one is the reply.
  static constexpr const char* kSentinel = "\x01zerotrain-reply\x02";
  // The longest special token a reply's start is moved back over ("<|start_of_role|>").
  static constexpr size_t kMaxTag = 64;

  static jinja::Value with_content(const jinja::Value& message, const std::string& content) {
    jinja::Dict d = message.dict();
    for (auto& [k, v] : d) {
      if (k.is_string() && k.string() == "content") v = jinja::Value(content);
    }
    return jinja::Value(std::move(d));
  }

  // What the template writes right after a reply to close its turn ("<end_of_turn>", "</s>",
  // "<|end|>"): the text after a reply common to a conversation that ends with it and one
  // that goes on, up to the end of its last marker (`\n`, `>`, `]`, `}`), without the
  // whitespace after it. Empty when the probes cannot tell (a template that refuses them).
  std::string end_of_turn_marker() const {
    const auto message = [](const char* role, const char* content) {
      return jinja::Value(
          jinja::Dict{{"role", jinja::Value(role)}, {"content", jinja::Value(content)}});
    };
    const std::string reply = "\x01zerotrain-b\x02";
    const jinja::List closed{message("user", "\x01zerotrain-a\x02"),
                             message("assistant", reply.c_str())};
    jinja::List going_on = closed;
    going_on.push_back(message("user", "\x01zerotrain-c\x02"));
    std::string last, next;
    try {
      last = run(closed, closed.size(), false).text;
      next = run(going_on, going_on.size(), false).text;
    } catch (const ConfigError&) {
      return "";
    }
    const size_t a = last.find(reply), b = next.find(reply);
    if (a == std::string::npos || b == std::string::npos) return "";
    const std::string x = last.substr(a + reply.size()), y = next.substr(b + reply.size());
    size_t n = 0;
    while (n < x.size() && n < y.size() && x[n] == y[n]) ++n;
    if (n < x.size() && n < y.size()) {
      while (n > 0 && x[n - 1] != '\n' && x[n - 1] != '>' && x[n - 1] != ']' && x[n - 1] != '}')
        --n;
    }
    while (n > 0 && (x[n - 1] == '\n' || x[n - 1] == ' ')) --n;
    return x.substr(0, n);
  }

  static jinja::List to_messages(const Chat& chat) {
    jinja::List out;
    if (chat.system) {
      out.emplace_back(
          jinja::Dict{{"role", jinja::Value("system")}, {"content", jinja::Value(*chat.system)}});
    }
    for (const Message& m : chat.messages) {
      const std::string content = m.input.empty() ? m.content : m.content + "\n" + m.input;
      out.emplace_back(
          jinja::Dict{{"role", jinja::Value(m.role)}, {"content", jinja::Value(content)}});
    }
    return out;
  }

  jinja::Rendered run(const jinja::List& messages, size_t count, bool generation_prompt) const {
    jinja::Dict context = specials_;
    context.emplace_back(
        "messages", jinja::Value(jinja::List(
                        messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(count))));
    context.emplace_back("add_generation_prompt", jinja::Value(generation_prompt));
    context.emplace_back("tools", jinja::Value::none());
    context.emplace_back("documents", jinja::Value::none());
    return template_.render(context);
  }

  std::string name_;
  jinja::Template template_;
  jinja::Dict specials_;
  std::string marker_;
};

}  // namespace

std::optional<std::pair<std::string, std::string>> template_text_in(const std::string& file) {
  if (!ends_with(file, ".json")) return std::pair{files::read_text(file, "chat template"), file};
  rapidjson::Document doc =
      json::parse(files::read_text(file, "tokenizer config", files::kMaxTokenizerBytes), file);
  if (!doc.IsObject()) return std::nullopt;
  auto it = doc.FindMember("chat_template");
  if (it == doc.MemberEnd() || it->value.IsNull()) return std::nullopt;
  if (it->value.IsString()) return std::pair{json::text(it->value), file};
  if (it->value.IsArray()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    for (const auto& entry : it->value.GetArray()) {
      if (entry.IsObject() && entry.HasMember("name") && entry["name"].IsString() &&
          json::text(entry["name"]) == "default" && entry.HasMember("template") &&
          entry["template"].IsString()) {
        return std::pair{json::text(entry["template"]), file};
      }
    }
  }
  throw ConfigError(
      fmt::format("{}: chat_template: expected a template string or a list holding a \"default\" "
                  "template",
                  file));
}

std::string with_template_kwargs(const std::string& name, const std::string& kwargs_json,
                                 const std::string& option) {
  if (kwargs_json.empty()) return name;
  const rapidjson::Document doc = json::parse(kwargs_json, option);  // nesting bounded
  if (!doc.IsObject()) {
    throw ConfigError(fmt::format(
        "{}: expected a JSON object of chat template kwargs (such as {{\"enable_thinking\": "
        "false}}), found {}",
        option, kwargs_json));
  }
  if (doc.ObjectEmpty()) return name;
  return name + "?" + json::dump(doc);
}

const ChatTemplate& folder_chat_template_named(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<ChatTemplate>> loaded;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded.find(name); it != loaded.end()) return *it->second;
  const size_t prefix = std::string(kFolderTemplatePrefix).size();
  const size_t kwargs_at = name.find(kTemplateKwargsSeparator, prefix);
  const std::string file =
      name.substr(prefix, kwargs_at == std::string::npos ? std::string::npos : kwargs_at - prefix);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    throw ConfigError(
        fmt::format("template {}: '{}' is not a file (give jinja:PATH with a chat "
                    "template .jinja file or a tokenizer_config.json)",
                    name, file));
  }
  const auto text = template_text_in(file);
  if (!text) throw ConfigError(fmt::format("template {}: '{}' has no chat_template", name, file));
  // The special tokens transformers passes to the template: the folder's tokenizer_config.json.
  jinja::Dict specials;
  const std::string config =
      (std::filesystem::path(file).parent_path() / "tokenizer_config.json").string();
  if (std::filesystem::is_regular_file(config, ec)) {
    rapidjson::Document doc = json::parse(
        files::read_text(config, "tokenizer config", files::kMaxTokenizerBytes), config);
    if (doc.IsObject()) {
      for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                              "cls_token", "mask_token"}) {
        auto it = doc.FindMember(key);
        if (it == doc.MemberEnd()) continue;
        if (auto t = token_text(it->value)) specials.emplace_back(key, jinja::Value(*t));
      }
    }
  }
  // The kwargs go to the template beside the special tokens, overriding them, as
  // apply_chat_template's **kwargs do.
  if (kwargs_at != std::string::npos) {
    const jinja::Value kwargs = jinja::from_json(name.substr(kwargs_at + 1), name);
    if (!kwargs.is_dict()) {
      throw ConfigError(fmt::format("template {}: the kwargs are not a JSON object", name));
    }
    for (const auto& entry : kwargs.dict()) {
      const std::string key = entry.first.str();
      specials.erase(std::remove_if(specials.begin(), specials.end(),
                                    [&](const auto& kv) { return kv.first.str() == key; }),
                     specials.end());
      specials.emplace_back(entry.first, entry.second);
    }
  }
  auto made = std::make_unique<FolderTemplate>(name, text->first, text->second, specials);
  return *loaded.emplace(name, std::move(made)).first->second;
}

}  // namespace zt::data
