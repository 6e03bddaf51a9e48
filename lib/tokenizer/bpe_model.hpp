// The BPE model of HF tokenizers: a vocabulary, ranked merges, unknown-character handling
// (byte fallback, unk fusing) and a cache of encoded pre-tokens, as `models::bpe::BPE` does.
//
// Thread-safety: immutable after construction except for the cache, which is sharded behind
// mutexes; `encode_piece` may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/token_model.hpp"

namespace zt {

/// GPT-2's byte-to-character alphabet of ByteLevel tokenizers: printable Latin-1 bytes stand
/// for themselves, the other 68 bytes for U+0100-U+0143.
namespace byte_level {
uint32_t char_of(uint8_t byte);
/// The byte a character stands for, or -1 when it is not in the alphabet.
int byte_of(uint32_t cp);
}  // namespace byte_level

/// Settings of a BPE model, as tokenizer.json's `model` object gives them.
struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  /// Spelled before every character but a word's first, and after its last, when the initial
  /// symbols are looked up; a merge of (a, b) makes a + b without b's prefix (HF's BPE).
  std::string continuing_subword_prefix, end_of_word_suffix;
  /// The vocabulary is written in GPT-2's byte-to-character alphabet (a ByteLevel
  /// pre-tokenizer): pieces given to encode_piece are then raw bytes.
  bool byte_level = false;
  /// Cut a piece into words before each "▁" that follows another character, where no merge can
  /// join across the cut (BpeModel's derived split), so that each word is merged and cached on
  /// its own. Exact by construction; false merges whole pieces (the tests' reference).
  bool split_words = true;
  /// Words of at most BpeModel::kShortWord symbols merged by scanning their pairs' ranks rather
  /// than through the priority queue (the same merges; false: always the queue, the tests'
  /// reference).
  bool scan_short_words = true;
};

class BpeModel final : public VocabularyModel {
 public:
  /// `vocab`: (token, id) pairs, ids in [0, 2^24); `merges`: (left, right) in rank order.
  /// Tokens of merges missing from the vocabulary, an unk_token not in it, or an id used twice
  /// are ConfigErrors that start with `where` (the file and JSON path).
  BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
           const std::string& where);
  ~BpeModel() override;
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  /// Appends the ids of one pre-token (raw bytes when byte_level, else UTF-8 text).
  ///
  /// SentencePiece-style pipelines (LLaMA-2's, Gemma's) leave a whole line as one piece, with
  /// its spaces written "▁". Where the merges allow, such a piece is cut into words — before
  /// each "▁" that follows another character c — and each word is merged and cached on its
  /// own: BPE never merges across a cut unless some merge (a, b) has b starting with "▁" and a
  /// ending in c, so the cuts are made only after characters in the vocabulary that end no
  /// such a (Gemma 3's merges have one: ">" + "▁</"), and only for models without byte_level,
  /// ignore_merges, affixes, and with "▁" in the vocabulary. The ids are those of the whole
  /// piece.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const override;

 private:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };
  class PairMap;

  void initial_symbols(std::string_view piece, std::vector<int32_t>& ids) const;
  void merge(std::vector<int32_t>& ids) const;
  /// merge() of a word of at most kShortWord symbols, without the queue.
  static constexpr size_t kShortWord = 24;
  void merge_short(std::vector<int32_t>& ids) const;
  /// One word (or piece) through the cache.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  /// Whether a word may start at `at` (a "▁" in `piece`): the character before it is another
  /// one, in the vocabulary, and no merge joins a token ending in it to one starting with "▁".
  bool word_starts_at(std::string_view piece, size_t at) const;

  BpeOptions options_;
  StringIdMap piece_vocab_;  // vocab_ in the pieces' spelling (raw bytes when byte_level)
  std::unique_ptr<PairMap> merges_;
  int32_t unk_id_ = -1;
  int32_t byte_token_[256];      // <0xXX> tokens for byte fallback, -1 when absent
  int32_t single_byte_id_[256];  // byte_level: the id of each byte's character, -1 when absent
  // Not byte_level: the id of each character of the Basic Multilingual Plane that is a token
  // by itself (-1 when not), so that initial symbols need no string lookup.
  std::vector<int32_t> char_id_;
  /// The id of the character `ch` (UTF-8, code point `cp`), or -1.
  int32_t char_token(std::string_view ch, uint32_t cp) const {
    return cp < char_id_.size() ? char_id_[cp] : vocab_.find(ch);
  }
  std::unique_ptr<PieceCache> cache_;
  bool split_words_ = false;  // options_.split_words, where the model allows it
  // The last characters of merges' left tokens whose right token starts with "▁".
  std::vector<uint32_t> joined_before_space_;
};

}  // namespace zt
