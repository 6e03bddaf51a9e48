// The templates. Model formats follow their chat_template line by line (the reference texts
// are in data/chat_templates/); each renderer's comments name what it reproduces.
#include "data/chat_templates.hpp"

#include "data/folder_template.hpp"
#include "data/jinja.hpp"

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt::data {

// The models' chat_template texts (data/chat_templates/<name>.jinja), embedded at build time.
extern const std::vector<std::pair<std::string, std::string>> kReferenceChatTemplates;

namespace {

// ---- Python's string methods, as the templates call them -------------------------------------

// Whether the code point at the start of `s` (UTF-8) is whitespace by Python's str.isspace,
// and its length in bytes (0 when it is not whitespace).
size_t leading_space(std::string_view s) {
  if (s.empty()) return 0;
  const auto c = static_cast<unsigned char>(s[0]);
  if (c < 0x80) return jinja::is_python_space(c) ? 1 : 0;
  auto cp_at = [&](size_t n, uint32_t lead_mask) -> uint32_t {
    if (s.size() < n) return 0;
    uint32_t cp = c & lead_mask;
    for (size_t i = 1; i < n; ++i) cp = cp << 6 | (static_cast<unsigned char>(s[i]) & 0x3f);
    return cp;
  };
  uint32_t cp = 0;
  size_t n = 0;
  if ((c & 0xe0) == 0xc0) n = 2, cp = cp_at(2, 0x1f);
  if ((c & 0xf0) == 0xe0) n = 3, cp = cp_at(3, 0x0f);
  if (n == 0) return 0;
  return jinja::is_python_space(cp) ? n : 0;
}

// The length of the whitespace code point that ends `s`, 0 when none.
size_t trailing_space(std::string_view s) {
  for (size_t n = 1; n <= 3 && n <= s.size(); ++n) {
    const auto c = static_cast<unsigned char>(s[s.size() - n]);
    if (n == 1 && c < 0x80) return leading_space(s.substr(s.size() - 1));
    if ((c & 0xc0) != 0x80)
      return leading_space(s.substr(s.size() - n)) == n ? n : 0;  // a lead byte
  }
  return 0;
}

// str.strip() (jinja's trim filter): Unicode whitespace off both ends.
std::string py_strip(std::string_view s) {
  while (size_t n = leading_space(s)) s.remove_prefix(n);
  while (size_t n = trailing_space(s)) s.remove_suffix(n);
  return std::string(s);
}

std::string lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return std::string(s);
}

std::string rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return std::string(s);
}

std::string user_text(const Message& m) {
  return m.input.empty() ? m.content : m.content + "\n" + m.input;
}

// Pieces under construction: consecutive pieces of the same kind are merged.
class Pieces {
 public:
  Pieces& add(std::string text, bool trained = false) {
    if (text.empty()) return *this;
    if (!out_.empty() && out_.back().trained == trained) {
      out_.back().text += text;
    } else {
      out_.push_back({std::move(text), trained});
    }
    return *this;
  }
  std::vector<Piece> take() { return std::move(out_); }

 private:
  std::vector<Piece> out_;
};

std::string joined(std::vector<Piece> pieces) {
  std::string s;
  for (const Piece& p : pieces) s += p.text;
  return s;
}

class Named : public ChatTemplate {
 public:
  explicit Named(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }

 protected:
  [[noreturn]] void refuse(const std::string& what) const {
    throw ConfigError(fmt::format("template {}: {}", name_, what));
  }

 private:
  std::string name_;
};

// ---- zerotrain's instruction templates (docs/data.md quotes them) -----------------------------

class Instruction final : public Named {
 public:
  enum Kind { kAlpacaZh, kAlpaca, kChatml, kPlain, kChatGlm2 };
  Instruction(std::string name, Kind kind) : Named(std::move(name)), kind_(kind) {}
  bool whole_text() const override { return false; }
  bool appends_eos() const override { return kind_ != kChatml; }

  std::vector<Piece> render(const Chat& chat) const override {
    Pieces out;
    for (size_t k = 0; k + 1 < chat.messages.size(); k += 2) {
      out.add(prompt_of(chat, k)).add(response_of(chat.messages[k + 1]), true);
    }
    return out.take();
  }
  std::string prompt(const Chat& chat) const override {
    return prompt_of(chat, chat.messages.size() - 1);
  }

