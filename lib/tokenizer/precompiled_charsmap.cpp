// The charsmap's format (spm_precompiled, after SentencePiece's normalizer.cc): a little-endian
// u32 byte length of the trie, the trie as Darts double-array units (u32), then the
// replacement strings, NUL-terminated, which trie values point into. Grapheme clusters are
// utf8proc's extended ones (UAX #29), as the unicode-segmentation crate finds them.
#include "tokenizer/precompiled_charsmap.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <utf8proc.h>

#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

// Standard base64 with padding (Rust's BASE64_STANDARD); nullopt when it is not.
std::optional<std::string> decode_base64(std::string_view s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (s.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(s.size() / 4 * 3);
  for (size_t i = 0; i < s.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s[i + k];
      if (c == '=' && i + 4 == s.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else if (pad > 0 || (v[k] = value(c)) < 0) {
        return std::nullopt;
      }
    }
    const uint32_t n =
        (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out.push_back(static_cast<char>(n >> 16));
    if (pad < 2) out.push_back(static_cast<char>((n >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(n & 0xFF));
  }
  return out;
}

// A Darts unit's fields (spm_precompiled's ArrayUnitTrait, on 64-bit words).
bool has_leaf(uint64_t u) {
  return ((u >> 8) & 1) == 1;
}
uint64_t value_of(uint64_t u) {
  return u & ((uint64_t(1) << 31) - 1);
}
uint64_t label_of(uint64_t u) {
  return u & ((uint64_t(1) << 31) | 0xFF);
}
uint64_t offset_of(uint64_t u) {
  return (u >> 10) << ((u & (uint64_t(1) << 9)) >> 6);
}

}  // namespace

PrecompiledCharsmap::PrecompiledCharsmap(std::string_view base64, const std::string& where) {
  std::optional<std::string> bytes = decode_base64(base64);
  auto fail = [&](const char* why) {
    return ConfigError(
        fmt::format("{}: normalizer.precompiled_charsmap: {}; is the file damaged?", where, why));
  };
  if (!bytes) throw fail("not standard base64");
  if (bytes->size() < 4) throw fail("shorter than its 4-byte header");
  auto u32 = [&](size_t at) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes->data()) + at;
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
  };
  const size_t units = u32(0) / 4;
  if (4 + units * 4 > bytes->size()) throw fail("its trie is longer than the data");
  array_.resize(units);
  for (size_t i = 0; i < units; ++i) array_[i] = u32(4 + i * 4);
  normalized_ = bytes->substr(4 + units * 4);
  if (!text::is_valid_utf8(normalized_)) throw fail("its replacement strings are not UTF-8");
  for (size_t begin = 0; begin < normalized_.size();) {
    size_t end = normalized_.find('\0', begin);
    if (end == std::string::npos) end = normalized_.size();
    longest_ = std::max(longest_, end - begin);
    begin = end + 1;
  }
  for (int b = 0; b < 128; ++b) {
    const std::string c(1, static_cast<char>(b));
    const std::optional<std::string_view> r = transform(c);
    ascii_[b] = r ? std::string(*r) : c;
  }
}

std::optional<std::string_view> PrecompiledCharsmap::transform(std::string_view chunk) const {
  // Darts' common-prefix search up to the first leaf; a unit index outside the array (a
  // damaged trie, where HF would panic) ends the search.
  if (array_.empty()) return std::nullopt;
  uint64_t pos = offset_of(array_[0]);
  for (char ch : chunk) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0) break;
    pos ^= c;
    if (pos >= array_.size()) return std::nullopt;
    const uint64_t unit = array_[pos];
    if (label_of(unit) != c) return std::nullopt;
    pos ^= offset_of(unit);
    if (has_leaf(unit)) {
      if (pos >= array_.size()) return std::nullopt;
      const uint64_t begin = value_of(array_[pos]);
      if (begin > normalized_.size()) return std::nullopt;
      uint64_t end = begin;
      while (end < normalized_.size() && normalized_[end] != '\0') ++end;
      const std::string_view s(normalized_.data() + begin, end - begin);
      // A replacement cut inside a character (a damaged trie) is no replacement.
      if (!text::is_valid_utf8(s) ||
          (begin < normalized_.size() &&
           (static_cast<unsigned char>(normalized_[begin]) & 0xC0) == 0x80)) {
        return std::nullopt;
      }
      return s;
    }
  }
  return std::nullopt;
}

void PrecompiledCharsmap::normalize(std::string_view text, std::string& out) const {
  utf8proc_int32_t state = 0;
  size_t cluster = 0;  // where the current grapheme cluster starts
  uint32_t previous = 0;
  auto flush = [&](size_t end) {
    const std::string_view g = text.substr(cluster, end - cluster);
    if (g.empty()) return;
    if (g.size() < 6) {
      if (std::optional<std::string_view> r = transform(g)) {
        out.append(*r);
        return;
      }
    }
    for (size_t i = 0; i < g.size();) {
      uint32_t len;
      text::decode_at(g, i, len);
      const std::string_view c = g.substr(i, len);
      if (std::optional<std::string_view> r = transform(c)) {
        out.append(*r);
      } else {
        out.append(c);
      }
      i += len;
    }
  };
  for (size_t i = 0; i < text.size();) {
    uint32_t len;
    const uint32_t cp = text::decode_at(text, i, len);
    if (i > 0 && utf8proc_grapheme_break_stateful(static_cast<utf8proc_int32_t>(previous),
                                                  static_cast<utf8proc_int32_t>(cp), &state)) {
      flush(i);
      cluster = i;
    }
    if (cp < 0x80 && cluster == i) {
      // A cluster starts at this ASCII character. Followed by another ASCII character (but LF
      // after CR) it is a cluster alone, and so is each one after it while the next is ASCII:
      // their replacements come from a table. The last of the run may join what follows.
      size_t j = i;
      while (j + 1 < text.size() && static_cast<unsigned char>(text[j + 1]) < 0x80 &&
             !(text[j] == '\r' && text[j + 1] == '\n')) {
        out.append(ascii_[static_cast<unsigned char>(text[j])]);
        ++j;
      }
      if (j > i) {
        cluster = j;
        previous = static_cast<unsigned char>(text[j - 1]);
        state = 0;  // what the break after an ASCII character leaves (its own class)
        i = j;
        continue;
      }
    }
    previous = cp;
    i += len;
  }
  flush(text.size());
}

}  // namespace zt
