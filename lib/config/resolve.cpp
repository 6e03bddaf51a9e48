// "auto" resolution and reconciliation of a DeepSpeed config with the training arguments,
// following HF Trainer's DeepSpeed integration (REFERENCE §1).
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/config.hpp"

namespace zt {
namespace {

bool same(double a, double b) {
  return a == b || std::fabs(a - b) <= 1e-12 * std::fabs(b);
}
bool same(int64_t a, int64_t b) {
  return a == b;
}
bool same(bool a, bool b) {
  return a == b;
}

std::string shown(double v) {
  return fmt::format("{}", v);
}
std::string shown(int64_t v) {
  return fmt::format("{}", v);
}
std::string shown(bool v) {
  return v ? "true" : "false";
}

// Reconciles one DeepSpeed value with one training argument:
//   "auto"            → takes the argument's value;
//   written           → the argument adopts it, unless the argument was given explicitly with
//                       another value (an error naming both);
//   unset, `follow`   → behaves like "auto";
//   unset, !`follow`  → left alone (the caller applies DeepSpeed's own default).
template <typename T>
void reconcile(const DeepSpeedConfig& ds, Auto<T>& value, const char* ds_path, T& arg,
               const TrainingArguments& args, const char* arg_name, bool follow) {
  if (value.is_auto() || (value.is_unset() && follow)) {
    value.resolve(arg);
    return;
  }
  if (!value.is_set()) return;
  if (!same(value.value(), arg)) {
    if (args.is_given(arg_name)) {
      throw ConfigError(fmt::format(
          "{}: {} is {} but the training argument {} is {}; make them agree or write \"auto\"",
          ds.source, ds_path, shown(value.value()), arg_name, shown(arg)));
    }
    arg = value.value();
  }
}

int64_t exact_quotient(const DeepSpeedConfig& ds, int64_t total, int64_t divisor,
                       const std::string& what) {
  if (divisor <= 0 || total % divisor != 0) {
    throw ConfigError(fmt::format("{}: train_batch_size {} is not divisible by {} = {}", ds.source,
                                  total, what, divisor));
  }
  return total / divisor;
}

// A resumed run keeps the global batch it was saved with: at another world size the
// accumulation changes so that micro batch × accumulation × world stays the same, when it divides
// evenly (the given value yields: it was chosen for the saved world size).
void keep_saved_global_batch(DeepSpeedConfig& ds, TrainingArguments& args, int world,
                             const SavedBatch& saved) {
  if (saved.global_batch_size < 1 || saved.world_size < 1) {
    throw InvalidArgument(fmt::format(
        "ResolveContext::resumed: a saved global batch of {} at {} ranks; both must be at least 1",
        saved.global_batch_size, saved.world_size));
  }
  const int64_t micro = ds.train_micro_batch_size_per_gpu.is_set()
                            ? ds.train_micro_batch_size_per_gpu.value()
                            : args.per_device_train_batch_size;
  const int64_t per_step = micro * world;
  if (saved.world_size == world &&
      saved.global_batch_size == per_step * args.gradient_accumulation_steps) {
    return;
  }
  if (saved.global_batch_size % per_step != 0) {
    log::warn(
        "resuming at {} ranks: the saved global batch of {} is not a multiple of micro batch {} "
        "× {} ranks; continuing with a global batch of {}",
        world, saved.global_batch_size, micro, world, per_step * args.gradient_accumulation_steps);
    return;
  }
  const int64_t accum = saved.global_batch_size / per_step;
  if (accum != args.gradient_accumulation_steps) {
    log::info(
        "resuming at {} ranks (saved at {}): gradient_accumulation_steps {} keeps the global "
        "batch of {}",
        world, saved.world_size, accum, saved.global_batch_size);
  }
  args.gradient_accumulation_steps = accum;
  args.given.erase("gradient_accumulation_steps");
  if (ds.gradient_accumulation_steps.is_set()) ds.gradient_accumulation_steps.set(accum);
  if (ds.train_batch_size.is_set()) ds.train_batch_size.set(saved.global_batch_size);
}

void resolve_batch(DeepSpeedConfig& ds, TrainingArguments& args, int world) {
  auto& micro = ds.train_micro_batch_size_per_gpu;
  auto& accum = ds.gradient_accumulation_steps;
  auto& train = ds.train_batch_size;
  reconcile(ds, micro, "train_micro_batch_size_per_gpu", args.per_device_train_batch_size, args,
            "per_device_train_batch_size", false);
  reconcile(ds, accum, "gradient_accumulation_steps", args.gradient_accumulation_steps, args,
            "gradient_accumulation_steps", false);

  // What is still unset is derived from a written train_batch_size (DeepSpeed's rule), else
  // taken from the arguments.
  if (train.is_set()) {
    int64_t t = train.value();
    auto micro_from_accum = [&] {
      micro.resolve(exact_quotient(
          ds, t, accum.value() * world,
          fmt::format("gradient_accumulation_steps {} × world size {}", accum.value(), world)));
    };
    auto accum_from_micro = [&] {
      accum.resolve(
          exact_quotient(ds, t, micro.value() * world,
                         fmt::format("micro batch {} × world size {}", micro.value(), world)));
    };
    if (micro.is_unset() && accum.is_unset()) {
      // An explicit micro batch fixes the accumulation; otherwise the accumulation (default 1,
      // DeepSpeed's rule) fixes the micro batch.
      if (args.is_given("per_device_train_batch_size") &&
          !args.is_given("gradient_accumulation_steps")) {
        micro.resolve(args.per_device_train_batch_size);
        accum_from_micro();
      } else {
        accum.resolve(args.gradient_accumulation_steps);
        micro_from_accum();
      }
    } else if (micro.is_unset()) {
      micro_from_accum();
    } else if (accum.is_unset()) {
      accum_from_micro();
    }
  } else {
    if (micro.is_unset()) micro.resolve(args.per_device_train_batch_size);
    if (accum.is_unset()) accum.resolve(args.gradient_accumulation_steps);
  }

  // Derived values must not contradict explicitly given arguments either.
  for (auto [value, arg_name, arg] :
       {std::tuple{micro.value(), "per_device_train_batch_size", &args.per_device_train_batch_size},
        std::tuple{accum.value(), "gradient_accumulation_steps",
                   &args.gradient_accumulation_steps}}) {
    if (value != *arg && args.is_given(arg_name)) {
      throw ConfigError(fmt::format(
          "{}: train_batch_size {} = micro batch × gradient_accumulation_steps × world size {} "
          "implies {} = {}, but it was given as {} (per_device_train_batch_size {}, "
          "gradient_accumulation_steps {}); make them agree or write \"auto\"",
          ds.source, train.value(), world, arg_name, value, *arg, args.per_device_train_batch_size,
          args.gradient_accumulation_steps));
    }
    *arg = value;
  }

  int64_t product = micro.value() * accum.value() * world;
  if (train.is_auto() || train.is_unset()) {
    train.resolve(product);
  } else if (train.value() != product) {
    throw ConfigError(fmt::format(
        "{}: train_batch_size {} != train_micro_batch_size_per_gpu {} × "
        "gradient_accumulation_steps {} × world size {} (= {}); fix one of them or write \"auto\"",
        ds.source, train.value(), micro.value(), accum.value(), world, product));
  }
}

void resolve_optimizer(DeepSpeedConfig& ds, TrainingArguments& args) {
  OptimizerConfig& o = ds.optimizer;
  bool follow = !o.present;  // the Trainer's own optimizer takes every value from the arguments
  if (!o.present) {
    o.type = args.optim == "sgd" ? OptimizerType::kSgd : OptimizerType::kAdamW;
    o.type_name = args.optim;
  }
  reconcile(ds, o.lr, "optimizer.params.lr", args.learning_rate, args, "learning_rate", follow);
  reconcile(ds, o.eps, "optimizer.params.eps", args.adam_epsilon, args, "adam_epsilon", follow);
  reconcile(ds, o.weight_decay, "optimizer.params.weight_decay", args.weight_decay, args,
            "weight_decay", follow);
  std::array<double, 2> betas{args.adam_beta1, args.adam_beta2};
  if (o.betas.is_auto() || (o.betas.is_unset() && follow)) {
    o.betas.resolve(betas);
  } else if (o.betas.is_set()) {
    Auto<double> b1, b2;
    b1.set(o.betas.value()[0]);
    b2.set(o.betas.value()[1]);
    reconcile(ds, b1, "optimizer.params.betas[0]", args.adam_beta1, args, "adam_beta1", false);
    reconcile(ds, b2, "optimizer.params.betas[1]", args.adam_beta2, args, "adam_beta2", false);
  }
}

void resolve_precision(DeepSpeedConfig& ds, TrainingArguments& args) {
  // An absent precision block follows the arguments, so `--bf16` works with any config.
  reconcile(ds, ds.fp16.enabled, "fp16.enabled", args.fp16, args, "fp16", true);
  reconcile(ds, ds.bf16.enabled, "bf16.enabled", args.bf16, args, "bf16", true);
  if (ds.fp16.enabled.value() && ds.bf16.enabled.value()) {
    throw ConfigError(fmt::format(
        "{}: fp16 and bf16 are both enabled (from the DeepSpeed config and the training "
        "arguments together); enable at most one",
        ds.source));
  }
}

void resolve_scheduler(DeepSpeedConfig& ds, TrainingArguments& args, const ResolveContext& ctx) {
  SchedulerConfig& s = ds.scheduler;
  if (!s.present) return;
  if (s.warmup_min_lr.is_auto())
    s.warmup_min_lr.resolve(args.warmup_min_lr_ratio * args.learning_rate);
  reconcile(ds, s.warmup_max_lr, "scheduler.params.warmup_max_lr", args.learning_rate, args,
            "learning_rate", false);
  if (ctx.total_train_steps) {
    int64_t warmup = warmup_steps_for(args, *ctx.total_train_steps);
    if (s.warmup_num_steps.is_auto()) s.warmup_num_steps.resolve(warmup);
    if (s.total_num_steps.is_auto()) s.total_num_steps.resolve(*ctx.total_train_steps);
  } else if (s.warmup_num_steps.is_auto() && args.warmup_ratio == 0.0 &&
             (args.warmup_steps == 0 || args.warmup_steps >= 1)) {
    s.warmup_num_steps.resolve(static_cast<int64_t>(args.warmup_steps));  // needs no run length
  }
  // warmup_steps as a fraction (transformers 5) is compared once the run length is known.
  std::optional<int64_t> asked;
  if (args.warmup_steps >= 1) asked = static_cast<int64_t>(args.warmup_steps);
  if (args.warmup_steps > 0 && args.warmup_steps < 1 && ctx.total_train_steps) {
    asked = warmup_steps_for(args, *ctx.total_train_steps);
  }
  if (s.warmup_num_steps.is_set() && args.is_given("warmup_steps") && asked &&
      s.warmup_num_steps.value() != *asked) {
    throw ConfigError(fmt::format(
        "{}: scheduler.params.warmup_num_steps is {} but the training argument warmup_steps is "
        "{}; make them agree or write \"auto\"",
        ds.source, s.warmup_num_steps.value(), args.warmup_steps));
  }
}

void resolve_buckets(DeepSpeedConfig& ds, const ResolveContext& ctx) {
  if (!ctx.hidden_size) return;
  int64_t h = *ctx.hidden_size;
  ZeroConfig& z = ds.zero;
  if (z.reduce_bucket_size.is_auto()) z.reduce_bucket_size.resolve(h * h);
  if (z.stage3_prefetch_bucket_size.is_auto()) {
    z.stage3_prefetch_bucket_size.resolve(static_cast<int64_t>(0.9 * static_cast<double>(h * h)));
  }
  if (z.stage3_param_persistence_threshold.is_auto()) {
    z.stage3_param_persistence_threshold.resolve(10 * h);
  }
}

}  // namespace

// ChatGLM-Finetuning's train.py writes these into the DeepSpeed config from its arguments,
// whatever the file says: as "auto" they are filled from the arguments here too.
void override_like_chatglm_finetuning(DeepSpeedConfig& ds) {
  ds.train_batch_size.set_auto();
  ds.train_micro_batch_size_per_gpu.set_auto();
  ds.gradient_accumulation_steps.set_auto();
  if (ds.optimizer.present) {
    ds.optimizer.lr.set_auto();
    ds.optimizer.betas.set_auto();
    ds.optimizer.eps.set_auto();
    ds.optimizer.weight_decay.set_auto();
  }
  if (ds.scheduler.present) {
    ds.scheduler.warmup_min_lr.set_auto();
    ds.scheduler.warmup_max_lr.set_auto();
    ds.scheduler.warmup_num_steps.set_auto();
    ds.scheduler.total_num_steps.set_auto();
  }
}

void resolve_config(DeepSpeedConfig& ds, TrainingArguments& args, const ResolveContext& ctx) {
  // train_type is set exactly when ChatGLM-Finetuning's flags are in use (training_args.cpp).
  if (!args.train_type.empty()) override_like_chatglm_finetuning(ds);
  if (ctx.world_size < 1) {
    throw ConfigError(fmt::format("world size must be at least 1, found {}", ctx.world_size));
  }
  if (ctx.resumed) keep_saved_global_batch(ds, args, ctx.world_size, *ctx.resumed);
  resolve_batch(ds, args, ctx.world_size);
  if (ds.gradient_clipping.is_unset() &&
      (ds.source == "<default>" || args.is_given("max_grad_norm"))) {
    // No DeepSpeed config (plain Trainer), or an explicit --max_grad_norm: the argument applies.
    // A DeepSpeed config that omits gradient_clipping otherwise means DeepSpeed's 0 (off).
    ds.gradient_clipping.resolve(args.max_grad_norm);
  }
  reconcile(ds, ds.gradient_clipping, "gradient_clipping", args.max_grad_norm, args,
            "max_grad_norm", false);
  args.max_grad_norm = ds.gradient_clipping.value();
  resolve_optimizer(ds, args);
  resolve_precision(ds, args);
  resolve_scheduler(ds, args, ctx);
  resolve_buckets(ds, ctx);
}

std::vector<std::string> unresolved_keys(const DeepSpeedConfig& ds) {
  std::vector<std::string> out;
  auto check = [&](bool is_auto, const char* path, const char* from) {
    if (is_auto) out.push_back(fmt::format("{} (resolved from {})", path, from));
  };
  check(ds.train_batch_size.is_auto(), "train_batch_size", "the batch arguments and world size");
  check(ds.train_micro_batch_size_per_gpu.is_auto(), "train_micro_batch_size_per_gpu",
        "per_device_train_batch_size");
  check(ds.gradient_accumulation_steps.is_auto(), "gradient_accumulation_steps",
        "gradient_accumulation_steps");
  check(ds.gradient_clipping.is_auto(), "gradient_clipping", "max_grad_norm");
  check(ds.optimizer.lr.is_auto(), "optimizer.params.lr", "learning_rate");
  check(ds.optimizer.betas.is_auto(), "optimizer.params.betas", "adam_beta1/adam_beta2");
  check(ds.optimizer.eps.is_auto(), "optimizer.params.eps", "adam_epsilon");
  check(ds.optimizer.weight_decay.is_auto(), "optimizer.params.weight_decay", "weight_decay");
  check(ds.fp16.enabled.is_auto(), "fp16.enabled", "fp16");
  check(ds.bf16.enabled.is_auto(), "bf16.enabled", "bf16");
  check(ds.scheduler.warmup_min_lr.is_auto(), "scheduler.params.warmup_min_lr", "0");
  check(ds.scheduler.warmup_max_lr.is_auto(), "scheduler.params.warmup_max_lr", "learning_rate");
  check(ds.scheduler.warmup_num_steps.is_auto(), "scheduler.params.warmup_num_steps",
        "warmup_steps/warmup_ratio and the run length");
  check(ds.scheduler.total_num_steps.is_auto(), "scheduler.params.total_num_steps",
        "the run length");
  check(ds.zero.reduce_bucket_size.is_auto(), "zero_optimization.reduce_bucket_size",
        "the model's hidden_size");
  check(ds.zero.stage3_prefetch_bucket_size.is_auto(),
        "zero_optimization.stage3_prefetch_bucket_size", "the model's hidden_size");
  check(ds.zero.stage3_param_persistence_threshold.is_auto(),
        "zero_optimization.stage3_param_persistence_threshold", "the model's hidden_size");
  return out;
}

void check_resolved(const DeepSpeedConfig& ds) {
  std::vector<std::string> keys = unresolved_keys(ds);
  if (keys.empty()) return;
  throw ConfigError(
      fmt::format("{}: values still \"auto\": {}; give the context they need or "
                  "write concrete values",
                  ds.source, fmt::join(keys, "; ")));
}

DeepSpeedConfig deepspeed_config_for(const TrainingArguments& args) {
  if (args.deepspeed.empty()) return DeepSpeedConfig{};
  if (args.deepspeed.front() == '{') return parse_deepspeed_config(args.deepspeed, "--deepspeed");
  return load_deepspeed_config(args.deepspeed);
}

}  // namespace zt
