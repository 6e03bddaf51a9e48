// UTF-8 repair, normalization through utf8proc, character classes, and the known split patterns
// matched by hand (see unicode_text.hpp).
#include "tokenizer/unicode_text.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <iterator>
#include <mutex>

#include <fmt/format.h>
#include <oniguruma.h>
#include <utf8proc.h>

#include "zerotrain/error.hpp"

namespace zt::text {
namespace {}  // namespace

void initialize_oniguruma() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
    // Backtracking is bounded per search: a pattern that would take hours on some text (a
    // hostile tokenizer.json's `(a|a)*b`) fails with an error instead. Real tokenizers' patterns
    // take a few steps per character, far below either limit.
    onig_set_retry_limit_in_match(10'000'000);
    onig_set_retry_limit_in_search(100'000'000);
  });
}

namespace {

// The second byte of a sequence has a narrower range after these lead bytes (no overlongs, no
// surrogates, nothing past U+10FFFF); later continuation bytes are always 80-BF.
bool second_byte_ok(unsigned char lead, unsigned char b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return b >= 0x80 && b <= 0xBF;
  }
}

// The byte length a lead byte announces; 0 for bytes that cannot start a sequence.
int sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// How many bytes at `p` (of `n`) form a valid sequence, or -k when the first k bytes are the
// maximal ill-formed subpart (k >= 1).
int check_sequence(const unsigned char* p, size_t n) {
  const int want = sequence_length(p[0]);
  if (want == 0) return -1;
  if (want == 1) return 1;
  if (n < 2 || !second_byte_ok(p[0], p[1])) return -1;
  for (int k = 2; k < want; ++k) {
    if (static_cast<size_t>(k) >= n || (p[k] & 0xC0) != 0x80) return -k;
  }
  return want;
}

bool ascii_block(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return (v & 0x8080808080808080ull) == 0;
}

constexpr std::array<uint8_t, 128> make_ascii_classes() {
  std::array<uint8_t, 128> t{};
  for (int c = 0x21; c <= 0x7E; ++c) t[c] = kPunctSymbol;  // letters and digits overwritten
  for (int c = 'a'; c <= 'z'; ++c) t[c] = kLetter | kLowerSet;
  for (int c = 'A'; c <= 'Z'; ++c) t[c] = kLetter | kUpperSet;
  for (int c = '0'; c <= '9'; ++c) t[c] = kNumber;
  for (int c = 0x09; c <= 0x0D; ++c) t[c] = kSpace;
  t[' '] = kSpace;
  t['\n'] = kSpace | kNewline;
  t['\r'] = kSpace | kNewline;
  return t;
}
constexpr std::array<uint8_t, 128> kAsciiClass = make_ascii_classes();

// Oniguruma's ctype of a Unicode property name (\p{Lu}, \p{M}, ...).
OnigCtype property_ctype(const char* name) {
  auto* p = reinterpret_cast<OnigUChar*>(const_cast<char*>(name));
  const int ctype = ONIGENC_PROPERTY_NAME_TO_CTYPE(ONIG_ENCODING_UTF8, p, p + std::strlen(name));
  if (ctype < 0) throw Error(fmt::format("Oniguruma does not know the property {}", name));
  return static_cast<OnigCtype>(ctype);
}

struct ClassRange {
  uint32_t first, last;
  uint8_t classes;
};
constexpr ClassRange kClassRanges[] = {
#include "tokenizer/split_classes.inc"
};

// A character's classes from the generated ranges (Unicode 16.0, as HF tokenizers' Oniguruma).
uint8_t class_from_ranges(uint32_t cp) {
  const auto* end = std::end(kClassRanges);
  const auto* it = std::upper_bound(std::begin(kClassRanges), end, cp,
                                    [](uint32_t c, const ClassRange& r) { return c < r.first; });
  if (it == std::begin(kClassRanges)) return 0;
  --it;
  return cp <= it->last ? it->classes : 0;
}

// The classes of the Basic Multilingual Plane, computed once (64 KiB): most text never leaves
// it, and a table read is cheaper than utf8proc's two-stage lookup plus the switch.
const uint8_t* bmp_classes() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(0x10000);
    for (uint32_t cp = 0; cp < 0x80; ++cp) t[cp] = kAsciiClass[cp];
    for (const ClassRange& r : kClassRanges) {
      if (r.first >= 0x10000) break;
      for (uint32_t cp = r.first; cp <= r.last && cp < 0x10000; ++cp) t[cp] = r.classes;
    }
    return t;
  }();
  return table.data();
}

