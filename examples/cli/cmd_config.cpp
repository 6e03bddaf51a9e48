// zerotrain config: what a DeepSpeed config + training flags resolve to, without running.
#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "zerotrain/config.hpp"

namespace zt::cli {
namespace {

// Takes `--name value` out of `args` when present.
std::optional<long> take_number(Args& args, const std::string& name) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] != "--" + name) continue;
    if (i + 1 >= args.size()) throw ConfigError("--" + name + " needs a value");
    char* end = nullptr;
    long v = std::strtol(args[i + 1].c_str(), &end, 10);
    if (*end != '\0' || v < 1) {
      throw ConfigError("--" + name + ": expected a positive integer, found \"" + args[i + 1] + "\"");
    }
    args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
    return v;
  }
  return std::nullopt;
}

}  // namespace

int cmd_config(const Args& in) {
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
  std::printf("training: per_device_train_batch_size=%lld gradient_accumulation_steps=%lld "
              "learning_rate=%g max_grad_norm=%g fp16=%d bf16=%d seed=%lld output_dir=%s\n",
              static_cast<long long>(targs.per_device_train_batch_size),
              static_cast<long long>(targs.gradient_accumulation_steps), targs.learning_rate,
              targs.max_grad_norm, targs.fp16, targs.bf16, static_cast<long long>(targs.seed),
              targs.output_dir.c_str());
  for (const std::string& key : unresolved_keys(ds)) std::printf("still auto: %s\n", key.c_str());
  for (const std::string& w : ds.warnings) std::printf("warning: %s\n", w.c_str());
  return 0;
}

}  // namespace zt::cli
