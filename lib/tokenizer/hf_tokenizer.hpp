// Hugging Face `tokenizer.json` tokenizers: the BPE pipelines of GPT-2, Qwen2, LLaMA-3,
// LLaMA-2 and Mistral (normalizers, pre-tokenizers, added tokens, decoders), plus the special
// tokens of tokenizer_config.json. What is supported and why: docs/tokenizers.md.
//
// Thread-safety: an HfTokenizer is immutable after loading (its BPE cache locks internally);
// every const method may be called from several threads at once.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/split_rules.hpp"
#include "tokenizer/unicode_text.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {

class TokenModel;
class PrecompiledCharsmap;
class HfTokenizer;

namespace hf {

/// One step of the `normalizer`.
struct NormalizerStep {
  enum Kind {
    kForm,
    kPrepend,
    kReplace,
    kLowercase,
    kStrip,
    kStripAccents,
    kBert,
    kNmt,
    kPrecompiled,
    kByteLevel
  } kind;
  explicit NormalizerStep(Kind k) : kind(k) {}
  text::NormalForm form = text::NormalForm::kNFC;  // kForm
  std::string text;     // kPrepend: the prefix; kReplace: the pattern (when no matcher)
  std::string content;  // kReplace: the replacement
  std::shared_ptr<const text::Matcher> matcher;  // kReplace with a regex pattern
  bool left = false, right = false;              // kStrip: which ends
  // kBert: BertNormalizer's switches (strip_accents resolved: null follows lowercase).
  bool clean_text = true, chinese_chars = true, strip_accents = true, lowercase = true;
  std::shared_ptr<const PrecompiledCharsmap> charsmap;  // kPrecompiled
};

/// Appends `step` applied to `text` (well-formed UTF-8) to `out` (hf_normalizers.cpp).
void apply_normalizer(const NormalizerStep& step, std::string_view text, std::string& out);

/// Appends `text` with every match of `matcher` (or, when null, every occurrence of the
/// non-empty `literal`) replaced by `with`: the Replace normalizer's and decoder's rule.
void replace_pattern(std::string_view text, const text::Matcher* matcher, std::string_view literal,
                     std::string_view with, std::string& out);

/// One step of the `pre_tokenizer`.
struct PreTokenizerStep {
  enum Kind { kSplit, kMetaspace, kByteLevel } kind;
  explicit PreTokenizerStep(Kind k) : kind(k) {}
  text::SplitPattern pattern = text::SplitPattern::kGpt2;  // kSplit; kByteLevel with use_regex
  /// kSplit in general (split_rules.hpp): the pattern as a regex or a string, with its behavior
  /// and invert. Null: the hand-written `pattern`, Isolated, not inverted.
  std::shared_ptr<const text::Matcher> matcher;
  text::SplitBehavior behavior = text::SplitBehavior::kIsolated;
  bool invert = false;
  bool use_regex = false;                                                     // kByteLevel
  bool add_prefix_space = false;                                              // kByteLevel
  std::string replacement;                                                    // kMetaspace
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;  // kMetaspace
  bool split = true;                                                          // kMetaspace
};

/// One step of the `decoder`.
struct DecoderStep {
  enum Kind {
    kByteLevel,
    kMetaspace,
    kReplace,
    kByteFallback,
    kFuse,
    kStrip,
    kWordPiece,
    kBpe,
    kCtc
  } kind;
  explicit DecoderStep(Kind k) : kind(k) {}
  // kReplace: the pattern (when no matcher); kMetaspace: the replacement; kStrip: the char;
  // kWordPiece: the subword prefix; kBpe: the end-of-word suffix; kCtc: the pad token.
  std::string text;
  std::string content;  // kReplace: the replacement; kCtc: the word delimiter token
  std::shared_ptr<const text::Matcher> matcher;  // kReplace with a regex pattern
  bool prepend = true;                           // kMetaspace: prepend_scheme is not "never"
  bool cleanup = false;                          // kWordPiece, kCtc
  int start = 0, stop = 0;                       // kStrip
};

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

/// The special tokens around a sequence in the post-processor's single-sequence template.
struct Template {
  std::vector<int32_t> before;  ///< ids before $A (a bos); at most one
  std::vector<int32_t> after;   ///< ids after $A (an eos); at most one
};

/// Everything tokenizer.json says that encoding and decoding depend on, validated.
struct TokenizerJson {
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::optional<std::vector<DecoderStep>> decoders;  // nullopt: tokens joined with spaces
  std::vector<AddedToken> added;
  std::optional<Template> post_template;  // nullopt: no TemplateProcessing
  std::shared_ptr<const TokenModel> model;
};

/// The pipeline transformers 5 builds itself for the tokenizer class tokenizer_config.json
/// names: its classes with their own constructor (LlamaTokenizer, Qwen2Tokenizer, BertTokenizer)
/// take the vocabulary, merges, added tokens and (but BertTokenizer) the post-processor from
/// tokenizer.json and set the model, normalizer, pre-tokenizer and decoder themselves
/// (transformers 4.x, and classes without a constructor such as PreTrainedTokenizerFast, use
/// tokenizer.json as written).
struct ClassPipeline {
  std::string name;  ///< the tokenizer_class, for messages
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::vector<DecoderStep> decoders;
  /// The model the class builds from the file's vocabulary: BPE (with the file's merges and
  /// these flags) or WordPiece (BertTokenizer's, unknown words as `unk_token`).
  enum class Model { kBpe, kWordPiece } model = Model::kBpe;
  bool fuse_unk = false, byte_fallback = false;
  std::string unk_token = "[UNK]";
  /// Set: the class's own post-processor, these tokens around the text (BertTokenizer's
  /// [CLS] · [SEP]); unset: the file's.
  std::optional<std::pair<std::string, std::string>> template_around;
};

/// BertPreTokenizer's steps: split on whitespace (removed), then each punctuation character
/// on its own.
std::vector<PreTokenizerStep> bert_pre_tokenizer();

/// The class pipeline for the tokenizer in `dir`, or nullopt when tokenizer.json applies as
/// written (no tokenizer_config.json, or a class without its own pipeline). Rules and the
/// transformers 4.x difference: docs/tokenizers.md.
std::optional<ClassPipeline> class_pipeline(const std::string& dir);

/// Reads and validates tokenizer.json; anything unsupported is a ConfigError naming the file,
/// the JSON key and the type or value. With `pipeline`, its steps and BPE flags replace the
/// file's (which are still validated).
TokenizerJson read_tokenizer_json(const std::string& path,
                                  const std::optional<ClassPipeline>& pipeline = std::nullopt);

/// The special-token settings of tokenizer_config.json (and special_tokens_map.json).
struct SpecialTokens {
  int32_t bos_id = -1, eos_id = -1, pad_id = -1;
  bool add_bos = false, add_eos = false;
};

/// Resolves bos/eos/pad and add_bos/add_eos for `tokenizer`, loaded from `dir` (rules in
/// docs/tokenizers.md).
SpecialTokens read_special_tokens(const std::string& dir, const HfTokenizer& tokenizer,
                                  const std::optional<Template>& post_template);

}  // namespace hf

