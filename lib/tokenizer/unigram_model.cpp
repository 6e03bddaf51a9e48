// Unigram as HF tokenizers' `Unigram::encode_optimized` runs it (SentencePiece's Viterbi):
// at each character boundary every piece that starts there is tried through a byte trie, a
// character no single piece covers gets the unk score (the lowest piece score less 10), the
// best total score wins (the first candidate among equals), consecutive unknowns fuse into
// one token, and pieces are turned into ids by their text, with byte fallback for unknowns.
#include "tokenizer/unigram_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt {

// The pieces' bytes as a trie: node 0 is the root; an edge (node, byte) → child lives in one
// open-addressing table, and each node knows the id of the piece ending there (-1: none).
class UnigramModel::Trie {
 public:
  void insert(std::string_view key, int32_t id) {
    uint32_t node = 0;
    for (char c : key) {
      uint32_t child = find(node, static_cast<uint8_t>(c));
      if (child == kNone) {
        child = static_cast<uint32_t>(values_.size());
        values_.push_back(-1);
        add(node, static_cast<uint8_t>(c), child);
      }
      node = child;
    }
    values_[node] = id;
  }

  /// Calls f(length, id) for every piece that is a prefix of `s`, shortest first.
  template <typename F>
  void prefixes(std::string_view s, F&& f) const {
    uint32_t node = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      node = find(node, static_cast<uint8_t>(s[i]));
      if (node == kNone) return;
      if (values_[node] >= 0) f(i + 1, values_[node]);
    }
  }

 private:
  static constexpr uint32_t kNone = ~0u;
  static uint64_t key(uint32_t node, uint8_t byte) { return (uint64_t(node) << 8) | byte; }
  size_t slot(uint64_t k) const { return ((k * 0x9E3779B97F4A7C15ull) >> 24) & (keys_.size() - 1); }

  uint32_t find(uint32_t node, uint8_t byte) const {
    if (keys_.empty()) return kNone;
    const uint64_t k = key(node, byte);
    for (size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == k) return children_[i];
      if (keys_[i] == kEmpty) return kNone;
    }
  }

  void add(uint32_t node, uint8_t byte, uint32_t child) {
    if ((used_ + 1) * 2 > keys_.size()) grow();
    const uint64_t k = key(node, byte);
    size_t i = slot(k);
    while (keys_[i] != kEmpty) i = (i + 1) & (keys_.size() - 1);
    keys_[i] = k;
    children_[i] = child;
    ++used_;
  }

  void grow() {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<uint32_t> children = std::move(children_);
    keys_.assign(keys.empty() ? 1024 : keys.size() * 2, kEmpty);
    children_.assign(keys_.size(), kNone);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == kEmpty) continue;
      size_t j = slot(keys[i]);
      while (keys_[j] != kEmpty) j = (j + 1) & (keys_.size() - 1);
      keys_[j] = keys[i];
      children_[j] = children[i];
    }
  }

  static constexpr uint64_t kEmpty = ~0ull;
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> children_;
  std::vector<int32_t> values_ = {-1};  // the root
  size_t used_ = 0;
};

namespace {

std::vector<std::pair<std::string, int32_t>> indexed(
    const std::vector<std::pair<std::string, double>>& pieces) {
  std::vector<std::pair<std::string, int32_t>> out;
  out.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i)
    out.emplace_back(pieces[i].first, static_cast<int32_t>(i));
  return out;
}

constexpr double kUnkPenalty = 10.0;  // HF's K_UNK_PENALTY

}  // namespace

