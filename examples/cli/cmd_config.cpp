// zerotrain config: what a DeepSpeed config + training flags resolve to, without running.
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "zerotrain/config.hpp"

namespace zt::cli {
namespace {

// Takes `--name value` out of `args` when present.
std::optional<long> take_number(Args& args, const std::string& name) {
  std::optional<std::string> v = take_option(args, name);
  if (!v) return std::nullopt;
  return parse_integer(name, *v, 1, INT32_MAX);
}

}  // namespace

int cmd_config(const Args& in) {
  if (wants_help(in)) {
    std::fputs(
        "usage: zerotrain config [--world_size N] [--hidden_size H] [--total_steps S] [training "
        "flags]\n\n"
        "Parses the DeepSpeed config (--deepspeed) and the training flags of `zerotrain train` and "
        "prints what\n"
        "they resolve to for a job of N ranks, a model of hidden size H and S optimizer steps, as "
        "the\n"
        "trainer would resolve \"auto\" values, with the values still \"auto\" and every "
        "warning.\n",
        stdout);
    return 0;
  }
  Args args = in;
  ResolveContext ctx;
  ctx.world_size = static_cast<int>(take_number(args, "world_size").value_or(1));
  if (auto h = take_number(args, "hidden_size")) ctx.hidden_size = *h;
  if (auto t = take_number(args, "total_steps")) ctx.total_train_steps = *t;
  TrainingArguments targs;
  std::vector<std::string> rest = apply_training_flags(targs, args);
  if (!rest.empty()) throw ConfigError("zerotrain config: unexpected argument '" + rest[0] + "'");
  DeepSpeedConfig ds = deepspeed_config_for(targs);
  resolve_config(ds, targs, ctx);
  std::printf("%s\n", describe(ds).c_str());
  std::printf(
      "training: per_device_train_batch_size=%lld gradient_accumulation_steps=%lld "
      "learning_rate=%g max_grad_norm=%g fp16=%d bf16=%d seed=%lld output_dir=%s\n",
      static_cast<long long>(targs.per_device_train_batch_size),
      static_cast<long long>(targs.gradient_accumulation_steps), targs.learning_rate,
      targs.max_grad_norm, targs.fp16, targs.bf16, static_cast<long long>(targs.seed),
      targs.output_dir.c_str());
  for (const std::string& key : unresolved_keys(ds)) std::printf("still auto: %s\n", key.c_str());
  for (const std::string& w : ds.warnings) std::printf("warning: %s\n", w.c_str());
  for (const auto& [name, line] : targs.ignored) std::printf("warning: %s\n", line.c_str());
  return 0;
}

}  // namespace zt::cli
