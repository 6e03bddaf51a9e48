// BPE as HF tokenizers' `models::bpe` runs it: initial symbols with byte fallback and unk
// fusing, then merges lowest rank first (leftmost among equal ranks) from a priority queue,
// with a sharded cache of encoded pre-tokens in front.
#include "tokenizer/bpe_model.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_set>

#include <fmt/format.h>

#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt {

namespace byte_level {
namespace {

struct Alphabet {
  std::array<uint32_t, 256> char_of{};
  std::array<int16_t, 324> byte_of{};
};

constexpr Alphabet make_alphabet() {
  Alphabet a{};
  for (auto& b : a.byte_of) b = -1;
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    a.char_of[b] = printable ? b : next++;
    a.byte_of[a.char_of[b]] = static_cast<int16_t>(b);
  }
  return a;
}
constexpr Alphabet kAlphabet = make_alphabet();

}  // namespace

uint32_t char_of(uint8_t byte) {
  return kAlphabet.char_of[byte];
}
int byte_of(uint32_t cp) {
  return cp < kAlphabet.byte_of.size() ? kAlphabet.byte_of[cp] : -1;
}

}  // namespace byte_level

// (left id, right id) → (rank, merged id), open addressing on the packed pair.
class BpeModel::PairMap {
 public:
  explicit PairMap(size_t n) {
    size_t capacity = 16;
    while (capacity < 2 * n) capacity *= 2;
    keys_.assign(capacity, kEmpty);
    values_.resize(capacity);
    mask_ = capacity - 1;
  }

  // Later duplicates replace earlier ones, as collecting HF's merges into a HashMap does.
  void insert_or_assign(int32_t a, int32_t b, Merge m) {
    const uint64_t k = key(a, b);
    size_t i = slot(k);
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask_;
    keys_[i] = k;
    values_[i] = m;
  }

  const Merge* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // ids are below 2^24, so no pair packs to this
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t slot(uint64_t k) const { return ((k * 0x9E3779B97F4A7C15ull) >> 32) & mask_; }

  std::vector<uint64_t> keys_;
  std::vector<Merge> values_;
  size_t mask_ = 0;
};

// ---- the model -----------------------------------------------------------------------------

namespace {

// SentencePiece's space, "▁" (U+2581), where a word starts.
constexpr std::string_view kSpace = "\xE2\x96\x81";
constexpr uint32_t kSpaceChar = 0x2581;

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct Candidate {
  uint32_t rank;
  uint32_t pos;
  int32_t new_id;
};

// std::*_heap keep the largest on top; the queue wants the lowest rank, then the leftmost.
bool lower_priority(const Candidate& a, const Candidate& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
}

// A vocabulary entry in the pieces' spelling: the raw bytes its byte-level characters stand
// for; false when a character is outside the alphabet (such a token is never a BPE result).
bool byte_level_bytes(std::string_view token, std::string& out) {
  out.clear();
  for (size_t i = 0; i < token.size();) {
    uint32_t len;
    const int b = byte_level::byte_of(text::decode_at(token, i, len));
    if (b < 0) return false;
    out.push_back(static_cast<char>(b));
    i += len;
  }
  return true;
}

}  // namespace