 private:
  // The prompt of the exchange whose user message is messages[k].
  std::string prompt_of(const Chat& chat, size_t k) const {
    const Message& m = chat.messages[k];
    const bool first_with_system = k == 0 && chat.system.has_value();
    if (kind_ == kChatml) {
      std::string p =
          first_with_system ? "<|im_start|>system\n" + *chat.system + "<|im_end|>\n" : "";
      return p + "<|im_start|>user\n" + user_text(m) + "<|im_end|>\n<|im_start|>assistant\n";
    }
    // The other templates have no system slot: it opens the first instruction.
    const std::string instruction = first_with_system ? *chat.system + "\n" + m.content : m.content;
    switch (kind_) {
      case kAlpacaZh:
        return "### 指令：" + instruction + "\n" + (m.input.empty() ? "" : m.input + "\n") +
               "### 回答：";
      case kAlpaca:
        return "### Instruction:\n" + instruction + "\n\n" +
               (m.input.empty() ? "" : "### Input:\n" + m.input + "\n\n") + "### Response:\n";
      case kChatGlm2:  // ChatGLM2's build_prompt, as ChatGLM-Finetuning's data_set.py writes it
        return "[Round " + std::to_string(k / 2 + 1) + "]\n\n问：" + instruction + m.input +
               "\n\n答：";
      default:
        return instruction + m.input;
    }
  }
  std::string response_of(const Message& m) const {
    return kind_ == kChatml ? m.content + "<|im_end|>\n" : m.content;
  }

  Kind kind_;
};

// ---- Qwen: ChatML with the family's system rules ----------------------------------------------

class Qwen final : public Named {
 public:
  enum Generation { kQwen2, kQwen25, kQwen3 };
  Qwen(std::string name, Generation g) : Named(std::move(name)), g_(g) {}
  bool whole_text() const override { return true; }
  std::vector<std::string> special_tokens() const override {
    return {"<|im_start|>", "<|im_end|>"};
  }

  std::vector<Piece> render(const Chat& chat) const override {
    Pieces out;
    system(chat, out);
    // Qwen3: assistant turns after the last user message show their reasoning block; the
    // last one always has one, empty when the reply has none.
    const int64_t n = static_cast<int64_t>(chat.messages.size()) + (chat.system ? 1 : 0);
    int64_t last_query = n - 1;
    for (int64_t i = static_cast<int64_t>(chat.messages.size()) - 1; i >= 0; --i) {
      const std::string& c = chat.messages[static_cast<size_t>(i)].content;
      const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                                 c.compare(c.size() - 16, 16, "</tool_response>") == 0;
      if (chat.messages[static_cast<size_t>(i)].role == "user" && !tool_response) {
        last_query = i + (chat.system ? 1 : 0);
        break;
      }
    }
    for (size_t k = 0; k < chat.messages.size(); ++k) {
      const Message& m = chat.messages[k];
      if (m.role == "user") {
        out.add("<|im_start|>user\n" + user_text(m) + "<|im_end|>\n");
        continue;
      }
      const int64_t index = static_cast<int64_t>(k) + (chat.system ? 1 : 0);
      out.add("<|im_start|>assistant\n");
      if (g_ != kQwen3) {
        out.add(m.content + "<|im_end|>", true).add("\n");
        continue;
      }
      std::string content = m.content, reasoning;
      if (const size_t close = m.content.find("</think>"); close != std::string::npos) {
        content =
            lstrip_newlines(std::string_view(m.content).substr(m.content.rfind("</think>") + 8));
        std::string before = rstrip_newlines(std::string_view(m.content).substr(0, close));
        const size_t open = before.rfind("<think>");
        reasoning = lstrip_newlines(open == std::string::npos ? before : before.substr(open + 7));
      }
      if (index > last_query && (k + 1 == chat.messages.size() || !reasoning.empty())) {
        std::string r = rstrip_newlines(lstrip_newlines(reasoning));
        const std::string block = "<think>\n" + r + "\n</think>\n\n";
        // The empty block is what the non-thinking generation prompt writes itself: a prompt.
        out.add(block, !r.empty()).add(lstrip_newlines(content) + "<|im_end|>", true);
      } else {
        out.add(content + "<|im_end|>", true);
      }
      out.add("\n");
    }
    return out.take();
  }

