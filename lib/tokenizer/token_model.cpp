// The tables the tokenizer.json models share: string → id maps, the piece cache, the
// vocabulary of the Unigram, WordPiece and WordLevel models.
#include "tokenizer/token_model.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt {

// ---- hashing and tables --------------------------------------------------------------------

uint64_t hash_bytes(std::string_view s) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = kMul ^ (n * 0xFF51AFD7ED558CCDull);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * kMul;
    h ^= h >> 32;
    p += 8;
    n -= 8;
  }
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  h = (h ^ v) * kMul;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

void StringIdMap::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
  const size_t mask = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.id < 0) continue;
    size_t i = s.hash & mask;
    while (slots_[i].id >= 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void StringIdMap::insert(std::string_view key, int32_t id) {
  if ((used_ + 1) * 2 > slots_.size()) grow();
  const uint64_t h = hash_bytes(key);
  const size_t mask = slots_.size() - 1;
  size_t i = h & mask;
  while (slots_[i].id >= 0) {
    const Slot& s = slots_[i];
    if (s.hash == h && std::string_view(arena_.data() + s.offset, s.length) == key) {
      slots_[i].id = id;
      return;
    }
    i = (i + 1) & mask;
  }
  slots_[i] = Slot{h, static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(key.size()), id};
  arena_.append(key);
  ++used_;
}

int32_t StringIdMap::find(std::string_view key) const {
  if (slots_.empty()) return -1;
  const uint64_t h = hash_bytes(key);
  const size_t mask = slots_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.hash == h && std::string_view(arena_.data() + s.offset, s.length) == key) return s.id;
  }
}

// ---- the byte trie --------------------------------------------------------------------------

void ByteTrie::insert(std::string_view key, int32_t id) {
  uint32_t node = 0;
  for (char c : key) {
    const auto byte = static_cast<uint8_t>(c);
    uint32_t next = child(node, byte);
    if (next == kNone) {
      next = static_cast<uint32_t>(values_.size());
      values_.push_back(-1);
      add(node, byte, next);
    }
    node = next;
  }
  if (node != 0) values_[node] = id;
}

void ByteTrie::add(uint32_t node, uint8_t byte, uint32_t child) {
  if (node == 0) {
    root_[byte] = child;
    return;
  }
  if ((used_ + 1) * 2 > edges_.size()) grow();
  size_t i = slot(node, byte);
  while (edges_[i].parent != kNone) i = (i + 1) & (edges_.size() - 1);
  edges_[i] = Edge{node, child, byte};
  ++used_;
}

void ByteTrie::grow() {
  std::vector<Edge> old = std::move(edges_);
  edges_.assign(old.empty() ? 1024 : old.size() * 2, Edge{});
  for (const Edge& e : old) {
    if (e.parent == kNone) continue;
    size_t j = slot(e.parent, static_cast<uint8_t>(e.byte));
    while (edges_[j].parent != kNone) j = (j + 1) & (edges_.size() - 1);
    edges_[j] = e;
  }
}

// ---- the piece cache -----------------------------------------------------------------------

namespace {
constexpr size_t kShards = 16;
}  // namespace

// 16 shards indexed by the hash's top 4 bits, each behind its own mutex so that threads rarely
// meet.
struct PieceCache::Shard {
  static constexpr size_t kSlots = 4096;  // at most half used
  static constexpr size_t kMaxEntries = 2048;
  static constexpr size_t kMaxArena = 128 << 10;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_offset = 0;
    uint32_t key_length = 0;  // 0: empty (pieces are never empty)
    uint32_t ids_offset = 0;
    uint32_t ids_length = 0;
  };
  std::mutex mutex;
  std::vector<Slot> slots;
  std::string keys;
  std::vector<int32_t> ids;
  size_t used = 0;
};

PieceCache::PieceCache() : shards_(new Shard[kShards]) {
  for (size_t s = 0; s < kShards; ++s) shards_[s].slots.assign(Shard::kSlots, Shard::Slot{});
}

