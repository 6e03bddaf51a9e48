// UTF-8 and Unicode pieces of the HF tokenizers: repairing ill-formed UTF-8, the normalization
// forms (through libutf8proc), the character classes of the split patterns, and the split
// patterns themselves (GPT-2, Qwen2, LLaMA-3, o200k, Tekken, DeepSeek-V3), matched by hand instead
// of by a regex engine.
//
// Everything here is stateless and thread-safe. Text is UTF-8 in std::string_view; spans are
// byte offsets.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zt::text {

/// A [begin, end) byte range.
using Span = std::pair<uint32_t, uint32_t>;

/// True when `s` is well-formed UTF-8 (no surrogates, overlongs or code points past U+10FFFF).
bool is_valid_utf8(std::string_view s);

/// Appends `s` to `out` with every ill-formed subsequence replaced by U+FFFD, one per maximal
/// subpart, exactly as Rust's `String::from_utf8_lossy` (which HF's decoders use) does.
void append_lossy_utf8(std::string_view s, std::string& out);

/// Decodes the code point at `s[i]` of well-formed UTF-8; sets `len` to its byte length.
inline uint32_t decode_at(std::string_view s, size_t i, uint32_t& len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (p[0] < 0x80) {
    len = 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    len = 2;
    return (uint32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    len = 3;
    return (uint32_t(p[0] & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  len = 4;
  return (uint32_t(p[0] & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) |
         (uint32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

/// Appends the UTF-8 encoding of `cp`.
void append_utf8(uint32_t cp, std::string& out);

/// The Unicode normalization forms of HF's NFC / NFD / NFKC / NFKD normalizers.
enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };

/// Appends `form(s)` to `out`; `s` must be well-formed UTF-8. Runs of characters that no
/// normalization form changes (ASCII; for NFC everything below U+0300) are copied as they are,
/// the rest goes through utf8proc.
void normalize(std::string_view s, NormalForm form, std::string& out);

/// Sets up Oniguruma (once per process; thread-safe): UTF-8, and the backtracking limits that
/// stop a hostile regex.
void initialize_oniguruma();

/// Character classes as the split patterns see them: \p{L}, \p{N}, \s (White_Space), \r \n,
/// and the sets o200k's (gpt-oss) and DeepSeek-V3's patterns name. A character has every bit
/// whose set holds it. The data is Unicode 16.0 from Oniguruma's property tables — what the
/// Oniguruma that HF tokenizers bundles matches with (split_classes.inc, generated).
enum CharClass : uint8_t {
  kLetter = 1,
  kNumber = 2,
  kSpace = 4,
  kNewline = 8,
  kUpperSet = 16,     ///< [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
  kLowerSet = 32,     ///< [\p{Ll}\p{Lm}\p{Lo}\p{M}]
  kMark = 64,         ///< \p{M}
  kPunctSymbol = 128  ///< \p{P} or \p{S}
};
uint8_t char_class(uint32_t cp);
/// The same classes from the Oniguruma this program links (Debian 12's: Unicode 14.0), which
/// runs the regexes no hand-written matcher takes; differs from char_class() only on characters
/// assigned since.
uint8_t oniguruma_char_class(uint32_t cp);

/// `\s` and `\w` of Rust's regex crate, used by added tokens' lstrip / rstrip / single_word.
/// `\w` is approximated by the general categories L*, M*, Nd, Nl, Pc plus ZWNJ / ZWJ (Rust adds
/// the few Other_Alphabetic symbols, such as circled letters, that utf8proc does not expose).
inline bool is_space(uint32_t cp) {
  return (char_class(cp) & kSpace) != 0;
}
bool is_word_char(uint32_t cp);

/// The split patterns zerotrain knows, recognised by their exact regex string. Each tiles its
/// text: every character is in a match.
enum class SplitPattern {
  kGpt2,    ///< GPT-2's, also ByteLevel's built-in regex (use_regex: true)
  kQwen2,   ///< Qwen2's: case-insensitive contractions, digits one by one
  kLlama3,  ///< LLaMA-3's: as Qwen2's with digits in groups of up to three
  kO200k,   ///< o200k's (gpt-oss): cased words with their contractions, digits by three
  kTekken,  ///< Mistral-Nemo's (Tekken): o200k's without contractions, digits one by one
};
std::optional<SplitPattern> known_split_pattern(std::string_view regex);
/// The regex string of a known pattern (for messages and docs).
std::string_view split_pattern_regex(SplitPattern p);

/// Appends the matches of `p` in `text` as spans relative to `text` (plus `offset`). Every
/// character is part of exactly one match, so the spans tile `text` (HF's `Isolated` split).
void split_with_pattern(SplitPattern p, std::string_view text, uint32_t offset,
                        std::vector<Span>& out);

/// Known patterns whose matches leave gaps (characters no alternative matches at), matched by
/// hand; a Split keeps the gaps as pieces of their own.
enum class GapPattern {
  kDeepSeekV3,  ///< DeepSeek-V3's main split (after its digit and CJK splits)
};
std::optional<GapPattern> known_gap_pattern(std::string_view regex);
std::string_view gap_pattern_regex(GapPattern p);

/// Appends the matches of `p` in `text` (leftmost, as Oniguruma searches) as spans relative to
/// `text`.
void find_with_pattern(GapPattern p, std::string_view text, std::vector<Span>& out);

}  // namespace zt::text