void normalize_with_utf8proc(std::string_view s, NormalForm form, std::string& out) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  const auto opt = static_cast<utf8proc_option_t>(options);
  const auto* str = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  const auto len = static_cast<utf8proc_ssize_t>(s.size());
  // Decomposition may grow the text; utf8proc says by how much when the buffer is short.
  thread_local std::vector<utf8proc_int32_t> buffer;
  if (buffer.size() < s.size() + 8) buffer.resize(s.size() + 8);
  utf8proc_ssize_t n = utf8proc_decompose(str, len, buffer.data(),
                                          static_cast<utf8proc_ssize_t>(buffer.size()), opt);
  if (n > static_cast<utf8proc_ssize_t>(buffer.size())) {
    buffer.resize(static_cast<size_t>(n));
    n = utf8proc_decompose(str, len, buffer.data(), n, opt);
  }
  if (n >= 0) n = utf8proc_normalize_utf32(buffer.data(), n, opt);
  if (n < 0) {
    throw InvalidArgument(fmt::format("Unicode normalization failed: {}", utf8proc_errmsg(n)));
  }
  for (utf8proc_ssize_t k = 0; k < n; ++k) append_utf8(static_cast<uint32_t>(buffer[k]), out);
}

// ---- split patterns ------------------------------------------------------------------------

struct Char {
  uint32_t cp;
  uint32_t len;
  uint8_t cls;
};

inline Char char_at(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {b, 1, kAsciiClass[b]};
  uint32_t len;
  const uint32_t cp = decode_at(s, i, len);
  return {cp, len, char_class(cp)};
}

inline bool is_other(uint8_t cls) {
  return (cls & (kLetter | kNumber | kSpace)) == 0;
}

// The end of the run of characters of class `mask` that starts at `i`.
inline size_t scan_class(std::string_view s, size_t i, uint8_t mask) {
  while (i < s.size()) {
    const Char c = char_at(s, i);
    if ((c.cls & mask) == 0) break;
    i += c.len;
  }
  return i;
}

inline size_t scan_other(std::string_view s, size_t i) {
  while (i < s.size()) {
    const Char c = char_at(s, i);
    if (!is_other(c.cls)) break;
    i += c.len;
  }
  return i;
}

// 's|'t|'re|'ve|'m|'ll|'d after the apostrophe at `i`: the end of the match, or 0. With
// `fold_case`, as Oniguruma's (?i:...) matches: ASCII either case, and U+017F (long s) for s.
size_t contraction(std::string_view s, size_t i, bool fold_case) {
  auto letter = [&](size_t k, uint32_t& len) -> uint32_t {
    if (k >= s.size()) return 0;
    const Char c = char_at(s, k);
    len = c.len;
    if (!fold_case) return c.cp;
    if (c.cp >= 'A' && c.cp <= 'Z') return c.cp + ('a' - 'A');
    if (c.cp == 0x17F) return 's';
    return c.cp;
  };
  uint32_t l1 = 0, l2 = 0;
  const uint32_t c1 = letter(i + 1, l1);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 1 + l1;
  if (c1 == 'r' || c1 == 'v' || c1 == 'l') {
    const uint32_t c2 = letter(i + 1 + l1, l2);
    if ((c1 == 'l' && c2 == 'l') || (c1 != 'l' && c2 == 'e')) return i + 1 + l1 + l2;
  }
  return 0;
}

// The whitespace alternatives shared by the patterns, for a run of \s starting at `i`:
// `\s*[\r\n]+` (Qwen2 / LLaMA-3 only) ends after the run's last newline; `\s+(?!\S)` takes the
// run, or all of it but its last character when a non-space follows; `\s+` the whole run.
size_t match_spaces(std::string_view s, size_t i, bool newline_alternative) {
  size_t j = i, last_start = i, after_newline = 0;
  while (j < s.size()) {
    const Char c = char_at(s, j);
    if ((c.cls & kSpace) == 0) break;
    last_start = j;
    j += c.len;
    if (c.cls & kNewline) after_newline = j;
  }
  if (newline_alternative && after_newline != 0) return after_newline;
  if (j == s.size()) return j;
  return last_start > i ? last_start : j;
}

// One match of GPT-2's pattern at `i`:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t match_gpt2(std::string_view s, size_t i) {
  const Char c0 = char_at(s, i);
  if (c0.cp == '\'') {
    if (size_t e = contraction(s, i, false)) return e;
  }
  Char c = c0;
  size_t k = i;
  if (c0.cp == ' ' && i + 1 < s.size()) {  // the optional leading space of the next three
    const Char c1 = char_at(s, i + 1);
    if (!(c1.cls & kSpace)) {
      c = c1;
      k = i + 1;
    }
  }
  if (c.cls & kLetter) return scan_class(s, k + c.len, kLetter);
  if (c.cls & kNumber) return scan_class(s, k + c.len, kNumber);
  if (is_other(c.cls)) return scan_other(s, k + c.len);
  return match_spaces(s, i, false);
}

