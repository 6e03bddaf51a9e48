// See split_rules.hpp.
#include "tokenizer/split_rules.hpp"

#include <fmt/format.h>
#include <oniguruma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <deque>
#include <limits>
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

// A pattern that is one character atom with a greedy count (class_run_matcher): its matches
// are runs of member characters cut into chunks of at most `most` characters, a chunk kept when
// it holds at least `least` — what Oniguruma finds for `[...]{n,m}` (leftmost, greedy; a run
// shorter than `least` matches nowhere), without a regex search per match. Membership comes
// from Oniguruma itself, one 256-character block at a time on first use, so the set is the
// regex engine's; `\p{L}` and `\p{N}` alone are answered from split_classes.inc, Unicode 16 as
// HF tokenizers' Oniguruma has it, where Debian's has Unicode 14.
class ClassRunMatcher final : public Matcher {
 public:
  struct FreeRegex {
    void operator()(regex_t* r) const { onig_free(r); }
  };
  using Regex = std::unique_ptr<regex_t, FreeRegex>;

  ClassRunMatcher(Regex atom, uint8_t classes, size_t least, size_t most)
      : atom_(std::move(atom)), classes_(classes), least_(least), most_(most) {
    for (auto& b : bmp_) b.store(nullptr, std::memory_order_relaxed);
    ascii_ = block(0);
  }
  ~ClassRunMatcher() override { delete[] astral_.load(std::memory_order_relaxed); }
  ClassRunMatcher(const ClassRunMatcher&) = delete;
  ClassRunMatcher& operator=(const ClassRunMatcher&) = delete;

  void find(std::string_view text, std::vector<Span>& out) const override {
    size_t start = 0, count = 0;
    const auto close = [&](size_t end) {
      if (count >= least_)
        out.emplace_back(static_cast<uint32_t>(start), static_cast<uint32_t>(end));
      count = 0;
    };
    for (size_t i = 0; i < text.size();) {
      uint32_t len = 1;
      const uint32_t cp = decode_at(text, i, len);
      if (!member(cp)) {
        if (count > 0) close(i);
      } else {
        if (count == most_) close(i);
        if (count == 0) start = i;
        ++count;
      }
      i += len;
    }
    if (count > 0) close(text.size());
  }

 private:
  using Bits = std::array<uint64_t, 4>;
  using Slot = std::atomic<const Bits*>;
  static constexpr size_t kBmpBlocks = 0x10000 / 256;
  static constexpr size_t kAstralBlocks = (0x110000 - 0x10000) / 256;

  bool member(uint32_t cp) const {
    if (classes_ != 0) return (char_class(cp) & classes_) != 0;
    const Bits* b = nullptr;
    if (cp < 256) {
      b = ascii_;
    } else if (cp < 0x10000) {
      b = bmp_[cp >> 8].load(std::memory_order_acquire);
    } else if (const Slot* astral = astral_.load(std::memory_order_acquire)) {
      b = astral[(cp >> 8) - kBmpBlocks].load(std::memory_order_acquire);
    }
    if (b == nullptr) b = block(cp >> 8);
    return ((*b)[(cp >> 6) & 3] >> (cp & 63)) & 1;
  }

  // The slot of block k; the table past the Basic Multilingual Plane is made on first use (a
  // file with many Split steps keeps 2 KiB a pattern until text leaves the BMP). Under mutex_.
  Slot& slot(uint32_t k) const {
    if (k < kBmpBlocks) return bmp_[k];
    Slot* astral = astral_.load(std::memory_order_relaxed);
    if (astral == nullptr) {
      astral = new Slot[kAstralBlocks];
      for (size_t i = 0; i < kAstralBlocks; ++i)
        astral[i].store(nullptr, std::memory_order_relaxed);
      astral_.store(astral, std::memory_order_release);
    }
    return astral[k - kBmpBlocks];
  }

  // The members of block k (code points 256k to 256k + 255), asked of Oniguruma once.
  const Bits* block(uint32_t k) const {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& target = slot(k);
    if (const Bits* b = target.load(std::memory_order_relaxed)) return b;
    Bits bits{};
    if (classes_ == 0) {
      for (uint32_t c = 0; c < 256; ++c) {
        const uint32_t cp = k * 256 + c;
        if (cp >= 0xD800 && cp < 0xE000) continue;  // not in well-formed text
        std::string utf8;
        append_utf8(cp, utf8);
        const auto* p = reinterpret_cast<const OnigUChar*>(utf8.data());
        const int r = onig_match(atom_.get(), p, p + utf8.size(), p, nullptr, ONIG_OPTION_NONE);
        if (r == static_cast<int>(utf8.size())) bits[c >> 6] |= uint64_t{1} << (c & 63);
      }
    }
    storage_.push_back(bits);
    target.store(&storage_.back(), std::memory_order_release);
    return &storage_.back();
  }