/// A tokenizer.json tokenizer with its special tokens resolved.
class HfTokenizer final : public Tokenizer {
 public:
  /// Loads `dir`/tokenizer.json and `dir`/tokenizer_config.json (optional). Errors: IoError for
  /// unreadable files, ConfigError for unsupported or inconsistent content.
  static std::shared_ptr<HfTokenizer> load(const std::string& dir);

  explicit HfTokenizer(hf::TokenizerJson spec);
  ~HfTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override {
    return decode(ids, /*skip_special_tokens=*/true);
  }
  /// HF's decode: tokens through the decoder chain; with `skip_special_tokens`, tokens marked
  /// special in tokenizer.json and bos/eos/pad are left out. Unknown ids are always left out.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;

  int32_t bos_id() const override { return special_.bos_id; }
  int32_t eos_id() const override { return special_.eos_id; }
  int32_t pad_id() const override { return special_.pad_id; }
  bool add_bos() const override { return special_.add_bos; }
  bool add_eos() const override { return special_.add_eos; }
  int64_t vocab_size() const override { return id_end_; }
  std::string fingerprint() const override { return fingerprint_; }

  /// The id of a token string: added tokens first, then the model's vocabulary; -1 if neither.
  int32_t token_id(std::string_view token) const;

 private:
  struct Impl;
  struct Segment;
  void find_added(std::string_view text, bool normalized_set, std::vector<Segment>& out) const;
  void normalize(std::string_view in, std::string& out) const;
  void encode_normalized(std::string_view text, bool at_start, std::vector<int32_t>& ids) const;
  void pre_tokenize_and_encode(std::string_view text, bool at_start,
                               std::vector<int32_t>& ids) const;

  hf::TokenizerJson spec_;
  std::unique_ptr<Impl> impl_;
  hf::SpecialTokens special_;
  int64_t id_end_ = 0;
  std::string fingerprint_;
};

}  // namespace zt
