// Tokenizers behind one interface: the built-in byte-level tokenizer, Hugging Face
// tokenizer.json tokenizers and ChatGLM2/3's SentencePiece tokenizer (docs/tokenizers.md),
// chosen by load_tokenizer.
//
// Thread-safety: a Tokenizer is immutable after construction; its const methods may be called
// from several threads at once. Nothing here is collective.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

/// Text ↔ token ids. Implementations are immutable; share them through std::shared_ptr.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// The ids of `text`, without bos/eos. Special-token strings in the text (`<|im_end|>`) are
  /// encoded as the tokenizer's special ids where it has them (as HF tokenizers do by default).
  /// HF tokenizers read ill-formed UTF-8 as U+FFFD; the byte tokenizer keeps the bytes.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  /// The text of `ids`; special ids (bos/eos/pad, and the tokens an HF tokenizer.json marks
  /// special) and ids the tokenizer does not know are skipped, so labels with -100 can be
  /// decoded as they are.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  virtual int32_t bos_id() const = 0;  ///< -1 when the tokenizer has none
  virtual int32_t eos_id() const = 0;  ///< -1 when none
  virtual int32_t pad_id() const = 0;  ///< -1 when none (then pad with eos, as HF does)
  /// Whether sequences start with bos (LLaMA: yes, Qwen: no).
  virtual bool add_bos() const = 0;
  /// The ids HF's `tokenizer(text)` puts in front of a sequence: bos where add_bos() (LLaMA),
  /// none (Qwen), ChatGLM's `[gMASK] sop`. The data pipeline starts text and instruction
  /// examples with them.
  virtual std::vector<int32_t> prefix_ids() const {
    if (add_bos() && bos_id() >= 0) return {bos_id()};
    return {};
  }
  /// Whether HF's `tokenizer(text)` ends sequences with eos (tokenizer_config.json's
  /// add_eos_token; false for the families zerotrain targets). The data pipeline does not ask:
  /// it appends eos itself where docs/data.md says, so sequences never get two.
  virtual bool add_eos() const = 0;
  /// Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  /// A string that changes whenever encode's behaviour could: part of dataset cache keys.
  virtual std::string fingerprint() const = 0;
};

/// The first `max_ids` ids of `tok.encode(text)` (all of them when there are fewer), computed
/// from a prefix of the text a few times the size those ids need, so that truncating a huge
/// text costs memory and time in proportion to `max_ids`, not to the text. The prefix grows
/// until two cuts agree on those ids (a cut changes only the tokens just before it).
std::vector<int32_t> encode_prefix(const Tokenizer& tok, std::string_view text, size_t max_ids);

/// The built-in byte-level tokenizer: ids 0-255 are the bytes of the UTF-8 text, 256 = bos,
/// 257 = eos, 258 = pad (vocab_size 259), add_bos true, add_eos false. decode returns the bytes
/// as they are, invalid UTF-8 included. Every call returns the same shared instance.
std::shared_ptr<Tokenizer> byte_tokenizer();

/// The tokenizer of the model in `model_dir`, for a model whose embedding has
/// `model_vocab_size` rows:
/// - `model_dir` empty (a model given only as a config): the byte tokenizer;
/// - a folder with tokenizer.json: that HF tokenizer, with bos/eos/pad and add_bos/add_eos from
///   tokenizer_config.json (or, without it, from tokenizer.json's post-processor; rules and
///   supported features in docs/tokenizers.md). Unsupported features are ConfigErrors naming
///   the file, the JSON key and the type;
/// - a ChatGLM2/3 folder without tokenizer.json (tokenizer.model, with tokenizer_config.json's
///   tokenizer_class ChatGLMTokenizer or config.json's model_type chatglm): ChatGLM's
///   SentencePiece tokenizer with its special tokens (docs/tokenizers.md);
/// - a folder with other tokenizer files (tokenizer.model, vocab.json, merges.txt,
///   tokenizer_config.json) but no tokenizer.json: ConfigError asking for a tokenizer.json
///   (save the tokenizer with HF transformers' save_pretrained);
/// - a folder without tokenizer files: the byte tokenizer, with a warning naming the folder.
/// An HF tokenizer's vocab_size must not exceed `model_vocab_size` (ConfigError naming both).
/// The byte tokenizer is returned whatever the model's size: a host that feeds token ids needs
/// none, and what encodes text checks check_tokenizer_fits first. A `model_dir` that is not a
/// folder is an IoError. Loading reads and checks the whole vocabulary: call it once and share
/// the result.
std::shared_ptr<Tokenizer> load_tokenizer(const std::string& model_dir, int64_t model_vocab_size);

/// Throws ConfigError naming both sizes when `tok` makes ids a model with `model_vocab_size`
/// embedding rows cannot take (the byte tokenizer needs 259).
void check_tokenizer_fits(const Tokenizer& tok, int64_t model_vocab_size);

}  // namespace zt
