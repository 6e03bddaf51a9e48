// The `zerotrain` program's subcommands. Each returns the process exit code; errors are thrown
// (main maps them to exit codes and one `error: ...` line).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/model.hpp"

namespace zt::cli {

using Args = std::vector<std::string>;

int cmd_train(const Args& args);   // zerotrain train [--options FILE.json] [--NAME VALUE ...]
int cmd_merge(const Args& args);   // zerotrain merge CHECKPOINT OUT [--dtype D] [--base_model DIR]
int cmd_verify(const Args& args);  // zerotrain verify MODEL_DIR --prompt "..." [...]
int cmd_generate(const Args& args);  // zerotrain generate MODEL_DIR --prompts FILE.jsonl [...]
int cmd_launch(const Args& args);    // zerotrain launch --nproc_per_node N [--] command...
int cmd_config(const Args& args);    // zerotrain config [training flags] [--world_size N] ...
int cmd_demo(const Args& args);      // zerotrain demo [--nproc_per_node N]

/// The training arguments of a `train` command line: --options FILE.json, then the flags.
TrainingArguments parse_training_command(const Args& args);

/// Takes `--name value` (or `--name=value`) out of `args`; nullopt when absent.
std::optional<std::string> take_option(Args& args, const std::string& name);

/// Takes every `--name` (a flag without a value) out of `args`; whether there was one.
bool take_switch(Args& args, const std::string& name);

/// The integer `text` given for `--flag`, in [min, max]; a ConfigError naming the flag and the
/// range otherwise (no trailing text, no overflow).
long parse_integer(const std::string& flag, const std::string& text, long min, long max);

/// argv[0] of this process, resolved (for re-launching itself).
std::string self_path();

/// Whether `args` asks for help (--help or -h): the command then prints `usage` to stdout and
/// exits 0.
bool wants_help(const Args& args);

/// The summed answer log-probabilities (chosen, rejected) of every pair of a preference dataset
/// (tokenize_preference_jsonl), in eval mode without gradients, `batch` pairs at a time.
std::vector<std::pair<double, double>> pair_log_probs(CausalLM& model, const Dataset& pairs,
                                                      int32_t pad_id, int64_t batch = 16);

}  // namespace zt::cli