  std::string prompt(const Chat& chat) const override {
    return joined(render(chat)) + "<|im_start|>assistant\n";
  }

 private:
  void system(const Chat& chat, Pieces& out) const {
    if (chat.system) {
      out.add("<|im_start|>system\n" + *chat.system + "<|im_end|>\n");
    } else if (g_ == kQwen2) {
      out.add("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n");
    } else if (g_ == kQwen25) {
      out.add(
          "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
          "assistant.<|im_end|>\n");
    }
  }

  Generation g_;
};

// ---- LLaMA-3 ---------------------------------------------------------------------------------

class Llama3 final : public Named {
 public:
  enum Variant {
    kOriginal,  // 3.0 as first published: the assistant header always closes the text
    kInstruct,  // 3.0 as Meta fixed it: the header only for add_generation_prompt
    kDated,     // 3.1: a system block with fixed dates, always
    kToday,     // 3.2: the same with today's date
  };
  Llama3(std::string name, Variant v) : Named(std::move(name)), v_(v) {}
  bool whole_text() const override { return true; }
  std::vector<std::string> special_tokens() const override {
    return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  }

  std::vector<Piece> render(const Chat& chat) const override {
    Pieces out;
    out.add("<|begin_of_text|>");
    if (v_ == kDated || v_ == kToday) {
      out.add(
          "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
          "2023\nToday Date: " +
          date() + "\n\n" + (chat.system ? py_strip(*chat.system) : "") + "<|eot_id|>");
    } else if (chat.system) {
      out.add("<|start_header_id|>system<|end_header_id|>\n\n" + py_strip(*chat.system) +
              "<|eot_id|>");
    }
    for (const Message& m : chat.messages) {
      out.add("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
      if (m.role == "user") {
        out.add(py_strip(user_text(m)) + "<|eot_id|>");
      } else {
        out.add(py_strip(m.content) + "<|eot_id|>", true);
      }
    }
    if (v_ == kOriginal) out.add(kHeader);
    return out.take();
  }

  std::string prompt(const Chat& chat) const override {
    std::string text = joined(render(chat));
    return v_ == kOriginal ? text : text + kHeader;
  }

 private:
  static constexpr const char* kHeader = "<|start_header_id|>assistant<|end_header_id|>\n\n";
  std::string date() const {
    if (v_ == kDated) return "26 Jul 2024";
    const std::time_t t = std::time(nullptr);
    std::tm local{};
    ::localtime_r(&t, &local);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%d %b %Y", &local);  // strftime_now("%d %b %Y")
    return buf;
  }

  Variant v_;
};

// ---- LLaMA-2 and Mistral: [INST] ... [/INST] ----------------------------------------------------

class Inst final : public Named {
 public:
  enum Variant { kLlama2, kMistral01, kMistral02, kMistral03 };
  Inst(std::string name, Variant v) : Named(std::move(name)), v_(v) {}
  bool whole_text() const override { return true; }
  std::vector<std::string> special_tokens() const override { return {"<s>", "</s>"}; }

  std::vector<Piece> render(const Chat& chat) const override {
    Pieces out;
    if (chat.system && (v_ == kMistral01 || v_ == kMistral02)) {
      refuse(
          "the model's chat template supports only user and assistant roles, not a system message");
    }
    // v0.3's template renders no system message at all (it drops it); so does this.
    if (v_ != kLlama2) out.add("<s>");
    for (size_t k = 0; k < chat.messages.size(); ++k) {
      const Message& m = chat.messages[k];
      if (m.role == "user") {
        std::string content = user_text(m);
        switch (v_) {
          case kLlama2:
            if (k == 0 && chat.system)
              content = "<<SYS>>\n" + *chat.system + "\n<</SYS>>\n\n" + content;
            out.add("<s>[INST] " + py_strip(content) + " [/INST]");
            break;
          case kMistral03:
            out.add(" [INST] " + content + " [/INST]");
            break;
          default:
            out.add("[INST] " + content + " [/INST]");
        }
        continue;
      }
      switch (v_) {
        case kLlama2:
          out.add(" ").add(py_strip(m.content) + " </s>", true);
          break;
        case kMistral01:
          out.add(m.content + "</s>", true).add(" ");
          break;
        case kMistral02:
          out.add(m.content + "</s>", true);
          break;
        case kMistral03:
          out.add(" ").add(m.content + " </s>", true);
          break;
      }
    }
    return out.take();
  }

