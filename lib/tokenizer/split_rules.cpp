// See split_rules.hpp.
#include "tokenizer/split_rules.hpp"

#include <fmt/format.h>
#include <oniguruma.h>

#include <algorithm>
#include <mutex>
#include <optional>

#include "zerotrain/error.hpp"

namespace zt::text {

namespace {

class RegexMatcher final : public Matcher {
 public:
  explicit RegexMatcher(const std::string& pattern) {
    initialize_oniguruma();
    OnigErrorInfo info{};
    const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
    const int r = onig_new(&regex_, p, p + pattern.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8,
                           ONIG_SYNTAX_DEFAULT, &info);
    if (r != ONIG_NORMAL) {
      OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
      onig_error_code_to_str(message, r, &info);
      regex_ = nullptr;
      throw ConfigError(fmt::format("the regex \"{}\" does not compile in Oniguruma: {}", pattern,
                                    reinterpret_cast<const char*>(message)));
    }
  }
  ~RegexMatcher() override {
    if (regex_ != nullptr) onig_free(regex_);
  }
  RegexMatcher(const RegexMatcher&) = delete;
  RegexMatcher& operator=(const RegexMatcher&) = delete;

  void find(std::string_view text, std::vector<Span>& out) const override {
    // A region per thread, kept: Oniguruma searches a shared regex from many threads with
    // their own (and grows a region to the groups of whichever regex uses it).
    struct FreeRegion {
      void operator()(OnigRegion* r) const { onig_region_free(r, 1); }
    };
    thread_local const std::unique_ptr<OnigRegion, FreeRegion> kept(onig_region_new());
    OnigRegion* region = kept.get();
    const auto* begin = reinterpret_cast<const OnigUChar*>(text.data());
    const OnigUChar* end = begin + text.size();
    size_t from = 0;
    bool have_last = false;
    size_t last_end = 0;
    while (from <= text.size()) {
      onig_region_clear(region);
      const int r = onig_search(regex_, begin, end, begin + from, end, region, ONIG_OPTION_NONE);
      if (r == ONIG_MISMATCH) break;
      if (r < 0) {
        OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
        onig_error_code_to_str(message, r);
        throw ConfigError(fmt::format("a tokenizer regex failed while searching: {}",
                                      reinterpret_cast<const char*>(message)));
      }
      const auto s = static_cast<size_t>(region->beg[0]), e = static_cast<size_t>(region->end[0]);
      if (s == e && have_last && last_end == e) {
        // An empty match where the last one ended: step over one character and search again.
        if (from >= text.size()) break;
        uint32_t len = 1;
        const auto c = static_cast<unsigned char>(text[from]);
        len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        from = std::min(text.size(), from + len);
        continue;
      }
      out.emplace_back(static_cast<uint32_t>(s), static_cast<uint32_t>(e));
      from = e;
      last_end = e;
      have_last = true;
      if (s == e && from >= text.size()) break;
    }
  }

 private:
  regex_t* regex_ = nullptr;
};

class LiteralMatcher final : public Matcher {
 public:
  explicit LiteralMatcher(std::string text) : text_(std::move(text)) {}
  void find(std::string_view text, std::vector<Span>& out) const override {
    if (text_.empty()) return;
    for (size_t at = text.find(text_); at != std::string_view::npos;
         at = text.find(text_, at + text_.size())) {
      out.emplace_back(static_cast<uint32_t>(at), static_cast<uint32_t>(at + text_.size()));
    }
  }

 private:
  std::string text_;
};

// Runs of characters of one set, cut into chunks of at most `most` characters (0: no limit):
// what Oniguruma finds for `\p{N}{1,3}`, `\p{N}+` or a class of literal ranges `[一-龥ぁ-ゟ]+`
// (leftmost, greedy, no empty match), without a regex search per piece.
class RunMatcher final : public Matcher {
 public:
  using Member = bool (*)(uint32_t cp, const std::vector<std::pair<uint32_t, uint32_t>>& ranges);
  RunMatcher(Member member, std::vector<std::pair<uint32_t, uint32_t>> ranges, size_t most)
      : member_(member), ranges_(std::move(ranges)), most_(most) {}

