// SentencePiece's precompiled normalization rules (`precompiled_charsmap` of a Precompiled
// normalizer: T5, ALBERT, XLM-R, mBART and the other SentencePiece conversions), applied as HF
// tokenizers applies them: per extended grapheme cluster, the cluster's replacement when it is
// shorter than 6 bytes and a rule starts it, else each character's own.
//
// Thread-safety: immutable after construction.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

class PrecompiledCharsmap {
 public:
  /// `base64`: the tokenizer.json field; errors (not base64, a trie past the data, rules that
  /// are not UTF-8) are ConfigErrors starting with `where`.
  PrecompiledCharsmap(std::string_view base64, const std::string& where);

  /// Appends the normalized `text` (well-formed UTF-8) to `out`.
  void normalize(std::string_view text, std::string& out) const;
  /// The byte length of the longest replacement (how much a character may grow).
  size_t longest_replacement() const { return longest_; }

 private:
  /// The replacement of the shortest rule that starts `chunk`, or nullopt.
  std::optional<std::string_view> transform(std::string_view chunk) const;

  std::vector<uint32_t> array_;  // the Darts double array
  std::string normalized_;       // the replacements, each ended by a NUL
  size_t longest_ = 0;
  std::array<std::string, 128> ascii_;  // what an ASCII character alone in its cluster becomes
};

}  // namespace zt
