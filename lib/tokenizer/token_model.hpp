// The model of a tokenizer.json pipeline, whichever it is (BPE: bpe_model.hpp; Unigram:
// unigram_model.hpp; WordPiece and WordLevel: word_models.hpp): what the pipeline asks of it
// is the ids of one pre-token and the vocabulary both ways.
//
// Thread-safety: models are immutable after construction except for their caches, which lock
// internally; every const method may be called from several threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zt {

class TokenModel {
 public:
  virtual ~TokenModel() = default;
  /// Appends the ids of one pre-token (raw bytes for a byte-level BPE, else UTF-8 text).
  virtual void encode_piece(std::string_view piece, std::vector<int32_t>& out) const = 0;
  /// The id of a vocabulary entry spelled as in tokenizer.json, or -1.
  virtual int32_t token_id(std::string_view token) const = 0;
  /// The vocabulary entry of `id` as tokenizer.json spells it, or nullptr.
  virtual const std::string* token(int32_t id) const = 0;
  /// The number of vocabulary entries (HF's get_vocab_size without added tokens).
  virtual size_t entries() const = 0;
  /// One past the largest id.
  virtual int32_t id_end() const = 0;
};

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

/// Byte strings and their ids as a trie: node 0 is the root, whose children sit in a table of
/// 256; every other edge (node, byte) → child lives in one open-addressing table, and each node
/// knows the id of the string ending there (-1: none). Unigram's and WordPiece's prefix lookups.
class ByteTrie {
 public:
  ByteTrie() { root_.fill(kNone); }
  /// Adds `key` (not empty) with `id`; a key added twice keeps the later id.
  void insert(std::string_view key, int32_t id);

  /// Calls f(length, id) for every key that is a prefix of `s`, shortest first.
  template <typename F>
  void prefixes(std::string_view s, F&& f) const {
    if (s.empty()) return;
    uint32_t node = root_[static_cast<uint8_t>(s[0])];
    for (size_t i = 1;; ++i) {
      if (node == kNone) return;
      if (values_[node] >= 0) f(i, values_[node]);
      if (i == s.size()) return;
      node = child(node, static_cast<uint8_t>(s[i]));
    }
  }

 private:
  static constexpr uint32_t kNone = ~0u;
  // An edge with its key in one slot, so that a step down the trie reads one place.
  struct Edge {
    uint32_t parent = kNone;  // kNone: an empty slot
    uint32_t child = kNone;
    uint32_t byte = 0;
  };
  size_t slot(uint32_t node, uint8_t byte) const {
    const uint64_t k = (uint64_t(node) << 8) | byte;
    return ((k * 0x9E3779B97F4A7C15ull) >> 24) & (edges_.size() - 1);
  }
  uint32_t child(uint32_t node, uint8_t byte) const {
    if (node == 0) return root_[byte];
    if (edges_.empty()) return kNone;
    for (size_t i = slot(node, byte);; i = (i + 1) & (edges_.size() - 1)) {
      const Edge& e = edges_[i];
      if (e.parent == node && e.byte == byte) return e.child;
      if (e.parent == kNone) return kNone;
    }
  }
  void add(uint32_t node, uint8_t byte, uint32_t child);
  void grow();

  std::array<uint32_t, 256> root_;
  std::vector<Edge> edges_;             // open addressing, at most half full
  std::vector<int32_t> values_ = {-1};  // the root
  size_t used_ = 0;
};

/// 64-bit hash of a byte string (for the tables here; not stable across versions).
uint64_t hash_bytes(std::string_view s);

/// Encoded pre-tokens, as HF's models cache them: words repeat, so most pieces are looked up
/// instead of encoded again. Sharded behind mutexes (token_model.cpp); a shard that fills up is
/// emptied (HF stops inserting instead; either way the result is the same).
class PieceCache {
 public:
  PieceCache();
  ~PieceCache();
  /// Appends the cached ids of `key` to `out`; false when it is not cached.
  bool find(std::string_view key, uint64_t hash, std::vector<int32_t>& out) const;
  void insert(std::string_view key, uint64_t hash, const int32_t* ids, size_t count) const;
  /// Appends the ids of `piece`: the cached ones, else those `encode(piece, ids)` appends to an
  /// empty vector (then cached, when the piece is short enough).
  template <typename Encode>
  void encode(std::string_view piece, std::vector<int32_t>& out, Encode&& encode) const {
    const bool cached = piece.size() < kMaxKey;
    const uint64_t hash = cached ? hash_bytes(piece) : 0;
    if (cached && find(piece, hash, out)) return;
    thread_local std::vector<int32_t> ids;
    ids.clear();
    encode(piece, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cached) insert(piece, hash, ids.data(), ids.size());
  }
  /// Pieces this long or longer are not cached: they are rarely seen twice (long runs of CJK,
  /// digits or whitespace) and would only evict the short, frequent ones. HF caches below 256
  /// bytes; 64 measured 5-13% faster on the real files (docs/performance.md).
  static constexpr size_t kMaxKey = 64;

 private:
  struct Shard;
  std::unique_ptr<Shard[]> shards_;
};

/// The vocabulary of the Unigram, WordPiece and WordLevel models: tokens by id and ids by
/// token. Ids must leave few holes (a table mostly empty is a damaged file); a token listed
/// twice keeps its last id, as HF's HashMap does.
class Vocabulary {
 public:
  /// `entries`: (token, id); errors start with `where` (the file and JSON path).
  Vocabulary(const std::vector<std::pair<std::string, int32_t>>& entries, const std::string& where);
  int32_t find(std::string_view token) const { return ids_.find(token); }
  const std::string* token(int32_t id) const;
  size_t size() const { return size_; }
  int32_t id_end() const { return static_cast<int32_t>(tokens_.size()); }

 private:
  StringIdMap ids_;
  std::vector<std::string> tokens_;
  std::vector<bool> has_token_;
  size_t size_ = 0;
};

/// A model whose vocabulary is a Vocabulary (Unigram, WordPiece, WordLevel): the lookups both
/// ways.
class VocabularyModel : public TokenModel {
 public:
  int32_t token_id(std::string_view token) const override { return vocab_.find(token); }
  const std::string* token(int32_t id) const override { return vocab_.token(id); }
  size_t entries() const override { return vocab_.size(); }
  int32_t id_end() const override { return vocab_.id_end(); }

 protected:
  explicit VocabularyModel(Vocabulary vocab) : vocab_(std::move(vocab)) {}
  Vocabulary vocab_;
};

}  // namespace zt
