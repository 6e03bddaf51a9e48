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
      trie_(std::make_unique<ByteTrie>()),
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
  // Back from the end: the pieces (their ids the trie's), unknown runs fused into one string.
  struct Span {
    size_t begin, end;
    int32_t id;  // -1: an unknown run
  };
  thread_local std::vector<Span> spans;  // reversed
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
        spans.push_back(Span{end, run_end, -1});
        in_run = false;
      }
      spans.push_back(Span{begin, end, node.id});
    }
    end = begin;
  }
  if (in_run) spans.push_back(Span{0, run_end, -1});
  for (size_t k = spans.size(); k-- > 0;) {
    if (spans[k].id >= 0) {
      out.push_back(spans[k].id);
      continue;
    }
    const std::string_view text = s.substr(spans[k].begin, spans[k].end - spans[k].begin);
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