  Regex atom_;
  uint8_t classes_;  // nonzero: the CharClass bits that decide membership
  size_t least_, most_;
  const Bits* ascii_ = nullptr;
  mutable std::array<Slot, kBmpBlocks> bmp_;
  mutable std::atomic<Slot*> astral_{nullptr};
  mutable std::deque<Bits> storage_;  // never moves what it holds
  mutable std::mutex mutex_;
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

// The length of the single-character atom `p` starts with, or 0 when it starts with anything
// else: a bracket class (nested classes, `&&` and POSIX brackets inside it; one starting with
// `]` is left to Oniguruma), `\p{..}` / `\P{..}`, `\w \W \s \S \d \D \h \H`, `\t \n \r \f \v`,
// `\xHH`, `\x{H..}`, an escaped ASCII punctuation character, `.`, or a literal character.
// Everything else (groups, anchors, alternation, `\R`, `\X`, back-references) is not one.
size_t atom_length(std::string_view p) {
  const size_t n = p.size();
  if (n == 0) return 0;
  const char c = p[0];
  if (c == '[') {
    size_t i = 1;
    int depth = 1;
    auto opened = [&] {  // after a '[': an optional '^', then not ']'
      if (i < n && p[i] == '^') ++i;
      return i < n && p[i] != ']';
    };
    if (!opened()) return 0;
    while (i < n) {
      if (p[i] == '\\') {
        i += 2;
      } else if (p[i] == '[') {
        ++i;
        ++depth;
        if (!opened()) return 0;
      } else if (p[i] == ']') {
        ++i;
        if (--depth == 0) return i;
      } else {
        ++i;
      }
    }
    return 0;
  }
  if (c == '\\') {
    if (n < 2) return 0;
    const char d = p[1];
    if (std::string_view("wWsSdDhHtnrfv").find(d) != std::string_view::npos) return 2;
    if (d == 'p' || d == 'P' || (d == 'x' && n > 2 && p[2] == '{')) {
      if (n < 4 || p[2] != '{') return 0;
      const size_t close = p.find('}', 3);
      return close == std::string_view::npos ? 0 : close + 1;
    }
    if (d == 'x') {
      return n >= 4 && std::isxdigit(static_cast<unsigned char>(p[2])) &&
                     std::isxdigit(static_cast<unsigned char>(p[3]))
                 ? 4
                 : 0;
    }
    // An escaped punctuation character is itself, but for the GNU operators `\<` `\>` `\``
    // `\'` some syntaxes read as anchors.
    const auto u = static_cast<unsigned char>(d);
    return u < 0x80 && std::ispunct(u) && std::string_view("<>`'").find(d) == std::string_view::npos
               ? 2
               : 0;
  }
  if (c == '.') return 1;
  if (std::string_view("^$|?*+(){}]").find(c) != std::string_view::npos) return 0;
  const auto u = static_cast<unsigned char>(c);
  const size_t len = u < 0x80 ? 1 : u < 0xE0 ? 2 : u < 0xF0 ? 3 : 4;
  return len <= n && is_valid_utf8(p.substr(0, len)) ? len : 0;
}

// `text` as a count in [1, 100000] (Oniguruma's largest), or 0.
size_t count_of(std::string_view text) {
  if (text.empty() || text.size() > 6) return 0;
  size_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return 0;
    v = v * 10 + static_cast<size_t>(c - '0');
  }
  return v <= 100000 ? v : 0;
}

// `pattern` as a ClassRunMatcher when it is one character atom (atom_length) followed by
// nothing, `+`, `{n}`, `{n,}` or `{n,m}` with 1 ≤ n ≤ m (greedy; lazy and possessive counts,
// `*`, `?` and zero counts are Oniguruma's), and the atom compiles; nullptr otherwise.
std::shared_ptr<const Matcher> class_run_matcher(const std::string& pattern) {
  const size_t atom = atom_length(pattern);
  if (atom == 0) return nullptr;
  const std::string_view count = std::string_view(pattern).substr(atom);
  constexpr size_t kUnbounded = std::numeric_limits<size_t>::max();
  size_t least = 1, most = 1;
  if (count == "+") {
    most = kUnbounded;
  } else if (!count.empty()) {
    if (count.size() < 3 || count.front() != '{' || count.back() != '}') return nullptr;
    const std::string_view inner = count.substr(1, count.size() - 2);
    const size_t comma = inner.find(',');
    least = count_of(inner.substr(0, comma));
    if (comma == std::string_view::npos) {
      most = least;
    } else if (comma + 1 == inner.size()) {
      most = kUnbounded;
    } else {
      most = count_of(inner.substr(comma + 1));
    }
    if (least == 0 || most == 0 || most < least) return nullptr;
  }
  initialize_oniguruma();
  regex_t* compiled = nullptr;
  OnigErrorInfo info{};
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  if (onig_new(&compiled, p, p + atom, ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT,
               &info) != ONIG_NORMAL) {
    return nullptr;  // Oniguruma's own error, from the whole pattern
  }
  ClassRunMatcher::Regex regex(compiled);
  const std::string_view a(pattern.data(), atom);
  const uint8_t classes = a == "\\p{L}" ? kLetter : a == "\\p{N}" ? kNumber : 0;
  return std::make_shared<ClassRunMatcher>(std::move(regex), classes, least, most);
}

}  // namespace

std::shared_ptr<const Matcher> Matcher::regex(const std::string& pattern) {
  if (auto fast = class_run_matcher(pattern)) return fast;
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
