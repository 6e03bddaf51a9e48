// The Unigram model of HF tokenizers (`models::unigram`), as T5, ALBERT, XLM-R and the other
// SentencePiece Unigram conversions use it: the segmentation of best total score (Viterbi over
// a trie of the pieces), unknown characters scored below every piece and fused into one unk,
// and byte fallback for what the vocabulary cannot spell.
//
// Thread-safety: immutable after construction except for the cache, which locks internally.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/token_model.hpp"

namespace zt {

class UnigramModel final : public VocabularyModel {
 public:
  /// `pieces`: (piece, score), the id of each its index. `unk_id`: nullopt when the file has
  /// none (a text with a character outside the pieces is then an error, as in HF). Errors
  /// start with `where` (the file and JSON path).
  UnigramModel(const std::vector<std::pair<std::string, double>>& pieces,
               std::optional<int32_t> unk_id, bool byte_fallback, const std::string& where);
  ~UnigramModel() override;

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const override;
  /// HF's get_vocab_size: the pieces, a piece listed twice counted twice.
  size_t entries() const override { return scores_.size(); }

 private:
  void segment(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<double> scores_;
  std::unique_ptr<ByteTrie> trie_;
  int32_t unk_id_ = -1;
  double unk_score_ = 0;
  bool byte_fallback_ = false;
  int32_t byte_token_[256];
  std::string where_;
  std::unique_ptr<PieceCache> cache_;
};

}  // namespace zt