  // None of these templates has a generation prompt: the text already ends in [/INST].
  std::string prompt(const Chat& chat) const override { return joined(render(chat)); }

 private:
  Variant v_;
};

// ---- ChatGLM3-6B and GLM-4 (glm-4-9b-chat) ---------------------------------------------------

// "[gMASK]sop" (ChatGLM3) or "[gMASK]<sop>" (GLM-4), then "<|role|>\n" + content per message —
// ChatGLM3's template writes "\n " (with a space) and every message, GLM-4's only messages with
// content (its tool descriptions come only with `tools`, which conversations here never carry) —
// and "<|assistant|>" as the generation prompt. Neither template writes an end of turn (the
// model stops on <|user|> or eos); both models' own fine-tuning scripts train each reply's
// "\n" + content and one eos after the conversation, as this format does (appends_eos).
class Glm final : public Named {
 public:
  enum Generation { kChatGlm3, kGlm4 };
  Glm(std::string name, Generation g) : Named(std::move(name)), g_(g) {}
  bool whole_text() const override { return true; }
  bool appends_eos() const override { return true; }
  std::vector<std::string> special_tokens() const override {
    return {"[gMASK]", g_ == kGlm4 ? "<sop>" : "sop", "<|system|>", "<|user|>", "<|assistant|>"};
  }

  std::vector<Piece> render(const Chat& chat) const override {
    const bool glm4 = g_ == kGlm4;
    const std::string newline = glm4 ? "\n" : "\n ";
    // GLM-4's `{% if item['content'] %}`: an empty message writes nothing.
    auto shown = [&](const std::string& text) { return !glm4 || !text.empty(); };
    Pieces out;
    out.add(glm4 ? "[gMASK]<sop>" : "[gMASK]sop");
    if (chat.system && shown(*chat.system)) out.add("<|system|>" + newline + *chat.system);
    for (const Message& m : chat.messages) {
      const std::string text = m.role == "user" ? user_text(m) : m.content;
      if (!shown(text)) continue;
      if (m.role == "user") {
        out.add("<|user|>" + newline + text);
      } else {
        out.add("<|assistant|>").add(newline + text, true);
      }
    }
    return out.take();
  }

  std::string prompt(const Chat& chat) const override {
    return joined(render(chat)) + "<|assistant|>";
  }

 private:
  Generation g_;
};

const std::vector<std::unique_ptr<ChatTemplate>>& all() {
  static const std::vector<std::unique_ptr<ChatTemplate>> t = [] {
    std::vector<std::unique_ptr<ChatTemplate>> v;
    v.push_back(std::make_unique<Instruction>("alpaca_zh", Instruction::kAlpacaZh));
    v.push_back(std::make_unique<Instruction>("alpaca", Instruction::kAlpaca));
    v.push_back(std::make_unique<Instruction>("chatml", Instruction::kChatml));
    v.push_back(std::make_unique<Instruction>("plain", Instruction::kPlain));
    v.push_back(std::make_unique<Instruction>("chatglm2", Instruction::kChatGlm2));
    v.push_back(std::make_unique<Qwen>("qwen2", Qwen::kQwen2));
    v.push_back(std::make_unique<Qwen>("qwen2.5", Qwen::kQwen25));
    v.push_back(std::make_unique<Qwen>("qwen3", Qwen::kQwen3));
    v.push_back(std::make_unique<Llama3>("llama3", Llama3::kInstruct));
    v.push_back(std::make_unique<Llama3>("llama3_original", Llama3::kOriginal));
    v.push_back(std::make_unique<Llama3>("llama3.1", Llama3::kDated));
    v.push_back(std::make_unique<Llama3>("llama3.2", Llama3::kToday));
    v.push_back(std::make_unique<Inst>("llama2", Inst::kLlama2));
    v.push_back(std::make_unique<Inst>("mistral_v0.1", Inst::kMistral01));
    v.push_back(std::make_unique<Inst>("mistral_v0.2", Inst::kMistral02));
    v.push_back(std::make_unique<Inst>("mistral_v0.3", Inst::kMistral03));
    v.push_back(std::make_unique<Glm>("chatglm3", Glm::kChatGlm3));
    v.push_back(std::make_unique<Glm>("glm4", Glm::kGlm4));
    return v;
  }();
  return t;
}

std::string without_whitespace(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\v' && c != '\f') out.push_back(c);
  }
  return out;
}

