// A human-readable summary of a (resolved) DeepSpeed config, for logs and `zerotrain config`.
#include <fmt/format.h>

#include "zerotrain/config.hpp"

namespace zt {
namespace {

template <typename T>
std::string show(const Auto<T>& v) {
  return v.is_auto() ? std::string("auto") : fmt::format("{}", v.value());
}

const char* offload_name(const OffloadConfig& o) {
  switch (o.device) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return o.pin_memory ? "cpu (pinned)" : "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

std::string precision(const DeepSpeedConfig& ds) {
  if (ds.bf16.enabled.is_auto() || ds.fp16.enabled.is_auto()) return "auto";
  if (ds.bf16.enabled.value()) return "bf16 (fp32 master weights)";
  if (!ds.fp16.enabled.value()) return "fp32";
  LossScalerParams s = ds.fp16.scaler();
  if (!s.dynamic) return fmt::format("fp16, static loss scale {}", s.initial_scale);
  return fmt::format("fp16, dynamic loss scale from {} (window {}, hysteresis {}{}, min {})",
                     s.initial_scale, s.scale_window, s.hysteresis,
                     s.consecutive_hysteresis ? ", consecutive" : "", s.min_scale);
}

std::string optimizer(const OptimizerConfig& o) {
  const char* kind = o.type == OptimizerType::kSgd    ? "SGD"
                     : o.type == OptimizerType::kAdam ? "Adam (L2 weight decay)"
                                                      : "AdamW";
  std::string betas = o.betas.is_auto() ? "auto"
                                        : fmt::format("({}, {})", o.betas.value()[0],
                                                      o.betas.value()[1]);
  return fmt::format("{}{} lr={} betas={} eps={} weight_decay={}", kind,
                     o.present ? "" : " (from the training arguments)", show(o.lr), betas,
                     show(o.eps), show(o.weight_decay));
}

std::string scheduler(const SchedulerConfig& s) {
  if (!s.present) return "from the training arguments (lr_scheduler_type)";
  switch (s.type) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
    case SchedulerType::kWarmupCosineLR:
      return fmt::format("{} warmup_min_lr={} warmup_max_lr={} warmup_num_steps={} "
                         "total_num_steps={} warmup_type={}",
                         s.type_name, show(s.warmup_min_lr), show(s.warmup_max_lr),
                         show(s.warmup_num_steps), show(s.total_num_steps),
                         s.warmup_type == WarmupType::kLog ? "log" : "linear");
    case SchedulerType::kOneCycle:
      return fmt::format("OneCycle cycle_min_lr={} cycle_max_lr={} first_step_size={}",
                         s.cycle_min_lr, s.cycle_max_lr, s.cycle_first_step_size);
    case SchedulerType::kLRRangeTest:
      return fmt::format("LRRangeTest min_lr={} step_size={} step_rate={}", s.lr_range_test_min_lr,
                         s.lr_range_test_step_size, s.lr_range_test_step_rate);
  }
  return "?";
}

}  // namespace

std::string describe(const DeepSpeedConfig& ds) {
  const ZeroConfig& z = ds.zero;
  std::string out;
  out += fmt::format("config: {}\n", ds.source);
  out += fmt::format("batch: train_batch_size={} micro={} accumulation={}\n",
                     show(ds.train_batch_size), show(ds.train_micro_batch_size_per_gpu),
                     show(ds.gradient_accumulation_steps));
  out += fmt::format(
      "zero: stage={} overlap_comm={} contiguous_gradients={} reduce_scatter={} "
      "reduce_bucket_size={} allgather_bucket_size={}\n",
      z.stage, z.overlap(), z.contiguous_gradients, z.reduce_scatter, show(z.reduce_bucket_size),
      z.allgather_bucket_size);
  if (z.stage == 3) {
    out += fmt::format(
        "zero3: prefetch_bucket_size={} param_persistence_threshold={} max_live_parameters={} "
        "max_reuse_distance={} gather_16bit_weights_on_model_save={}\n",
        show(z.stage3_prefetch_bucket_size), show(z.stage3_param_persistence_threshold),
        z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
        z.stage3_gather_16bit_weights_on_model_save);
  }
  out += fmt::format("offload: optimizer={} param={}\n", offload_name(z.offload_optimizer),
                     offload_name(z.offload_param));
  out += fmt::format("precision: {}\n", precision(ds));
  out += fmt::format("optimizer: {}\n", optimizer(ds.optimizer));
  out += fmt::format("scheduler: {}\n", scheduler(ds.scheduler));
  out += fmt::format("gradient_clipping={} prescale_gradients={} gradient_predivide_factor={}",
                     show(ds.gradient_clipping), ds.prescale_gradients,
                     ds.gradient_predivide_factor);
  return out;
}

}  // namespace zt