BpeModel::BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options, const std::string& where)
    : VocabularyModel(Vocabulary(vocab, where)),
      options_(std::move(options)),
      merges_(std::make_unique<PairMap>(merges.size())),
      cache_(std::make_unique<PieceCache>()) {
  // HF's BPE reads the vocabulary into a map as well, but a token listed twice is a damaged
  // file here rather than its last id.
  if (vocab_.size() != vocab.size()) {
    std::unordered_set<std::string_view> seen;
    for (const auto& entry : vocab) {
      if (!seen.insert(entry.first).second) {
        throw ConfigError(fmt::format("{}: model.vocab: \"{}\" appears twice", where, entry.first));
      }
    }
  }
  if (options_.byte_level) {
    std::string bytes;
    for (const auto& [token, id] : vocab) {
      if (byte_level_bytes(token, bytes)) piece_vocab_.insert(bytes, id);
    }
  }
  if (options_.unk_token) {
    unk_id_ = vocab_.find(*options_.unk_token);
    if (unk_id_ < 0) {
      throw ConfigError(fmt::format("{}: model.unk_token: \"{}\" is not in model.vocab", where,
                                    *options_.unk_token));
    }
  }
  for (int b = 0; b < 256; ++b) {
    byte_token_[b] = vocab_.find(fmt::format("<0x{:02X}>", b));
    if (options_.byte_level) {
      std::string ch;
      text::append_utf8(byte_level::char_of(static_cast<uint8_t>(b)), ch);
      single_byte_id_[b] = vocab_.find(ch);
    } else {
      single_byte_id_[b] = b < 0x80 ? vocab_.find(std::string(1, static_cast<char>(b))) : -1;
    }
  }
  if (!options_.byte_level) {
    char_id_.assign(0x10000, -1);
    for (const auto& [token, id] : vocab) {
      if (token.empty() || token.size() > 3) continue;
      uint32_t len = 0;
      const uint32_t cp = text::decode_at(token, 0, len);
      if (len == token.size() && cp < char_id_.size()) char_id_[cp] = id;
    }
  }
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t a = vocab_.find(left), b = vocab_.find(right);
    // HF makes the merged token a + b without b's continuing-subword prefix.
    const size_t skip = options_.continuing_subword_prefix.size();
    if (right.size() < skip) {
      throw ConfigError(
          fmt::format("{}: model.merges[{}]: \"{}\" is shorter than the "
                      "continuing_subword_prefix",
                      where, rank, right));
    }
    const int32_t merged = vocab_.find(left + right.substr(skip));
    const char* missing = a < 0 ? left.c_str() : b < 0 ? right.c_str() : nullptr;
    if (missing != nullptr || merged < 0) {
      throw ConfigError(fmt::format("{}: model.merges[{}]: \"{}\" is not in model.vocab", where,
                                    rank,
                                    missing != nullptr ? missing : left + right.substr(skip)));
    }
    merges_->insert_or_assign(a, b, Merge{static_cast<uint32_t>(rank), merged});
  }
  split_words_ = options_.split_words && !options_.byte_level && !options_.ignore_merges &&
                 options_.continuing_subword_prefix.empty() &&
                 options_.end_of_word_suffix.empty() && vocab_.find(kSpace) >= 0;
  if (split_words_) {
    for (const auto& [left, right] : merges) {
      if (right.rfind(kSpace, 0) != 0 || left.empty()) continue;
      size_t start = left.size() - 1;  // the last character's first byte
      while (start > 0 && (static_cast<unsigned char>(left[start]) & 0xC0) == 0x80) --start;
      uint32_t len = 0;
      const uint32_t last = text::decode_at(left, start, len);
      if (last == kSpaceChar) continue;  // "▁" + "▁…": a run of spaces, never cut inside
      if (std::find(joined_before_space_.begin(), joined_before_space_.end(), last) ==
          joined_before_space_.end()) {
        joined_before_space_.push_back(last);
      }
    }
  }
}

BpeModel::~BpeModel() = default;