// The folder's chat template text, and the file it came from; nullopt when it has none.
std::optional<std::pair<std::string, std::string>> folder_chat_template(const std::string& dir) {
  std::error_code ec;
  const std::string jinja = dir + "/chat_template.jinja";
  if (std::filesystem::is_regular_file(jinja, ec)) return template_text_in(jinja);
  const std::string config = dir + "/tokenizer_config.json";
  if (std::filesystem::is_regular_file(config, ec)) {
    if (auto found = template_text_in(config)) return found;
  }
  // A multimodal folder's processor template (Gemma 3's), which transformers' processors
  // apply: {"chat_template": "..."}, read as tokenizer_config.json's member.
  const std::string processor = dir + "/chat_template.json";
  if (std::filesystem::is_regular_file(processor, ec)) return template_text_in(processor);
  return std::nullopt;
}

}  // namespace

bool has_folder_chat_template(const std::string& model_dir) {
  return !model_dir.empty() && folder_chat_template(model_dir).has_value();
}

const ChatTemplate& chat_template(const std::string& name) {
  for (const auto& t : all()) {
    if (t->name() == name) return *t;
  }
  if (name.rfind(kFolderTemplatePrefix, 0) == 0) return folder_chat_template_named(name);
  throw ConfigError(fmt::format("template: unknown template \"{}\"; choose auto or one of: {}",
                                name, fmt::join(chat_template_names(), ", ")));
}

std::vector<std::string> chat_template_names() {
  std::vector<std::string> names;
  for (const auto& t : all()) names.push_back(t->name());
  return names;
}

std::string detect_chat_template(const std::string& model_dir, std::string* source,
                                 bool as_written) {
  auto fallback = [&](const std::string& why) {
    if (source != nullptr) *source = why;
    return std::string("alpaca_zh");
  };
  if (model_dir.empty()) return fallback("no model folder: zerotrain's default");
  auto found = folder_chat_template(model_dir);
  if (!found)
    return fallback(fmt::format("'{}' has no chat template: zerotrain's default", model_dir));
  const std::string text = without_whitespace(found->first);
  for (const auto& [name, reference] : kReferenceChatTemplates) {
    if (as_written) break;  // template kwargs: the text itself renders them
    if (without_whitespace(reference) == text) {
      if (source != nullptr) *source = fmt::format("the chat template of {}", found->second);
      return name;
    }
  }
  // Any other template: rendered by the Jinja interpreter, as transformers renders it.
  const std::string name = kFolderTemplatePrefix + found->second;
  chat_template(name);  // parsed now: a template it cannot render is refused here, named
  if (source != nullptr)
    *source = fmt::format("the chat template of {} (rendered as written)", found->second);
  return name;
}

std::optional<std::string> recorded_chat_template(const std::string& dir) {
  const std::string path = dir + "/zerotrain_template.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  rapidjson::Document doc = json::parse(files::read_text(path, "template record"), path);
  json::ObjectReader r(doc, "", path);
  const std::string name = r.required_string("template", "the name of a template");
  if (name != kRawTemplate) chat_template(name);  // known
  return name;
}

void record_chat_template(const std::string& dir, const std::string& name) {
  rapidjson::Document doc(rapidjson::kObjectType);
  doc.AddMember("format", "zerotrain-template", doc.GetAllocator());
  doc.AddMember("template", rapidjson::Value(name.c_str(), doc.GetAllocator()), doc.GetAllocator());
  files::write_atomic(dir + "/zerotrain_template.json", json::dump(doc, true) + "\n");
}

}  // namespace zt::data