  void find(std::string_view text, std::vector<Span>& out) const override {
    size_t i = 0, start = 0, count = 0;
    auto close = [&](size_t end) {
      if (count > 0) out.emplace_back(static_cast<uint32_t>(start), static_cast<uint32_t>(end));
      count = 0;
    };
    while (i < text.size()) {
      uint32_t len = 1;
      const uint32_t cp = decode_at(text, i, len);
      if (!member_(cp, ranges_)) {
        close(i);
      } else {
        if (count == most_ && most_ > 0) close(i);
        if (count == 0) start = i;
        ++count;
      }
      i += len;
    }
    close(text.size());
  }

  static bool number(uint32_t cp, const std::vector<std::pair<uint32_t, uint32_t>>&) {
    return (char_class(cp) & kNumber) != 0;
  }
  static bool in_ranges(uint32_t cp, const std::vector<std::pair<uint32_t, uint32_t>>& ranges) {
    for (const auto& [lo, hi] : ranges) {
      if (cp >= lo && cp <= hi) return true;
    }
    return false;
  }

 private:
  Member member_;
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;
  size_t most_;
};

// The matches of a pattern unicode_text.hpp matches by hand: o200k's, Qwen2's, ... (tiling)
// and DeepSeek-V3's main one (with gaps), for the Splits the tokenizer's own fast path does not
// take (another behavior, invert) and for DeepSeek-V3's.
class KnownPatternMatcher final : public Matcher {
 public:
  explicit KnownPatternMatcher(SplitPattern p) : tiling_(p) {}
  explicit KnownPatternMatcher(GapPattern p) : gaps_(p) {}
  void find(std::string_view text, std::vector<Span>& out) const override {
    if (tiling_) {
      split_with_pattern(*tiling_, text, 0, out);
    } else {
      find_with_pattern(*gaps_, text, out);
    }
  }

