// Chat templates zerotrain does not have built in: a model folder's own template (or one the
// user names), rendered by the Jinja interpreter (jinja.hpp) as transformers renders it.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "data/chat_templates.hpp"

namespace zt::data {

/// The prefix of such a template's name: "jinja:" and the file it is read from (a .jinja file,
/// or a tokenizer_config.json with a chat_template).
inline constexpr const char* kFolderTemplatePrefix = "jinja:";

/// Template kwargs (transformers' apply_chat_template(..., **kwargs): enable_thinking, ...) ride
/// in the name after the file: kFolderTemplatePrefix + file + "?" + a JSON object, so that the
/// data cache, a resumed run and `verify` see them with the template.
inline constexpr const char* kTemplateKwargsSeparator = "?{";

/// `name` (a folder template's) with `kwargs_json` (a JSON object, empty: none) attached. A
/// value that is not a JSON object is a ConfigError naming `option`.
std::string with_template_kwargs(const std::string& name, const std::string& kwargs_json,
                                 const std::string& option);

/// The template named `name` (kFolderTemplatePrefix + file [+ kwargs]), parsed once and kept; its
/// special tokens (bos_token, eos_token, ...) come from tokenizer_config.json beside the file. Its
/// render() cuts a conversation into replies (trained) and the rest by the template's
/// {% generation %} blocks where it has them, else where the conversation rendered with a
/// reply replaced by a sentinel parts from the real rendering (wherever the template puts the
/// reply, however it trims or splits it), followed by the end-of-turn marker the template
/// writes after a reply (found from two probe conversations). A file
/// that is missing or has no template, or a template the interpreter cannot parse, is a
/// ConfigError naming it. Thread-safe.
const ChatTemplate& folder_chat_template_named(const std::string& name);

/// The chat template text in `file` (a .jinja file, or tokenizer_config.json's chat_template:
/// a string or the "default" entry of a list) and the file; nullopt when a tokenizer config
/// has none.
std::optional<std::pair<std::string, std::string>> template_text_in(const std::string& file);

}  // namespace zt::data
