// The WordPiece (BERT) and WordLevel models of HF tokenizers (`models::wordpiece`,
// `models::wordlevel`).
//
// Thread-safety: immutable after construction; const methods may be called concurrently.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/token_model.hpp"

namespace zt {

/// WordPiece: a word becomes its longest vocabulary prefix, then the longest entry of
/// `prefix` + the rest, and so on; a word with a part no entry matches, or longer than
/// `max_input_chars_per_word` characters, becomes the one unk token.
class WordPieceModel final : public VocabularyModel {
 public:
  /// Errors start with `where` (the file and JSON path); `unk_token` must be in the vocabulary
  /// when a word needs it (HF fails then too), which is checked when it is needed.
  WordPieceModel(const std::vector<std::pair<std::string, int32_t>>& vocab, std::string unk_token,
                 std::string continuing_subword_prefix, size_t max_input_chars_per_word,
                 const std::string& where);

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const override;

 private:
  int32_t unk() const;
  void split_word(std::string_view word, std::vector<int32_t>& out) const;
  std::string unk_token_, prefix_;
  size_t max_chars_;
  ByteTrie first_;       // every entry: the candidates at a word's start
  ByteTrie continuing_;  // the entries that start with prefix_, without it: the later ones
  std::string where_;
  std::unique_ptr<PieceCache> cache_;
};

/// WordLevel: a word is its vocabulary entry, or the unk token.
class WordLevelModel final : public VocabularyModel {
 public:
  WordLevelModel(const std::vector<std::pair<std::string, int32_t>>& vocab, std::string unk_token,
                 const std::string& where);

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const override;

 private:
  std::string unk_token_;
  std::string where_;
};

}  // namespace zt
