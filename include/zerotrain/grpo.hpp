// GRPO (online RL with verifiable rewards) for hosts: the prompts of a step, the reward
// functions that score its completions, and what a step reports (Trainer::train_grpo_step).
// docs/grpo.md says what runs; docs/grpo_reference.md the formulas, from TRL's GRPOTrainer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zt {

class Tokenizer;

/// One prompt of a GRPO step: its tokens as the model sees them (templated, with any BOS), and
/// the dataset row's other columns as text (`answer`, `solution`, ...) for the rewards.
struct GrpoPrompt {
  std::vector<int64_t> ids;
  std::map<std::string, std::string> columns;
};

/// The prompts of a JSON-lines file in TRL's prompt-dataset layout, each row an object with a
/// "prompt" — text, encoded as it is (no special tokens added), or a list of messages (system
/// first, then user / assistant, ending with a user message), rendered by the chat template
/// `template_name` with its generation prompt — and any other columns (kept as text, JSON for
/// non-strings). With max_prompt_length > 0 a prompt keeps its last max_prompt_length tokens;
/// with max_tokens > 0 a longer prompt is left out and counted in `dropped`. Empty prompts are
/// left out. ConfigError naming the file and line for a row of another shape; the file is read
/// only if it is a regular file. What stage grpo and `zerotrain generate` read.
std::vector<GrpoPrompt> read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                                          const std::string& template_name,
                                          int64_t max_prompt_length = 0, int64_t max_tokens = 0,
                                          int64_t* dropped = nullptr);

/// What a reward function sees of one completion.
struct RewardInput {
  std::string prompt;                          ///< the prompt's text (decoded)
  std::string completion;                      ///< the completion's text (special tokens dropped)
  std::vector<int64_t> completion_ids;         ///< its tokens (with a final stop token)
  std::map<std::string, std::string> columns;  ///< its prompt's other columns
};

/// Rewards of a batch of completions, one per input in order; nullopt: this function does not
/// score that completion (TRL's None). A function may throw; it is called on the thread that
/// runs the step, once per step and rank with that rank's completions.
using RewardFn =
    std::function<std::vector<std::optional<double>>(const std::vector<RewardInput>& batch)>;

struct RewardFunction {
  std::string name;  ///< metrics: rewards/<name>/mean and rewards/<name>/std
  RewardFn fn;
};

/// A built-in reward by its spec (ConfigError naming `what` and the choices otherwise):
///   accuracy              1 when the completion's answer (its last \boxed{...}, else its last
///                         number) equals the row's `answer` or `solution` column (GSM8K's
///                         "#### n", a \boxed{}, or the text); None where the row has none
///   think_format          TRL's think_format_reward: the completion opens with <think> and
///                         closes it once
///   format:PATTERN        1 when PATTERN (RE2, "." matching newlines) matches at the start of
///                         the completion (Python's re.match with DOTALL), else 0
///   overlong:MAX:CACHE    DAPO's soft overlong punishment over completion tokens
///   repetition:N:PENALTY  TRL's n-gram repetition penalty (PENALTY ≤ 0)
RewardFunction builtin_reward(const std::string& spec, const std::string& what = "reward_funcs");

}  // namespace zt
