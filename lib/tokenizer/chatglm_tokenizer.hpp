// ChatGLM2/3-6B's tokenizer: a SentencePiece BPE model (tokenizer.model) plus the special tokens
// THUDM's tokenization_chatglm.py numbers after its pieces — [MASK], [gMASK], [sMASK], sop, eop
// and, in ChatGLM3, <|system|>, <|user|>, <|assistant|>, <|observation|>. docs/tokenizers.md says
// which strings encode() reads as special tokens.
//
// Thread-safety: immutable after loading; every const method may be called from several threads
// at once.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/sentencepiece_model.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {

class ChatGlmTokenizer final : public Tokenizer {
 public:
  enum Generation { kChatGlm2 = 2, kChatGlm3 = 3 };

  /// Reads `dir`/tokenizer.model (a regular file, SentencePiece's serialized model). A file
  /// that does not parse is a ConfigError naming it. `generation` decides whether the role
  /// tokens exist; chatglm_generation() tells it from the folder.
  static std::shared_ptr<ChatGlmTokenizer> load(const std::string& dir, Generation generation);
  ~ChatGlmTokenizer() override;

  /// The ids of `text`: the special-token strings [MASK], [gMASK], [sMASK] and (ChatGLM3) the
  /// role tokens become their ids, and "sop" / "eop" directly after a mask token (how ChatGLM's
  /// prompt "[gMASK]sop" is written); every stretch between them is SentencePiece-encoded on
  /// its own, as ChatGLM3's tokenize(encode_special_tokens=True) does.
  std::vector<int32_t> encode(std::string_view text) const override;
  /// SentencePiece's ids of `text` with no special token read: what the remote tokenizer's
  /// tokenize() + convert_tokens_to_ids() and encode(add_special_tokens=False) give.
  std::vector<int32_t> encode_plain(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const override;

  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  int32_t pad_id() const override { return pad_; }  ///< ChatGLM pads with <unk>
  /// False: ChatGLM's sequences start with [gMASK] sop, which its formats write (the chatglm3
  /// template, the ChatGLM-Finetuning layout), never with <s>.
  bool add_bos() const override { return false; }
  /// `[gMASK] sop`, as the remote tokenizer's build_inputs_with_special_tokens writes them.
  std::vector<int32_t> prefix_ids() const override {
    return {*command("[gMASK]"), *command("sop")};
  }
  bool add_eos() const override { return false; }
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_) + specials_.size(); }
  std::string fingerprint() const override { return fingerprint_; }

  /// get_command(token) of the remote tokenizer: the id of a special token ("[gMASK]", "sop",
  /// "<|user|>", ...), nullopt for a name it does not have.
  std::optional<int32_t> command(std::string_view token) const;
  Generation generation() const { return generation_; }

 private:
  ChatGlmTokenizer() = default;

  std::unique_ptr<SentencePieceModel> sp_;
  Generation generation_ = kChatGlm3;
  int32_t pieces_ = 0, bos_ = -1, eos_ = -1, pad_ = -1;
  std::vector<std::string> specials_;  // id pieces_ + k is specials_[k]
  std::string fingerprint_;
};

/// Whether `dir` holds ChatGLM2/3's tokenizer: a tokenizer.model with tokenizer_config.json's
/// tokenizer_class ChatGLMTokenizer, or config.json's model_type chatglm.
bool is_chatglm_tokenizer_folder(const std::string& dir);
/// The generation of the ChatGLM tokenizer in `dir`: ChatGLM3 when its tokenization_chatglm.py
/// has the role tokens or the folder has none (the superset), ChatGLM2 when its code lacks them.
ChatGlmTokenizer::Generation chatglm_generation(const std::string& dir);

}  // namespace zt