// Where a run of \r, \n (and '/' for o200k) ends: the `[\r\n]*` after a run of symbols.
size_t skip_line_ends(std::string_view s, size_t j, bool slash) {
  while (j < s.size() && (s[j] == '\r' || s[j] == '\n' || (slash && s[j] == '/'))) ++j;
  return j;
}

// `\p{N}{1,most}` where the number `c0` starts at `i`: its end.
size_t numbers_up_to(std::string_view s, size_t i, const Char& c0, int most) {
  size_t j = i + c0.len;
  for (int k = 1; k < most && j < s.size(); ++k) {
    const Char c = char_at(s, j);
    if (!(c.cls & kNumber)) break;
    j += c.len;
  }
  return j;
}

// ` ?[^\s\p{L}\p{N}]+[\r\n]*` (`[\r\n/]*` with `slash`) at `i`, whose character is `c0`: its
// end, or 0 when it does not match there.
size_t symbols_then_line_ends(std::string_view s, size_t i, const Char& c0, bool slash) {
  size_t k = i;
  Char c = c0;
  if (c0.cp == ' ' && i + 1 < s.size()) {
    const Char c1 = char_at(s, i + 1);
    if (is_other(c1.cls)) {
      c = c1;
      k = i + 1;
    }
  }
  return is_other(c.cls) ? skip_line_ends(s, scan_other(s, k + c.len), slash) : 0;
}

// One match of Qwen2's (`digit_group` 1) or LLaMA-3's (3) pattern at `i`:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,g}| ?[^\s\p{L}\p{N}]+[\r\n]*
//   |\s*[\r\n]+|\s+(?!\S)|\s+
size_t match_qwen2(std::string_view s, size_t i, int digit_group) {
  const Char c0 = char_at(s, i);
  const size_t i1 = i + c0.len;
  if (c0.cp == '\'') {
    if (size_t e = contraction(s, i, true)) return e;
  }
  if (c0.cls & kLetter) return scan_class(s, i1, kLetter);
  if (!(c0.cls & (kNumber | kNewline)) && i1 < s.size()) {  // one non-letter before letters
    const Char c1 = char_at(s, i1);
    if (c1.cls & kLetter) return scan_class(s, i1 + c1.len, kLetter);
  }
  if (c0.cls & kNumber) return numbers_up_to(s, i, c0, digit_group);
  if (size_t e = symbols_then_line_ends(s, i, c0, false)) return e;
  return match_spaces(s, i, true);
}

// o200k's `[Lu Lt Lm Lo M]*[Ll Lm Lo M]+` at `j`: its end, or 0 when it does not match. The
// greedy first run gives back characters until the second can start: the whole first run when
// a lowercase-set character follows it (then that set's run), else up to the run's last
// character that is in both sets.
size_t upper_star_lower_plus(std::string_view s, size_t j) {
  size_t k = j, last_lower_end = 0;
  while (k < s.size()) {
    const Char c = char_at(s, k);
    if (!(c.cls & kUpperSet)) break;
    k += c.len;
    if (c.cls & kLowerSet) last_lower_end = k;
  }
  if (k < s.size()) {
    const Char c = char_at(s, k);
    if (c.cls & kLowerSet) return scan_class(s, k + c.len, kLowerSet);
  }
  return last_lower_end;
}

// o200k's `[Lu Lt Lm Lo M]+[Ll Lm Lo M]*` at `j`: its end, or 0.
size_t upper_plus_lower_star(std::string_view s, size_t j) {
  const size_t k = scan_class(s, j, kUpperSet);
  return k == j ? 0 : scan_class(s, k, kLowerSet);
}