void BpeModel::initial_symbols(std::string_view piece, std::vector<int32_t>& ids) const {
  // An unknown character becomes its <0xXX> tokens when they all exist, else unk (consecutive
  // unks fused into one with fuse_unk), else nothing. As in HF, a pending unk is written only
  // when a known character or the end follows, so it may come after byte-fallback tokens.
  bool pending_unk = false;
  auto known = [&](int32_t id) {
    if (pending_unk) ids.push_back(unk_id_);
    pending_unk = false;
    ids.push_back(id);
  };
  auto unknown = [&](std::string_view ch) {
    if (options_.byte_fallback) {
      const bool all = std::all_of(ch.begin(), ch.end(), [&](char c) {
        return byte_token_[static_cast<unsigned char>(c)] >= 0;
      });
      if (all) {
        for (char c : ch) ids.push_back(byte_token_[static_cast<unsigned char>(c)]);
        return;
      }
    }
    if (unk_id_ < 0) return;
    if (pending_unk && options_.fuse_unk) return;
    if (pending_unk) ids.push_back(unk_id_);
    pending_unk = true;
  };
  // With a continuing-subword prefix or an end-of-word suffix, each character is looked up
  // spelled with them (the prefix unless it starts the piece, the suffix when it ends it), and
  // an unknown one falls back to the bytes of that spelling, as HF's merge_word does.
  const std::string& prefix = options_.continuing_subword_prefix;
  const std::string& suffix = options_.end_of_word_suffix;
  const bool affixed = !prefix.empty() || !suffix.empty();
  thread_local std::string spelled;
  auto spell = [&](size_t i, size_t len, std::string_view ch) -> std::string_view {
    spelled.clear();
    if (i > 0) spelled += prefix;
    spelled += ch;
    if (i + len == piece.size()) spelled += suffix;
    return spelled;
  };
  if (options_.byte_level) {
    for (size_t i = 0; i < piece.size(); ++i) {
      const auto b = static_cast<unsigned char>(piece[i]);
      if (!affixed && single_byte_id_[b] >= 0) {
        known(single_byte_id_[b]);
        continue;
      }
      std::string ch;  // the character the byte stands for, as the vocabulary spells it
      text::append_utf8(byte_level::char_of(b), ch);
      const std::string_view s = affixed ? spell(i, 1, ch) : std::string_view(ch);
      const int32_t id = affixed ? vocab_.find(s) : -1;
      if (id >= 0) {
        known(id);
      } else {
        unknown(s);
      }
    }
  } else {
    for (size_t i = 0; i < piece.size();) {
      const auto b = static_cast<unsigned char>(piece[i]);
      uint32_t len = 1, cp = b;
      if (b >= 0x80) cp = text::decode_at(piece, i, len);
      const std::string_view ch =
          affixed ? spell(i, len, piece.substr(i, len)) : piece.substr(i, len);
      const int32_t id = affixed     ? vocab_.find(ch)
                         : b >= 0x80 ? char_token(ch, cp)
                                     : single_byte_id_[b];
      if (id >= 0) {
        known(id);
      } else {
        unknown(ch);
      }
      i += len;
    }
  }
  if (pending_unk) ids.push_back(unk_id_);
}

void BpeModel::merge(std::vector<int32_t>& ids) const {
  const size_t n = ids.size();
  if (n < 2) return;
  if (n <= kShortWord && options_.scan_short_words) return merge_short(ids);
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> queue;
  symbols.resize(n);
  queue.clear();
  for (size_t i = 0; i < n; ++i) {
    symbols[i] = Symbol{ids[i], static_cast<int32_t>(i) - 1,
                        i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
    if (i + 1 < n) {
      if (const Merge* m = merges_->find(ids[i], ids[i + 1])) {
        queue.push_back(Candidate{m->rank, static_cast<uint32_t>(i), m->new_id});
      }
    }
  }
  std::make_heap(queue.begin(), queue.end(), lower_priority);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), lower_priority);
    const Candidate top = queue.back();
    queue.pop_back();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const Symbol right = symbols[left.next];
    // Skip entries made stale by an earlier merge of one of the two symbols.
    const Merge* current = merges_->find(left.id, right.id);
    if (current == nullptr || current->new_id != top.new_id) continue;
    symbols[left.next].alive = false;
    left.id = top.new_id;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = static_cast<int32_t>(top.pos);
    if (left.prev >= 0) {
      if (const Merge* m = merges_->find(symbols[left.prev].id, left.id)) {
        queue.push_back(Candidate{m->rank, static_cast<uint32_t>(left.prev), m->new_id});
        std::push_heap(queue.begin(), queue.end(), lower_priority);
      }
    }
    if (left.next >= 0) {
      if (const Merge* m = merges_->find(left.id, symbols[left.next].id)) {
        queue.push_back(Candidate{m->rank, top.pos, m->new_id});
        std::push_heap(queue.begin(), queue.end(), lower_priority);
      }
    }
  }
  ids.clear();
  for (size_t i = 0; i < n; ++i) {
    if (symbols[i].alive) ids.push_back(symbols[i].id);
  }
}

