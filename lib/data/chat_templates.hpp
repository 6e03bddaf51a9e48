// Prompt and chat templates: zerotrain's instruction templates (alpaca_zh, alpaca, chatml,
// plain, chatglm2) and the chat formats of the supported model families, each rendering a
// conversation exactly as transformers' apply_chat_template renders that model's own chat_template,
// cut into pieces that are trained (assistant replies and their end-of-turn marker) or not.
// docs/data.md lists them; data/chat_templates/ holds the models' template texts they match.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace zt::data {

struct Message {
  std::string role;  ///< user | assistant
  std::string content;
  /// User messages of instruction data: the `input` field, kept apart for the alpaca templates
  /// (the chat formats see content + "\n" + input).
  std::string input;
};

/// A conversation: an optional system message, then user/assistant messages alternating,
/// starting with a user message.
struct Chat {
  std::optional<std::string> system;
  std::vector<Message> messages;
};

struct Piece {
  std::string text;
  bool trained = false;
};

class ChatTemplate {
 public:
  virtual ~ChatTemplate() = default;
  virtual const std::string& name() const = 0;
  /// True for a model's chat format: the rendered text is one string encoded whole (it holds
  /// its bos and end-of-turn tokens itself). False for the instruction templates: each piece is
  /// encoded on its own, with bos before and eos after each reply added by the pipeline.
  virtual bool whole_text() const = 0;
  /// The conversation as pieces; concatenated they are apply_chat_template's text (for a
  /// model format). A conversation the model's template refuses (a system message where it
  /// has none, ...) is a ConfigError saying so.
  virtual std::vector<Piece> render(const Chat& chat) const = 0;
  /// The text up to where the model's reply begins (add_generation_prompt), for asking a
  /// model; `chat` ends with a user message.
  virtual std::string prompt(const Chat& chat) const = 0;
  /// The special-token strings the format writes, in the order it writes them: together they
  /// must encode to one token each.
  virtual std::vector<std::string> special_tokens() const { return {}; }
  /// Instruction templates: whether the pipeline appends eos after each reply (all but chatml,
  /// whose <|im_end|> ends the reply). Model formats: whether it appends one trained eos after
  /// the conversation (GLM-4, whose template has no end of turn).
  virtual bool appends_eos() const { return false; }
};

/// The template named `name` (a built-in one, or "jinja:<file>"); a ConfigError listing the
/// names for an unknown one.
const ChatTemplate& chat_template(const std::string& name);

/// Every template name, instruction templates first.
std::vector<std::string> chat_template_names();

/// Whether `model_dir` holds a chat template of its own (chat_template.jinja,
/// tokenizer_config.json's member, or a processor's chat_template.json).
bool has_folder_chat_template(const std::string& model_dir);

/// What `--template auto` picks for the model folder `model_dir`: the built-in format whose
/// reference text equals the folder's chat template (chat_template.jinja, or
/// tokenizer_config.json's chat_template; whitespace ignored); any other template as written
/// ("jinja:<file>", rendered by the Jinja interpreter: folder_template.hpp); alpaca_zh when the
/// folder has none (or `model_dir` is empty). `source` receives where the choice came from.
/// `as_written`: the folder's template as written even where a built-in format matches it
/// (template kwargs need the text itself).
std::string detect_chat_template(const std::string& model_dir, std::string* source = nullptr,
                                 bool as_written = false);

/// The template zerotrain_template.json in `dir` records (what a run trained with), if any.
std::optional<std::string> recorded_chat_template(const std::string& dir);
/// Writes `dir`/zerotrain_template.json naming `name`.
void record_chat_template(const std::string& dir, const std::string& name);

}  // namespace zt::data
