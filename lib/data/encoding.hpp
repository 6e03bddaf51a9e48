// The pieces of tokenization that the example formats (dataset.cpp) and the preference formats
// (preference.cpp) share: an example being built, chats through templates, and the parallel
// pass over a file's records.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_templates.hpp"
#include "util/json.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::data {

/// One tokenized sequence and its labels (kIgnoreLabel where it is not trained).
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

bool has_trained_label(const Example& e);

/// A chat through template `t`, at most `limit` ids: replies trained (and, with
/// `train_on_prompt`, everything) but the first `prompt_replies`, which belong to a prompt.
Example encode_chat(const Chat& chat, const ChatTemplate& t, const Tokenizer& tok,
                    bool train_on_prompt, size_t limit, size_t prompt_replies = 0);
/// Plain text, every token trained: the tokenizer's prefix (bos), the text, eos.
Example encode_text(const std::string& text, const Tokenizer& tok, size_t limit);

/// A chat in one of the layouts users have: OpenAI `messages` ({"role", "content"}) or ShareGPT
/// `conversations` ({"from", "value"}, with an optional top-level "system"). Preference records
/// hold OpenAI-style lists under other keys ("prompt", "chosen", "rejected").
struct ChatLayout {
  const char* list;
  const char* role;
  const char* content;
  bool system_at_top = false;  ///< the record's "system" string is the system message
};
constexpr ChatLayout kOpenAi{"messages", "role", "content"};
constexpr ChatLayout kShareGpt{"conversations", "from", "value", true};

/// The role a message's role text names (user, assistant, system), in the spellings the
/// ShareGPT datasets in the wild use; nullopt for any other.
std::optional<std::string> normalized_role(const std::string& role);
/// A message's text: a string, or OpenAI's list of text parts. ConfigError naming `key`.
std::string message_text(json::ObjectReader& m, const char* key);
/// The chat of record `r` in `layout`: a system message first if any, then user / assistant
/// turns ending with an assistant reply — or, with `ends_with_user`, with a user message (a
/// preference prompt, which the answers reply to).
Chat parse_chat(json::ObjectReader& r, const std::string& where, const ChatLayout& layout,
                bool ends_with_user = false);
/// An alpaca record's prompt: system, history and the last user turn (instruction + input).
Chat parse_instruction_prompt(json::ObjectReader& r);

/// Thrown (and turned into check_tokenizer_fits' error) when a record needs text encoded with a
/// tokenizer whose ids the model cannot take: fatal, not a malformed record.
struct TextNeedsVocabulary {};

/// A record of another stage's data (a preference pair given to SFT, KTO's examples given to
/// DPO): the whole file is of that kind, so it stops the read whatever skip_bad_lines says, and
/// its message names the stage that trains it.
struct RecordOfAnotherStage : ConfigError {
  using ConfigError::ConfigError;
};

/// What a format made of one record: its sequences (none when the record is dropped, with a
/// cause of the format's own numbering) and whether a format cut it.
struct Parsed {
  std::vector<Example> examples;
  std::vector<uint8_t> desirable;  ///< KTO data: per example, 1 where its completion is desirable
  int dropped = 0;
  int answers = 0;  ///< preference data: the record's answers, kept or dropped (KTO: examples)
  bool truncated = false;
  /// The record was rendered through the chat template (messages, instructions), not taken as
  /// plain text or ids.
  bool templated = false;
};

/// Parses one record's text; throws ConfigError "<where>: ..." for a malformed one.
using RecordParser = std::function<Parsed(std::string_view text, const std::string& where)>;

/// Reads the records of `path` in batches, parsed on all worker threads, and hands each record's
/// Parsed to `take` in file order (so errors, skips and results are those of a sequential pass).
/// A malformed record is a ConfigError — or, with `o.skip_bad_lines`, skipped, counted and warned
/// about. Fills `stats.lines` and `stats.skipped_lines`; an empty file is a ConfigError. After
/// each batch, `o.on_progress` (when set) hears where the file stands; what it throws
/// propagates.
void read_records(const std::string& path, const Tokenizer& tok, const DataOptions& o,
                  int64_t id_limit, const RecordParser& parse,
                  const std::function<void(Parsed&)>& take, DatasetStats& stats);

}  // namespace zt::data