void BpeModel::merge_short(std::vector<int32_t>& ids) const {
  // The same choice as the queue's — the lowest rank, then the leftmost pair — by scanning the
  // current pairs' ranks, which a merge changes only beside it: no queue, no stale entries.
  const size_t n = ids.size();
  constexpr uint32_t kNone = ~0u;
  std::array<int32_t, kShortWord> id;
  std::array<uint32_t, kShortWord> rank;  // of the pair (i, i + 1) among the live symbols
  std::array<int32_t, kShortWord> merged;
  size_t live = n;
  std::copy(ids.begin(), ids.end(), id.begin());
  auto pair_at = [&](size_t i) {
    const Merge* m = i + 1 < live ? merges_->find(id[i], id[i + 1]) : nullptr;
    rank[i] = m != nullptr ? m->rank : kNone;
    merged[i] = m != nullptr ? m->new_id : -1;
  };
  for (size_t i = 0; i < live; ++i) pair_at(i);
  while (live > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < live; ++i) {
      if (rank[i] < rank[best]) best = i;
    }
    if (rank[best] == kNone) break;
    id[best] = merged[best];
    // Close the gap the right symbol leaves.
    for (size_t i = best + 1; i + 1 < live; ++i) {
      id[i] = id[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --live;
    if (best > 0) pair_at(best - 1);
    pair_at(best);
  }
  ids.assign(id.begin(), id.begin() + static_cast<std::ptrdiff_t>(live));
}

bool BpeModel::word_starts_at(std::string_view piece, size_t at) const {
  if (at == 0) return false;
  size_t start = at - 1;  // the previous character's first byte
  while (start > 0 && (static_cast<unsigned char>(piece[start]) & 0xC0) == 0x80) --start;
  uint32_t len = 0;
  const uint32_t before = text::decode_at(piece, start, len);
  if (before == kSpaceChar || std::find(joined_before_space_.begin(), joined_before_space_.end(),
                                        before) != joined_before_space_.end()) {
    return false;
  }
  // A character outside the vocabulary starts as byte-fallback tokens or unk, which the merges
  // above do not speak of: no cut after it.
  const auto b = static_cast<unsigned char>(piece[start]);
  return b < 0x80 ? single_byte_id_[b] >= 0 : char_token(piece.substr(start, len), before) >= 0;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  // Long pieces (a run of 300 spaces) are merged each time (PieceCache::kMaxKey): caching
  // them would only evict the short, frequent ones.
  cache_->encode(word, out, [&](std::string_view p, std::vector<int32_t>& ids) {
    if (options_.ignore_merges) {  // a piece in the vocabulary is its token, merges aside
      const int32_t id = options_.byte_level ? piece_vocab_.find(p) : vocab_.find(p);
      if (id >= 0) {
        ids.push_back(id);
        return;
      }
    }
    initial_symbols(p, ids);
    merge(ids);
  });
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (!split_words_) return encode_word(piece, out);
  size_t word = 0;
  for (size_t at = piece.find(kSpace, 1); at != std::string_view::npos;
       at = piece.find(kSpace, at + 3)) {
    if (!word_starts_at(piece, at)) continue;
    encode_word(piece.substr(word, at - word), out);
    word = at;
  }
  encode_word(piece.substr(word), out);
}

}  // namespace zt