// One match of o200k's pattern (gpt-oss) at `i`, or of Mistral-Nemo's (Tekken) without
// `contractions` and with `digit_group` 1:
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|...)?
//   |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|...)?
//   |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Each letter alternative tries its optional first character before going without it, as
// Oniguruma backtracks; a mark may be that character or start the word itself.
size_t match_cased_words(std::string_view s, size_t i, bool contractions, int digit_group) {
  const Char c0 = char_at(s, i);
  const size_t i1 = i + c0.len;
  const bool prefix = !(c0.cls & (kLetter | kNumber | kNewline)) && i1 < s.size();
  size_t e = prefix ? upper_star_lower_plus(s, i1) : 0;
  if (e == 0) e = upper_star_lower_plus(s, i);
  if (e == 0 && prefix) e = upper_plus_lower_star(s, i1);
  if (e == 0) e = upper_plus_lower_star(s, i);
  if (e != 0) {
    if (contractions && e < s.size() && s[e] == '\'') {
      if (size_t c = contraction(s, e, true)) return c;
    }
    return e;
  }
  if (c0.cls & kNumber) return numbers_up_to(s, i, c0, digit_group);
  if (size_t end = symbols_then_line_ends(s, i, c0, true)) return end;
  return match_spaces(s, i, true);
}

// ASCII punctuation and symbols: the class `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]`.
inline bool ascii_punct(uint32_t cp) {
  return cp < 0x80 && (kAsciiClass[cp] & kPunctSymbol) != 0;
}
inline bool ascii_letter(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}

// One match of DeepSeek-V3's main pattern at `i`, or `i` when none starts there:
//   [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
//   | ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Characters outside all of them (a digit or a control character before no letter, ZWJ
// between emoji) are left to the gaps.
size_t match_deepseek_v3(std::string_view s, size_t i) {
  const Char c0 = char_at(s, i);
  const size_t i1 = i + c0.len;
  if (ascii_punct(c0.cp) && i1 < s.size() && ascii_letter(s[i1])) {
    size_t j = i1 + 1;
    while (j < s.size() && ascii_letter(s[j])) ++j;
    return j;
  }
  constexpr uint8_t kLetterMark = kLetter | kMark;
  if (!(c0.cls & (kLetter | kPunctSymbol | kNewline)) && i1 < s.size()) {
    const Char c1 = char_at(s, i1);
    if (c1.cls & kLetterMark) return scan_class(s, i1 + c1.len, kLetterMark);
  }
  if (c0.cls & kLetterMark) return scan_class(s, i1, kLetterMark);
  size_t k = i;
  Char c = c0;
  if (c0.cp == ' ' && i1 < s.size()) {
    const Char c1 = char_at(s, i1);
    if (c1.cls & kPunctSymbol) {
      c = c1;
      k = i1;
    }
  }
  if (c.cls & kPunctSymbol) {
    return skip_line_ends(s, scan_class(s, k + c.len, kPunctSymbol), false);
  }
  if (c0.cls & kSpace) return match_spaces(s, i, true);
  return i;
}

constexpr std::string_view kGpt2Regex =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re";
constexpr std::string_view kQwen2Regex =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
constexpr std::string_view kLlama3Regex =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
constexpr std::string_view kO200kRegex =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
constexpr std::string_view kTekkenRegex =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
// DeepSeek-V3's file writes \r and \n inside its classes as the characters themselves.
constexpr std::string_view kDeepSeekV3Regex =
    "[!\"#$%&'()*+,\\-./"
    ":;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

}  // namespace

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    if (i + 8 <= n && ascii_block(s.data() + i)) {
      i += 8;
      continue;
    }
    const int k = check_sequence(p + i, n - i);
    if (k < 0) return false;
    i += static_cast<size_t>(k);
  }
  return true;
}