 private:
  std::optional<SplitPattern> tiling_;
  std::optional<GapPattern> gaps_;
};

// `pattern` as a RunMatcher when it is one of the simple forms it covers exactly: `\p{N}+`,
// `\p{N}{1,k}`, or `[...]+` of literal characters and ranges a-b (no escapes, negation or
// nested classes); nullptr otherwise.
std::shared_ptr<const Matcher> run_matcher(const std::string& pattern) {
  using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;
  if (pattern == "\\p{N}+") return std::make_shared<RunMatcher>(RunMatcher::number, Ranges{}, 0);
  const std::string digits = "\\p{N}{1,";
  if (pattern.rfind(digits, 0) == 0 && pattern.size() > digits.size() + 1 &&
      pattern.back() == '}') {
    const std::string k = pattern.substr(digits.size(), pattern.size() - digits.size() - 1);
    if (k.size() == 1 && k[0] >= '1' && k[0] <= '9') {
      return std::make_shared<RunMatcher>(RunMatcher::number, Ranges{},
                                          static_cast<size_t>(k[0] - '0'));
    }
    return nullptr;
  }
  if (pattern.size() < 4 || pattern.front() != '[' || pattern.compare(pattern.size() - 2, 2, "]+"))
    return nullptr;
  const std::string_view inner(pattern.data() + 1, pattern.size() - 3);
  if (inner.empty() || !is_valid_utf8(inner)) return nullptr;
  std::vector<uint32_t> cps;
  for (size_t i = 0; i < inner.size();) {
    uint32_t len = 1;
    cps.push_back(decode_at(inner, i, len));
    i += len;
  }
  Ranges ranges;
  for (size_t i = 0; i < cps.size();) {
    const uint32_t c = cps[i];
    // Characters with a meaning inside a class in Oniguruma's syntax: leave those to it.
    if (c == '\\' || c == '[' || c == ']' || c == '^' || c == '&' || c == ':' ||
        (c == '-' && (i == 0 || i + 1 == cps.size()))) {
      return nullptr;
    }
    if (i + 2 < cps.size() && cps[i + 1] == '-') {
      const uint32_t hi = cps[i + 2];
      if (hi < c || hi == '\\' || hi == '[' || hi == ']' || hi == '-') return nullptr;
      ranges.emplace_back(c, hi);
      i += 3;
    } else {
      if (c == '-') return nullptr;
      ranges.emplace_back(c, c);
      i += 1;
    }
  }
  // A class of many ranges (a hostile file's) is Oniguruma's: it tests membership in a table,
  // this one range by range.
  if (ranges.size() > 64) return nullptr;
  return std::make_shared<RunMatcher>(RunMatcher::in_ranges, std::move(ranges), 0);
}

}  // namespace

std::shared_ptr<const Matcher> Matcher::regex(const std::string& pattern) {
  if (auto fast = run_matcher(pattern)) return fast;
  if (auto p = known_split_pattern(pattern)) return std::make_shared<KnownPatternMatcher>(*p);
  if (auto p = known_gap_pattern(pattern)) return std::make_shared<KnownPatternMatcher>(*p);
  return oniguruma(pattern);
}

std::shared_ptr<const Matcher> Matcher::oniguruma(const std::string& pattern) {
  return std::make_shared<RegexMatcher>(pattern);
}

std::shared_ptr<const Matcher> Matcher::literal(std::string text) {
  return std::make_shared<LiteralMatcher>(std::move(text));
}

void split_by(const Matcher& matcher, SplitBehavior behavior, bool invert, std::string_view text,
              uint32_t offset, std::vector<Span>& out, std::vector<Span>& scratch) {
  if (text.empty()) return;
  scratch.clear();
  matcher.find(text, scratch);
  const auto size = static_cast<uint32_t>(text.size());
  if (behavior == SplitBehavior::kIsolated) {
    // Matches and gaps alike become pieces (so invert changes nothing): straight to `out`.
    uint32_t prev = 0;
    for (const Span& m : scratch) {
      if (m.first > prev) out.emplace_back(offset + prev, offset + m.first);
      if (m.second > m.first) out.emplace_back(offset + m.first, offset + m.second);
      prev = m.second;
    }
    if (prev < size) out.emplace_back(offset + prev, offset + size);
    return;
  }
  // The text as pieces that are matches or not (HF's find_matches), with invert applied.
  struct Part {
    uint32_t begin, end;
    bool match;
  };
  // Per-thread scratch: a split runs once per piece, many times per text.
  thread_local std::vector<Part> parts;
  parts.clear();
  uint32_t prev = 0;
  for (const Span& m : scratch) {
    if (m.first > prev) parts.push_back({prev, m.first, invert});
    parts.push_back({m.first, m.second, !invert});
    prev = m.second;
  }
  if (prev < size) parts.push_back({prev, size, invert});
  // HF's NormalizedString::split by behavior (tokenizers' normalizer.rs); empty pieces are
  // dropped after, as PreTokenizedString::split drops them.
  thread_local std::vector<Span> pieces;
  pieces.clear();
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Part& p : parts)
        if (!p.match) pieces.emplace_back(p.begin, p.end);
      break;
    case SplitBehavior::kIsolated:
      for (const Part& p : parts) pieces.emplace_back(p.begin, p.end);
      break;
    case SplitBehavior::kContiguous:  // runs of matches (or of gaps) become one piece
      for (const Part& p : parts) {
        if (p.match == previous_match && !pieces.empty()) {
          pieces.back().second = p.end;
        } else {
          pieces.emplace_back(p.begin, p.end);
        }
        previous_match = p.match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:  // a match after a gap joins the gap
      for (const Part& p : parts) {
        if (p.match && !previous_match && !pieces.empty()) {
          pieces.back().second = p.end;
        } else {
          pieces.emplace_back(p.begin, p.end);
        }
        previous_match = p.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:  // a match before a gap joins it (HF folds backwards)
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous_match && !pieces.empty()) {
          pieces.back().first = it->begin;
        } else {
          pieces.emplace_back(it->begin, it->end);
        }
        previous_match = it->match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
  }
  for (const Span& s : pieces) {
    if (s.second > s.first) out.emplace_back(offset + s.first, offset + s.second);
  }
}

}  // namespace zt::text