UnigramModel::UnigramModel(const std::vector<std::pair<std::string, double>>& pieces,
                           std::optional<int32_t> unk_id, bool byte_fallback,
                           const std::string& where)
    : VocabularyModel(Vocabulary(indexed(pieces), where)),
      trie_(std::make_unique<Trie>()),
      byte_fallback_(byte_fallback),
      where_(where),
      cache_(std::make_unique<PieceCache>()) {
  if (unk_id) {
    if (pieces.empty() || *unk_id < 0 || static_cast<size_t>(*unk_id) >= pieces.size()) {
      throw ConfigError(
          fmt::format("{}: model.unk_id: {} is not the index of a piece (there are {})", where,
                      *unk_id, pieces.size()));
    }
    unk_id_ = *unk_id;
  }
  double min_score = std::numeric_limits<double>::infinity();
  scores_.reserve(pieces.size());
  for (const auto& [piece, score] : pieces) {
    if (!std::isfinite(score)) {
      throw ConfigError(fmt::format(
          "{}: model.vocab: \"{}\" has score {}: expected a finite number", where, piece, score));
    }
    scores_.push_back(score);
    min_score = std::min(min_score, score);
    // HF's trie holds every piece, the empty one aside; the id is the piece's last index.
    if (!piece.empty()) trie_->insert(piece, vocab_.find(piece));
  }
  unk_score_ = min_score - kUnkPenalty;
  for (int b = 0; b < 256; ++b) byte_token_[b] = vocab_.find(fmt::format("<0x{:02X}>", b));
}

UnigramModel::~UnigramModel() = default;

void UnigramModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  cache_->encode(piece, out,
                 [&](std::string_view p, std::vector<int32_t>& ids) { segment(p, ids); });
}

void UnigramModel::segment(std::string_view s, std::vector<int32_t>& out) const {
  struct Best {
    double score = 0;
    int64_t starts_at = -1;  // -1: no path ends here yet
    int32_t id = -1;
  };
  auto missing_unk = [&]() {
    return ConfigError(fmt::format(
        "{}: the Unigram model has no unk_id, and the text has a character no piece covers; "
        "a tokenizer.json with \"unk_id\" is needed for such text",
        where_));
  };
  const size_t n = s.size();
  thread_local std::vector<Best> best;
  best.assign(n + 1, Best{});
  for (size_t at = 0; at < n;) {
    const double here = best[at].score;
    uint32_t char_len = 1;
    text::decode_at(s, at, char_len);
    bool single = false;
    trie_->prefixes(s.substr(at), [&](size_t len, int32_t id) {
      Best& target = best[at + len];
      const double candidate = scores_[static_cast<size_t>(id)] + here;
      if (target.starts_at < 0 || candidate > target.score) {
        target = Best{candidate, static_cast<int64_t>(at), id};
      }
      if (len == char_len) single = true;
    });
    if (!single) {
      Best& target = best[at + char_len];
      const double candidate = unk_score_ + here;
      if (target.starts_at < 0 || candidate > target.score) {
        if (unk_id_ < 0) throw missing_unk();
        target = Best{candidate, static_cast<int64_t>(at), unk_id_};
      }
    }
    at += char_len;
  }
  // Back from the end: the pieces, unknown runs fused into one string.
  thread_local std::vector<std::pair<size_t, size_t>> spans;  // [begin, end), reversed
  spans.clear();
  size_t run_end = 0;
  bool in_run = false;
  for (size_t end = n; end > 0;) {
    const Best& node = best[end];
    const auto begin = static_cast<size_t>(node.starts_at);
    if (node.id == unk_id_) {
      if (!in_run) run_end = end;
      in_run = true;
    } else {
      if (in_run) {
        spans.emplace_back(end, run_end);
        in_run = false;
      }
      spans.emplace_back(begin, end);
    }
    end = begin;
  }
  if (in_run) spans.emplace_back(0, run_end);
  for (size_t k = spans.size(); k-- > 0;) {
    const std::string_view text = s.substr(spans[k].first, spans[k].second - spans[k].first);
    const int32_t id = vocab_.find(text);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    if (byte_fallback_ && std::all_of(text.begin(), text.end(), [&](char c) {
          return byte_token_[static_cast<unsigned char>(c)] >= 0;
        })) {
      for (char c : text) out.push_back(byte_token_[static_cast<unsigned char>(c)]);
      continue;
    }
    if (unk_id_ < 0) throw missing_unk();
    out.push_back(unk_id_);
  }
}

}  // namespace zt
