// GRPO's reward functions: the built-ins (math answer equality, format by pattern, TRL's
// think format, DAPO's soft overlong punishment, TRL's n-gram repetition penalty) and the
// scoring of a generation batch by any list of them, with every failure named by function,
// completion and prompt (docs/grpo.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/grpo.hpp"

namespace zt::train {

using zt::RewardFunction;
using zt::RewardInput;

/// The answer a math completion gives: its last \boxed{...}'s content, else its last number
/// (commas removed); empty when it has neither.
std::string completion_answer(const std::string& text);
/// The reference answer of a dataset's `answer` / `solution` text: after GSM8K's last "####",
/// else the last \boxed{...}'s content, else the whole text, trimmed.
std::string reference_answer(const std::string& text);
/// Whether two answers are the same: as numbers when both read as one (1,000 = 1000.0 = 1e3;
/// a/b and \frac{a}{b} as fractions), else as text without spaces, "$" and a final ".".
bool same_answer(const std::string& a, const std::string& b);

/// Scores `inputs` (completions in groups of `num_generations`) by every function:
/// [completions, functions] fp64, NaN where a function gave None. What a function throws is
/// rethrown with its class (a CancelledError stays one) and a message naming the function; the
/// wrong number of rewards, or a NaN or infinite reward, is an InvalidArgument naming it, the
/// completion and its prompt's index in the batch (i / num_generations).
at::Tensor score_completions(const std::vector<RewardFunction>& functions,
                             const std::vector<RewardInput>& inputs, int64_t num_generations);

}  // namespace zt::train
