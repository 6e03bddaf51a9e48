// DatasetStats in words (see stats.hpp).
#include "data/stats.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace zt::data {

namespace {

std::string counted(int64_t n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

// "n <noun>" in the samples of `o`.
std::string samples(int64_t n, const DataOptions& o) {
  if (!o.preference) return counted(n, "example", "examples");
  return o.kto ? counted(n, "KTO example", "KTO examples") : counted(n, "pair", "pairs");
}

}  // namespace

std::string kept_summary(const DatasetStats& s, const DataOptions& o) {
  // Preference rows come two by two: a pair's answers, a KTO example and its KL sequence.
  std::string kept = samples(o.preference ? s.examples / 2 : s.examples, o);
  if (o.preference) {
    kept += fmt::format(o.kto ? ", each with its KL sequence ({} sequences)" : " ({} sequences)",
                        s.examples);
  }
  return kept + ", " + counted(s.tokens, "token", "tokens");
}

std::string drop_causes(const DatasetStats& s, const DataOptions& o) {
  std::string out;
  const auto add = [&](int64_t n, const std::string& why) {
    if (n > 0) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n, why);
  };
  add(s.untrained_examples, "without a trained token");
  add(s.truncated_examples,
      fmt::format("left without a trained token by truncation to max_length {}", o.max_length));
  add(s.skipped_truncated,
      fmt::format("cut by ChatGLM-Finetuning's {} layout (skip_truncated)", o.glm_prompt_layout));
  add(s.identical_pairs, "with identical chosen and rejected answers");
  add(s.empty_answers, "with an empty answer");
  add(s.long_prompts, fmt::format("whose prompt alone fills max_length {}", o.max_length));
  add(s.cut_answers,
      fmt::format("whose last {} tokens (keep_end) hold no answer token", o.max_length));
  add(s.cut_identical_pairs,
      fmt::format("whose answers max_length {} cuts to the same sequence", o.max_length));
  return out;
}

std::string dropped_count(const DatasetStats& s, const DataOptions& o) {
  if (!o.kto) return samples(o.preference ? s.dropped_examples / 2 : s.dropped_examples, o);
  // A KTO record is one example, or a pair's two.
  const int64_t records =
      s.identical_pairs + s.empty_answers + s.long_prompts + s.cut_answers + s.cut_identical_pairs;
  return fmt::format("{} ({})", counted(records, "KTO record", "KTO records"),
                     samples(s.dropped_examples / 2, o));
}

}  // namespace zt::data