void append_lossy_utf8(std::string_view s, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0, copied = 0;
  while (i < n) {
    const int k = check_sequence(p + i, n - i);
    if (k > 0) {
      i += static_cast<size_t>(k);
      continue;
    }
    out.append(s.data() + copied, i - copied);
    out.append("\xEF\xBF\xBD");  // U+FFFD
    i += static_cast<size_t>(-k);
    copied = i;
  }
  out.append(s.data() + copied, n - copied);
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void normalize(std::string_view s, NormalForm form, std::string& out) {
  // Below this no character changes under the form, starts a decomposition or combines with a
  // neighbour: NFC leaves all of U+0000-02FF alone (the combining marks start at U+0300), the
  // other forms only ASCII (NFD splits é, NFKC maps ½ and the no-break space).
  const uint32_t inert_below = form == NormalForm::kNFC ? 0x300 : 0x80;
  size_t i = 0, copied = 0, previous = 0;
  bool has_previous = false;
  while (i < s.size()) {
    uint32_t len;
    const uint32_t cp = decode_at(s, i, len);
    if (cp < inert_below) {
      previous = i;
      has_previous = true;
      i += len;
      continue;
    }
    // A run of other characters goes to utf8proc with the character before it, which a
    // combining mark may compose with; the inert character after the run composes with nothing.
    const size_t begin = has_previous ? previous : i;
    size_t end = i + len;
    while (end < s.size()) {
      const uint32_t next = decode_at(s, end, len);
      if (next < inert_below) break;
      end += len;
    }
    out.append(s.data() + copied, begin - copied);
    normalize_with_utf8proc(s.substr(begin, end - begin), form, out);
    i = copied = end;
    has_previous = false;
  }
  out.append(s.data() + copied, s.size() - copied);
}

uint8_t char_class(uint32_t cp) {
  if (cp < 0x10000) return bmp_classes()[cp];
  return class_from_ranges(cp);
}

uint8_t oniguruma_char_class(uint32_t cp) {
  struct Ctypes {
    OnigCtype lu, lt, ll, lm, lo, m, n, p, s;
  };
  static const Ctypes k = [] {
    initialize_oniguruma();
    return Ctypes{property_ctype("Lu"), property_ctype("Lt"), property_ctype("Ll"),
                  property_ctype("Lm"), property_ctype("Lo"), property_ctype("M"),
                  property_ctype("N"),  property_ctype("P"),  property_ctype("S")};
  }();
  auto is = [cp](OnigCtype t) { return ONIGENC_IS_CODE_CTYPE(ONIG_ENCODING_UTF8, cp, t) != 0; };
  if (cp < 0x80) return kAsciiClass[cp];
  uint8_t c = 0;
  if (is(ONIGENC_CTYPE_SPACE)) c |= kSpace;
  if (is(k.lu) || is(k.lt)) c |= kLetter | kUpperSet;
  if (is(k.ll)) c |= kLetter | kLowerSet;
  if (is(k.lm) || is(k.lo)) c |= kLetter | kUpperSet | kLowerSet;
  if (is(k.m)) c |= kMark | kUpperSet | kLowerSet;
  if (is(k.n)) c |= kNumber;
  if (is(k.p) || is(k.s)) c |= kPunctSymbol;
  return c;
}

bool is_word_char(uint32_t cp) {
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) != 0 || cp == '_';
  if (cp == 0x200C || cp == 0x200D) return true;  // Join_Control
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

std::optional<SplitPattern> known_split_pattern(std::string_view regex) {
  if (regex == kGpt2Regex) return SplitPattern::kGpt2;
  if (regex == kQwen2Regex) return SplitPattern::kQwen2;
  if (regex == kLlama3Regex) return SplitPattern::kLlama3;
  if (regex == kO200kRegex) return SplitPattern::kO200k;
  if (regex == kTekkenRegex) return SplitPattern::kTekken;
  return std::nullopt;
}

std::string_view split_pattern_regex(SplitPattern p) {
  switch (p) {
    case SplitPattern::kGpt2:
      return kGpt2Regex;
    case SplitPattern::kQwen2:
      return kQwen2Regex;
    case SplitPattern::kLlama3:
      return kLlama3Regex;
    case SplitPattern::kO200k:
      return kO200kRegex;
    case SplitPattern::kTekken:
      return kTekkenRegex;
  }
  return {};
}

void split_with_pattern(SplitPattern p, std::string_view text, uint32_t offset,
                        std::vector<Span>& out) {
  size_t i = 0;
  while (i < text.size()) {
    size_t end = 0;
    switch (p) {
      case SplitPattern::kGpt2:
        end = match_gpt2(text, i);
        break;
      case SplitPattern::kQwen2:
        end = match_qwen2(text, i, 1);
        break;
      case SplitPattern::kLlama3:
        end = match_qwen2(text, i, 3);
        break;
      case SplitPattern::kO200k:
        end = match_cased_words(text, i, true, 3);
        break;
      case SplitPattern::kTekken:
        end = match_cased_words(text, i, false, 1);
        break;
    }
    out.emplace_back(offset + static_cast<uint32_t>(i), offset + static_cast<uint32_t>(end));
    i = end;
  }
}

std::optional<GapPattern> known_gap_pattern(std::string_view regex) {
  if (regex == kDeepSeekV3Regex) return GapPattern::kDeepSeekV3;
  return std::nullopt;
}

std::string_view gap_pattern_regex(GapPattern p) {
  switch (p) {
    case GapPattern::kDeepSeekV3:
      return kDeepSeekV3Regex;
  }
  return {};
}

void find_with_pattern(GapPattern p, std::string_view text, std::vector<Span>& out) {
  size_t i = 0;
  while (i < text.size()) {
    size_t end = i;
    switch (p) {
      case GapPattern::kDeepSeekV3:
        end = match_deepseek_v3(text, i);
        break;
    }
    if (end > i) {
      out.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(end));
      i = end;
    } else {
      i += char_at(text, i).len;
    }
  }
}

}  // namespace zt::text
