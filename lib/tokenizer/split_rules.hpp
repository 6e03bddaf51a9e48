// HF tokenizers' `Split` pre-tokenizer in general: a pattern (a regex, run by Oniguruma — the
// engine HF tokenizers compiles tokenizer.json's regexes with — or a literal string), a
// `behavior` and `invert`. The tiling regexes unicode_text.hpp matches by hand (GPT-2, Qwen2,
// LLaMA-3, o200k) keep the tokenizer's own path when split Isolated and not inverted; everything
// else comes here, where known regexes still match by hand.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/unicode_text.hpp"

namespace zt::text {

/// What a split does with the pattern's matches (HF's SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

/// A pattern's non-overlapping matches, leftmost first, as HF's `Pattern::find_matches` finds
/// them. Immutable once built; find() may run from any thread at once.
class Matcher {
 public:
  /// A regex in Oniguruma's Ruby syntax (what HF tokenizers' onig crate compiles), UTF-8.
  /// Throws ConfigError with Oniguruma's message when it does not compile. Matched by hand,
  /// with Oniguruma's matches: a pattern of one character atom with a greedy count — a bracket
  /// class, `\p{..}`, `\s`, `.`, a literal, ... then nothing, `+`, `{n}`, `{n,}` or `{n,m}`:
  /// the classes of BERT's and ALBERT's pre-tokenizers, `\p{N}{1,3}`, DeepSeek-V3's
  /// `[一-龥぀-ゟ]+`, ALBERT's ` {2,}` (membership asked of Oniguruma once per 256 code
  /// points) — and the exact regexes unicode_text.hpp knows (GPT-2's, Qwen2's, LLaMA-3's,
  /// o200k's, DeepSeek-V3's main one).
  static std::shared_ptr<const Matcher> regex(const std::string& pattern);
  /// The same pattern always run by Oniguruma (the reference of the hand-written forms).
  static std::shared_ptr<const Matcher> oniguruma(const std::string& pattern);
  /// A literal string (HF's `{"String": ...}`); an empty one matches nothing.
  static std::shared_ptr<const Matcher> literal(std::string text);

  virtual ~Matcher() = default;
  /// Appends the [begin, end) byte ranges of the matches in `text`. A regex may match empty
  /// text; an empty match right where the previous one ended is skipped, as the onig crate's
  /// find_iter does.
  virtual void find(std::string_view text, std::vector<Span>& out) const = 0;
};

/// Splits `text` by `matcher` as HF's Split pre-tokenizer does (its matches and the gaps
/// between them, `invert` swapping the two, then `behavior`) and appends the non-empty pieces
/// as spans relative to `text` plus `offset`. `scratch` is reused between calls.
void split_by(const Matcher& matcher, SplitBehavior behavior, bool invert, std::string_view text,
              uint32_t offset, std::vector<Span>& out, std::vector<Span>& scratch);

}  // namespace zt::text
