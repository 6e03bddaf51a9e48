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

namespace zt {

/// A string → id table that looks up string_views without allocating (open addressing, keys
/// in one arena). Later insertions of a key replace earlier ones.
class StringIdMap {
 public:
  void insert(std::string_view key, int32_t id);
  /// The id of `key`, or -1.
  int32_t find(std::string_view key) const;
  size_t size() const { return used_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0;
    uint32_t length = 0;
    int32_t id = -1;  // -1: empty
  };
  void grow();
  std::vector<Slot> slots_;
  std::string arena_;
  size_t used_ = 0;
};

/// 64-bit hash of a byte string (for the tables here; not stable across versions).
uint64_t hash_bytes(std::string_view s);

/// GPT-2's byte-to-character alphabet of ByteLevel tokenizers: printable Latin-1 bytes stand
/// for themselves, the other 68 bytes for U+0100-U+0143.
namespace byte_level {
uint32_t char_of(uint8_t byte);
/// The byte a character stands for, or -1 when it is not in the alphabet.
int byte_of(uint32_t cp);
}  // namespace byte_level

class PieceCache;

/// Settings of a BPE model, as tokenizer.json's `model` object gives them.
struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  /// The vocabulary is written in GPT-2's byte-to-character alphabet (a ByteLevel
  /// pre-tokenizer): pieces given to encode_piece are then raw bytes.
  bool byte_level = false;
};

class BpeModel {
 public:
  /// `vocab`: (token, id) pairs, ids in [0, 2^24); `merges`: (left, right) in rank order.
  /// Tokens of merges missing from the vocabulary, an unk_token not in it, or an id used twice
  /// are ConfigErrors that start with `where` (the file and JSON path).
  BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
           const std::string& where);
  ~BpeModel();
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  /// Appends the ids of one pre-token (raw bytes when byte_level, else UTF-8 text).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  /// The id of a vocabulary entry spelled as in tokenizer.json, or -1.
  int32_t token_id(std::string_view token) const { return vocab_.find(token); }
  /// The vocabulary entry of `id` as tokenizer.json spells it, or nullptr.
  const std::string* token(int32_t id) const;
  /// The number of vocabulary entries.
  size_t entries() const { return vocab_.size(); }
  /// One past the largest id.
  int32_t id_end() const { return static_cast<int32_t>(tokens_.size()); }

 private:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };
  class PairMap;

  void initial_symbols(std::string_view piece, std::vector<int32_t>& ids) const;
  void merge(std::vector<int32_t>& ids) const;

  BpeOptions options_;
  StringIdMap vocab_;        // as tokenizer.json spells the tokens
  StringIdMap piece_vocab_;  // the same in the pieces' spelling (raw bytes when byte_level)
  std::vector<std::string> tokens_;
  std::vector<bool> has_token_;
  std::unique_ptr<PairMap> merges_;
  int32_t unk_id_ = -1;
  int32_t byte_token_[256];      // <0xXX> tokens for byte fallback, -1 when absent
  int32_t single_byte_id_[256];  // byte_level: the id of each byte's character, -1 when absent
  std::unique_ptr<PieceCache> cache_;
};

}  // namespace zt
