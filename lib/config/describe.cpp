// A (resolved) DeepSpeed config described: a human-readable summary for logs and `zerotrain
// config`, and DeepSpeed JSON for the run's training_args.json.
#include <fmt/format.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "zerotrain/config.hpp"

namespace zt {
namespace {

template <typename T>
std::string show(const Auto<T>& v) {
  return v.is_auto() ? std::string("auto") : fmt::format("{}", v.value());
}

const char* offload_name(const OffloadConfig& o) {
  switch (o.device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return o.pin_memory ? "cpu (pinned)" : "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
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
  std::string betas =
      o.betas.is_auto() ? "auto" : fmt::format("({}, {})", o.betas.value()[0], o.betas.value()[1]);
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
      return fmt::format(
          "{} warmup_min_lr={} warmup_max_lr={} warmup_num_steps={} "
          "total_num_steps={} warmup_type={}",
          s.type_name, show(s.warmup_min_lr), show(s.warmup_max_lr), show(s.warmup_num_steps),
          show(s.total_num_steps), s.warmup_type == WarmupType::kLog ? "log" : "linear");
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
  if (z.mics_shard_size > 0) {
    out += fmt::format(
        "mics: shard_size={} (state sharded within groups of that many ranks, "
        "replicated across them)\n",
        z.mics_shard_size);
  }
  out += fmt::format("offload: optimizer={}{} param={}\n", offload_name(z.offload_optimizer),
                     z.offload_optimizer.enabled() && z.offload_optimizer.ratio != 1.0
                         ? fmt::format(" ratio={}", z.offload_optimizer.ratio)
                         : std::string(),
                     offload_name(z.offload_param));
  out += fmt::format("precision: {}\n", precision(ds));
  out += fmt::format("optimizer: {}\n", optimizer(ds.optimizer));
  out += fmt::format("scheduler: {}\n", scheduler(ds.scheduler));
  out +=
      fmt::format("gradient_clipping={} prescale_gradients={} gradient_predivide_factor={}",
                  show(ds.gradient_clipping), ds.prescale_gradients, ds.gradient_predivide_factor);
  return out;
}

namespace {

using JsonWriter = rapidjson::PrettyWriter<rapidjson::StringBuffer>;

// A value that may still be "auto" (resolution leaves none once the run's size is known).
template <typename T, typename Put>
void put_auto(JsonWriter& w, const char* key, const Auto<T>& v, Put put) {
  w.Key(key);
  if (v.is_auto()) {
    w.String("auto");
  } else {
    put(v.value());
  }
}

void put_offload(JsonWriter& w, const char* key, const OffloadConfig& o) {
  w.Key(key);
  w.StartObject();
  w.Key("device");
  w.String(o.device == OffloadDevice::kCpu    ? "cpu"
           : o.device == OffloadDevice::kNvme ? "nvme"
                                              : "none");
  w.Key("pin_memory");
  w.Bool(o.pin_memory);
  if (o.ratio != 1.0) {
    w.Key("ratio");
    w.Double(o.ratio);
  }
  if (o.device == OffloadDevice::kNvme) {
    w.Key("nvme_path");
    w.String(o.nvme_path.c_str());
    w.Key("buffer_count");
    w.Int64(o.buffer_count);
  }
  w.EndObject();
}

const char* scheduler_name(SchedulerType t) {
  switch (t) {
    case SchedulerType::kWarmupLR:
      return "WarmupLR";
    case SchedulerType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR:
      return "WarmupCosineLR";
    case SchedulerType::kOneCycle:
      return "OneCycle";
    case SchedulerType::kLRRangeTest:
      return "LRRangeTest";
  }
  return "WarmupLR";
}

}  // namespace

namespace {

// The fp16 and bf16 blocks.
void put_precision(JsonWriter& w, const DeepSpeedConfig& ds) {
  auto boolean = [&](bool v) { w.Bool(v); };
  w.Key("fp16");
  w.StartObject();
  put_auto(w, "enabled", ds.fp16.enabled, boolean);
  w.Key("auto_cast");
  w.Bool(ds.fp16.auto_cast);
  w.Key("loss_scale");
  w.Double(ds.fp16.loss_scale);
  if (ds.fp16.scaler_keys_given) {  // else DeepSpeed's class defaults apply: keep it so
    w.Key("initial_scale_power");
    w.Int64(ds.fp16.initial_scale_power);
    w.Key("loss_scale_window");
    w.Int64(ds.fp16.loss_scale_window);
    w.Key("hysteresis");
    w.Int64(ds.fp16.hysteresis);
    w.Key("consecutive_hysteresis");
    w.Bool(ds.fp16.consecutive_hysteresis);
    w.Key("min_loss_scale");
    w.Double(ds.fp16.min_loss_scale);
  }
  w.EndObject();
  w.Key("bf16");
  w.StartObject();
  put_auto(w, "enabled", ds.bf16.enabled, boolean);
  if (ds.bf16.master_weights_and_grads) {
    w.Key("bf16_master_weights_and_grads");
    w.Bool(true);
  }
  if (ds.bf16.optimizer_states) {
    w.Key("bf16_optimizer_states");
    w.Bool(true);
  }
  w.EndObject();
}

void put_optimizer(JsonWriter& w, const DeepSpeedConfig& ds) {
  auto number = [&](double v) { w.Double(v); };
  if (ds.optimizer.present) {
    const OptimizerConfig& o = ds.optimizer;
    w.Key("optimizer");
    w.StartObject();
    w.Key("type");
    w.String(o.type_name.c_str());
    w.Key("params");
    w.StartObject();
    put_auto(w, "lr", o.lr, number);
    put_auto(w, "betas", o.betas, [&](const std::array<double, 2>& b) {
      w.StartArray();
      w.Double(b[0]);
      w.Double(b[1]);
      w.EndArray();
    });
    put_auto(w, "eps", o.eps, number);
    put_auto(w, "weight_decay", o.weight_decay, number);
    if (o.type == OptimizerType::kSgd) {
      w.Key("momentum");
      w.Double(o.momentum);
    } else {
      w.Key("bias_correction");
      w.Bool(o.bias_correction);
    }
    w.EndObject();
    w.EndObject();
  }
}

void put_scheduler(JsonWriter& w, const DeepSpeedConfig& ds) {
  auto integer = [&](int64_t v) { w.Int64(v); };
  auto number = [&](double v) { w.Double(v); };
  if (ds.scheduler.present) {
    const SchedulerConfig& c = ds.scheduler;
    w.Key("scheduler");
    w.StartObject();
    w.Key("type");
    w.String(scheduler_name(c.type));
    w.Key("params");
    w.StartObject();
    if (c.type == SchedulerType::kOneCycle) {
      w.Key("cycle_min_lr");
      w.Double(c.cycle_min_lr);
      w.Key("cycle_max_lr");
      w.Double(c.cycle_max_lr);
      w.Key("decay_lr_rate");
      w.Double(c.decay_lr_rate);
      w.Key("cycle_first_step_size");
      w.Int64(c.cycle_first_step_size);
      w.Key("cycle_second_step_size");
      w.Int64(c.cycle_second_step_size.value_or(c.cycle_first_step_size));
      w.Key("cycle_first_stair_count");
      w.Int64(c.cycle_first_stair_count);
      w.Key("cycle_second_stair_count");
      w.Int64(c.cycle_second_stair_count.value_or(c.cycle_first_stair_count));
      w.Key("decay_step_size");
      w.Int64(c.decay_step_size);
    } else if (c.type == SchedulerType::kLRRangeTest) {
      w.Key("lr_range_test_min_lr");
      w.Double(c.lr_range_test_min_lr);
      w.Key("lr_range_test_step_size");
      w.Int64(c.lr_range_test_step_size);
      w.Key("lr_range_test_step_rate");
      w.Double(c.lr_range_test_step_rate);
      w.Key("lr_range_test_staircase");
      w.Bool(c.lr_range_test_staircase);
    } else {
      put_auto(w, "warmup_min_lr", c.warmup_min_lr, number);
      put_auto(w, "warmup_max_lr", c.warmup_max_lr, number);
      put_auto(w, "warmup_num_steps", c.warmup_num_steps, integer);
      if (c.type != SchedulerType::kWarmupLR)
        put_auto(w, "total_num_steps", c.total_num_steps, integer);
      w.Key("warmup_type");
      w.String(c.warmup_type == WarmupType::kLog ? "log" : "linear");
      if (c.type == SchedulerType::kWarmupCosineLR) {
        w.Key("warmup_min_ratio");
        w.Double(c.warmup_min_ratio);
        w.Key("cos_min_ratio");
        w.Double(c.cos_min_ratio);
      }
    }
    w.EndObject();
    w.EndObject();
  }
}

void put_zero(JsonWriter& w, const DeepSpeedConfig& ds) {
  auto integer = [&](int64_t v) { w.Int64(v); };
  const ZeroConfig& z = ds.zero;
  w.Key("zero_optimization");
  w.StartObject();
  w.Key("stage");
  w.Int(z.stage);
  w.Key("contiguous_gradients");
  w.Bool(z.contiguous_gradients);
  w.Key("reduce_scatter");
  w.Bool(z.reduce_scatter);
  put_auto(w, "reduce_bucket_size", z.reduce_bucket_size, integer);
  w.Key("allgather_bucket_size");
  w.Int64(z.allgather_bucket_size);
  w.Key("overlap_comm");
  w.Bool(z.overlap());
  put_offload(w, "offload_optimizer", z.offload_optimizer);
  put_offload(w, "offload_param", z.offload_param);
  w.Key("sub_group_size");
  w.Int64(z.sub_group_size);
  put_auto(w, "stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, integer);
  put_auto(w, "stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, integer);
  w.Key("stage3_max_live_parameters");
  w.Int64(z.stage3_max_live_parameters);
  w.Key("stage3_max_reuse_distance");
  w.Int64(z.stage3_max_reuse_distance);
  w.Key("stage3_gather_16bit_weights_on_model_save");
  w.Bool(z.stage3_gather_16bit_weights_on_model_save);
  w.Key("round_robin_gradients");
  w.Bool(z.round_robin_gradients);
  w.Key("ignore_unused_parameters");
  w.Bool(z.ignore_unused_parameters);
  w.EndObject();
}

}  // namespace

std::string deepspeed_config_json(const DeepSpeedConfig& ds) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf);
  w.SetIndent(' ', 2);
  auto integer = [&](int64_t v) { w.Int64(v); };
  auto number = [&](double v) { w.Double(v); };
  w.StartObject();
  put_auto(w, "train_batch_size", ds.train_batch_size, integer);
  put_auto(w, "train_micro_batch_size_per_gpu", ds.train_micro_batch_size_per_gpu, integer);
  put_auto(w, "gradient_accumulation_steps", ds.gradient_accumulation_steps, integer);
  put_auto(w, "gradient_clipping", ds.gradient_clipping, number);
  w.Key("steps_per_print");
  w.Int64(ds.steps_per_print);
  if (ds.sequence_parallel_size > 1) {
    w.Key("sequence_parallel_size");
    w.Int64(ds.sequence_parallel_size);
  }
  w.Key("wall_clock_breakdown");
  w.Bool(ds.wall_clock_breakdown);
  w.Key("prescale_gradients");
  w.Bool(ds.prescale_gradients);
  w.Key("gradient_predivide_factor");
  w.Double(ds.gradient_predivide_factor);
  if (ds.communication_data_type != CommDataType::kDefault) {
    w.Key("communication_data_type");
    w.String(ds.communication_data_type == CommDataType::kFp32   ? "fp32"
             : ds.communication_data_type == CommDataType::kFp16 ? "fp16"
                                                                 : "bf16");
  }
  put_precision(w, ds);
  put_optimizer(w, ds);
  put_scheduler(w, ds);
  put_zero(w, ds);
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize());
}

}  // namespace zt
