// resolve_settings: every decision the engine's parts branch on, from config, options and world.
#include "zero/settings.hpp"

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::zero {
namespace {

at::ScalarType wire_dtype(CommDataType c, at::ScalarType compute) {
  switch (c) {
    case CommDataType::kFp32:
      return at::kFloat;
    case CommDataType::kFp16:
      return at::kHalf;
    case CommDataType::kBf16:
      return at::kBFloat16;
    case CommDataType::kDefault:
      return compute;
  }
  return compute;
}

void resolve_precision(const DeepSpeedConfig& ds, EngineSettings& s) {
  s.fp16 = ds.fp16.enabled.value();
  s.bf16 = ds.bf16.enabled.value();
  // fp16 on CPU computes in fp32 (LibTorch 1.13 has no CPU half matmul) while the loss scaler
  // still runs, so the fp16 code path stays exercised.
  s.compute = s.bf16 ? at::kBFloat16 : s.fp16 ? at::kHalf : at::kFloat;
  if (s.fp16 && s.device.is_cpu()) {
    s.compute = at::kFloat;
    s.warnings.emplace_back(
        "fp16 on CPU: computing in fp32 (no CPU half matmul); the dynamic loss scaler still runs");
  }
  if (s.fp16) s.scaler = ds.fp16.scaler();
  if ((ds.bf16.master_weights_and_grads || ds.bf16.optimizer_states) && !s.bf16) {
    throw ConfigError(fmt::format(
        "{}: bf16.bf16_master_weights_and_grads / bf16_optimizer_states need bf16.enabled",
        ds.source));
  }
  if (ds.bf16.master_weights_and_grads) s.master_dtype = at::kBFloat16;
  s.state_dtype = s.bf16 && ds.bf16.optimizer_states ? at::kBFloat16 : at::kFloat;
  s.wire = wire_dtype(ds.communication_data_type, s.compute);
}

void resolve_optimizer(const DeepSpeedConfig& ds, EngineSettings& s) {
  s.optimizer = ds.optimizer.type;
  s.hyper.beta1 = ds.optimizer.betas.value()[0];
  s.hyper.beta2 = ds.optimizer.betas.value()[1];
  s.hyper.eps = ds.optimizer.eps.value();
  s.hyper.weight_decay = ds.optimizer.weight_decay.value();
  s.hyper.momentum = ds.optimizer.momentum;
  s.hyper.bias_correction = ds.optimizer.bias_correction;
  s.clip = ds.gradient_clipping.value();
}

// One rank needs no reduction or staging: the optimizer runs inside backward where that cannot
// change the math (masters in any dtype: the update reads autograd's gradient as it is), else
// it reads the gradients autograd accumulates straight into the accumulator (masters in the
// compute dtype) or copied up into it (fp32 masters).
GradientPath gradient_path(const EngineSettings& s, bool want_in_backward) {
  if (s.world == 1) {
    if (want_in_backward && update_in_backward_blocker(s).empty()) {
      return GradientPath::kInBackward;
    }
    if (s.master_dtype != s.compute) return GradientPath::kOneRank;
    return GradientPath::kInAccumulator;
  }
  if (s.stage == 0) return GradientPath::kAllReduce;
  if (s.stage == 1) return GradientPath::kFlatScatter;
  return GradientPath::kStaged;
}

}  // namespace

std::string update_in_backward_blocker(const EngineSettings& s) {
  if (s.world != 1) return "more than one rank (gradients must be reduced first)";
  if (s.offload_optimizer) return "optimizer offload";
  if (s.shard_units) return "ZeRO stage 3 with partitioned units";
  if (s.accumulation != 1) return "gradient accumulation";
  if (s.fp16) return "fp16 (an overflow skips the whole step)";
  if (s.clip > 0.0) return "gradient clipping (needs the global norm first)";
  return "";
}

EngineSettings resolve_settings(const DeepSpeedConfig& ds, const EngineOptions& options,
                                const EngineFacts& facts) {
  EngineSettings s;
  s.stage = ds.zero.stage;
  s.world = facts.world;
  s.rank = facts.rank;
  s.device = options.device;
  if (facts.device.type() != s.device.type()) {
    throw ConfigError(fmt::format("Engine: the communicator runs on {} but the model on {}",
                                  facts.device.str(), s.device.str()));
  }
  s.accumulation = static_cast<int>(ds.gradient_accumulation_steps.value());
  resolve_precision(ds, s);
  resolve_optimizer(ds, s);

  s.overlap = s.stage == 0 || ds.zero.overlap();
  s.use_reduce_scatter = ds.zero.reduce_scatter;
  const double w = static_cast<double>(s.world), f = ds.gradient_predivide_factor;
  s.pre_scale = ds.prescale_gradients ? 1.0 / w : 1.0 / f;
  s.post_scale = ds.prescale_gradients ? 1.0 : f / w;
  s.shard_group = s.world;
  if (const int64_t g = ds.zero.mics_shard_size; g > 0) {
    if (s.stage == 0) {
      s.warnings.emplace_back(fmt::format(
          "{}: zero_optimization.mics_shard_size {} has no effect at stage 0 (every rank keeps "
          "everything); use stage 1, 2 or 3",
          ds.source, g));
    } else if (g > s.world || s.world % g != 0) {
      throw ConfigError(fmt::format(
          "{}: zero_optimization.mics_shard_size: {} does not divide the {} ranks of the job; set "
          "a divisor of it (the ranks of one node, usually) or -1",
          ds.source, g, s.world));
    } else if (options.rank_local && g < s.world) {
      throw ConfigError(fmt::format(
          "{}: zero_optimization.mics_shard_size {} cannot be combined with expert parallelism "
          "yet; remove one of them",
          ds.source, g));
    } else {
      s.shard_group = static_cast<int>(g);
    }
  }
  if (const int64_t h = ds.zero.zero_hpz_partition_size; h > 1) {
    const std::string key = fmt::format("{}: zero_optimization.zero_hpz_partition_size", ds.source);
    if (s.stage != 3) {
      s.warnings.emplace_back(fmt::format(
          "{} {} has no effect below stage 3 (hpZ keeps a copy of stage 3's parameter shards)", key,
          h));
    } else if (h > s.world || s.world % h != 0) {
      throw ConfigError(
          fmt::format("{}: {} does not divide the {} ranks of the job; set a "
                      "divisor of it (the ranks of one node, usually) or 1",
                      key, h, s.world));
    } else if (s.shard_group < s.world) {
      throw ConfigError(
          fmt::format("{} {} cannot be combined with mics_shard_size {}: MiCS "
                      "already keeps every gather within its group; remove one",
                      key, h, s.shard_group));
    } else if (ds.zero.offload_param.enabled()) {
      throw ConfigError(fmt::format(
          "{} {} cannot be combined with offload_param: its copy of the parameters would take "
          "the GPU memory offloading frees; remove one",
          key, h));
    } else if (h < s.world) {  // at the world the secondary part would be the shard itself
      s.hpz_group = static_cast<int>(h);
    }
  }
  s.bucket_size = std::max<int64_t>(1, ds.zero.reduce_bucket_size.value());
  s.allgather_bucket_size = ds.zero.allgather_bucket_size;

  s.offload_optimizer = s.stage >= 1 && ds.zero.offload_optimizer.enabled();
  s.offload_param = s.stage == 3 && ds.zero.offload_param.enabled();
  if (s.offload_optimizer) s.offload_ratio = ds.zero.offload_optimizer.ratio;
  if (s.offload_optimizer && s.master_dtype != at::kFloat) {
    throw ConfigError(
        fmt::format("{}: bf16_master_weights_and_grads cannot be combined with "
                    "offload_optimizer (the CPU optimizer keeps fp32 masters)",
                    ds.source));
  }
  s.shard_units = s.stage == 3 && (s.world > 1 || s.offload_param);
  if (ds.zero.zero_quantized_weights) {
    if (!s.shard_units || s.world == 1) {
      s.warnings.emplace_back(fmt::format(
          "{}: zero_optimization.zero_quantized_weights has no effect: it quantizes stage 3's "
          "parameter gathers between ranks, and this run has none",
          ds.source));
    } else {
      s.quantized_weights = true;
    }
  }
  if (ds.zero.zero_quantized_gradients) {
    const std::string key =
        fmt::format("{}: zero_optimization.zero_quantized_gradients", ds.source);
    if (s.stage == 0 || s.world == 1) {
      s.warnings.emplace_back(fmt::format(
          "{} has no effect: it quantizes the gradients' reduce-scatter between ranks (stages "
          "1-3), and this run has none",
          key));
    } else if (ds.communication_data_type == CommDataType::kFp32) {
      throw ConfigError(
          fmt::format("{} contradicts communication_data_type \"fp32\": gradients "
                      "cannot travel both as fp32 and as int8; remove one",
                      key));
    } else if (!s.use_reduce_scatter) {
      throw ConfigError(
          fmt::format("{} needs reduce_scatter: it quantizes the reduce-scatter, "
                      "and reduce_scatter false asks for an all-reduce; remove one",
                      key));
    } else if (s.shard_group < s.world) {
      throw ConfigError(fmt::format("{} cannot be combined with mics_shard_size {} yet; remove one",
                                    key, s.shard_group));
    } else if (options.rank_local) {
      throw ConfigError(
          fmt::format("{} cannot be combined with expert parallelism yet; remove one", key));
    } else {
      s.quantized_gradients = true;
    }
  }
  s.layout_stage = s.stage == 3 && !s.shard_units ? 2 : s.stage;
  s.checkpointing = options.activation_checkpointing || s.shard_units;
  s.persistence_threshold = ds.zero.stage3_param_persistence_threshold.value();
  s.prefetch_elements = ds.zero.stage3_prefetch_bucket_size.value();
  s.max_live_elements = ds.zero.stage3_max_live_parameters;
  if (options.units_per_checkpoint < 1) {
    throw InvalidArgument(fmt::format(
        "EngineOptions::units_per_checkpoint (recompute_num_layers) must be at least 1, not {}",
        options.units_per_checkpoint));
  }
  if (options.units_per_checkpoint > 1 && !s.checkpointing) {
    s.warnings.emplace_back(
        fmt::format("recompute_num_layers {} has no effect: no layer is recomputed; turn on "
                    "gradient_checkpointing",
                    options.units_per_checkpoint));
  }
  if (options.offload_activations && !s.checkpointing) {
    s.warnings.emplace_back(
        "use_unsloth_gc (offload_activations) has no effect: no layer is recomputed; turn on "
        "gradient_checkpointing");
  }
  if (s.shard_units && options.units.empty()) {
    s.warnings.emplace_back(
        "ZeRO-3 without sharding units keeps every parameter whole on every rank (stage 2 "
        "memory); declare EngineOptions::units to partition parameters");
  }
  // bf16 masters on a rank that keeps whole buckets are the parameters themselves.
  s.master_aliases_params =
      s.master_dtype == s.compute && !s.offload_optimizer && (s.replicated() || s.world == 1);
  s.gradients = gradient_path(s, options.update_in_backward);
  return s;
}

double device_state_bytes(const EngineSettings& s, int64_t state_numel) {
  const double n = static_cast<double>(state_numel);
  const double moments =
      s.optimizer == OptimizerType::kSgd ? (s.hyper.momentum != 0.0 ? 1.0 : 0.0) : 2.0;
  // The device's share of masters and moments; offloaded masters are fp32 (resolve_settings).
  const double on_device = s.offload_optimizer ? 1.0 - s.offload_ratio : 1.0;
  const double master = s.offload_optimizer ? 4.0 : c10::elementSize(s.master_dtype);
  double bytes = s.in_backward() ? 0.0 : n * c10::elementSize(s.master_dtype);  // accumulator
  if (!s.master_aliases_params) bytes += on_device * n * master;
  bytes += on_device * n * moments * c10::elementSize(s.state_dtype);
  return bytes;
}

double host_state_bytes(const EngineSettings& s, int64_t state_numel) {
  const double n = static_cast<double>(state_numel);
  const double moments =
      s.optimizer == OptimizerType::kSgd ? (s.hyper.momentum != 0.0 ? 1.0 : 0.0) : 2.0;
  const double offloaded =
      s.offload_optimizer ? s.offload_ratio * n * (4.0 + moments * c10::elementSize(s.state_dtype))
                          : 0.0;
  return offloaded + (s.device.is_cpu() ? device_state_bytes(s, state_numel) : 0.0);
}

}  // namespace zt::zero