PieceCache::~PieceCache() = default;

bool PieceCache::find(std::string_view key, uint64_t hash, std::vector<int32_t>& out) const {
  Shard& shard = shards_[hash >> 60];
  std::lock_guard<std::mutex> lock(shard.mutex);
  for (size_t i = hash & (Shard::kSlots - 1);; i = (i + 1) & (Shard::kSlots - 1)) {
    const Shard::Slot& s = shard.slots[i];
    if (s.key_length == 0) return false;
    if (s.hash == hash && std::string_view(shard.keys.data() + s.key_offset, s.key_length) == key) {
      const int32_t* ids = shard.ids.data() + s.ids_offset;
      out.insert(out.end(), ids, ids + s.ids_length);
      return true;
    }
  }
}

void PieceCache::insert(std::string_view key, uint64_t hash, const int32_t* ids,
                        size_t count) const {
  Shard& shard = shards_[hash >> 60];
  std::lock_guard<std::mutex> lock(shard.mutex);
  if (shard.used >= Shard::kMaxEntries || shard.keys.size() + key.size() > Shard::kMaxArena) {
    std::fill(shard.slots.begin(), shard.slots.end(), Shard::Slot{});
    shard.keys.clear();
    shard.ids.clear();
    shard.used = 0;
  }
  size_t i = hash & (Shard::kSlots - 1);
  for (; shard.slots[i].key_length != 0; i = (i + 1) & (Shard::kSlots - 1)) {
    const Shard::Slot& s = shard.slots[i];
    if (s.hash == hash && std::string_view(shard.keys.data() + s.key_offset, s.key_length) == key) {
      return;  // another thread got here first
    }
  }
  shard.slots[i] =
      Shard::Slot{hash, static_cast<uint32_t>(shard.keys.size()), static_cast<uint32_t>(key.size()),
                  static_cast<uint32_t>(shard.ids.size()), static_cast<uint32_t>(count)};
  shard.keys.append(key);
  shard.ids.insert(shard.ids.end(), ids, ids + count);
  ++shard.used;
}

// ---- the vocabulary ------------------------------------------------------------------------

Vocabulary::Vocabulary(const std::vector<std::pair<std::string, int32_t>>& entries,
                       const std::string& where) {
  constexpr int32_t kMaxId = 1 << 24;
  int32_t end = 0;
  for (const auto& [token, id] : entries) {
    if (id < 0 || id >= kMaxId) {
      throw ConfigError(fmt::format("{}: model.vocab: \"{}\" has id {}, outside [0, {})", where,
                                    token, id, kMaxId));
    }
    if (!text::is_valid_utf8(token)) {
      throw ConfigError(fmt::format("{}: model.vocab: entry {} is not valid UTF-8", where, id));
    }
    end = std::max(end, id + 1);
  }
  // Real vocabularies leave few holes; a table mostly empty is a damaged (or hostile) file,
  // refused before the table is allocated.
  if (static_cast<size_t>(end) > 2 * entries.size() + 1024) {
    throw ConfigError(fmt::format(
        "{}: model.vocab: {} entries with ids up to {}: most ids name no token; the file is "
        "damaged",
        where, entries.size(), end - 1));
  }
  tokens_.resize(static_cast<size_t>(end));
  has_token_.assign(static_cast<size_t>(end), false);
  for (const auto& [token, id] : entries) {
    if (has_token_[id]) {
      throw ConfigError(fmt::format("{}: model.vocab: id {} is given to both \"{}\" and \"{}\"",
                                    where, id, tokens_[id], token));
    }
    ids_.insert(token, id);
    tokens_[id] = token;
    has_token_[id] = true;
  }
  size_ = ids_.size();
}

const std::string* Vocabulary::token(int32_t id) const {
  if (id < 0 || id >= id_end() || !has_token_[id]) return nullptr;
  return &tokens_[id];
}

}  // namespace zt
