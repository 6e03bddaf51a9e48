// DeepSpeed JSON → DeepSpeedConfig, with DeepSpeed's defaults and validation (REFERENCE §1).
#include <cmath>

#include <fmt/format.h>

#include "config/auto_read.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/config.hpp"

namespace zt {
namespace {

using json::ObjectReader;

// DeepSpeed's config sections are pydantic models that forbid extra keys: a misspelled key
// there is an error, not a warning followed by a run without the feature.
constexpr std::string_view kForbidden =
    "DeepSpeed refuses unknown keys in this section too: fix the spelling or remove it";

void reject_unknown(const ObjectReader& r) {
  r.reject_unknown(kForbidden);
}

// Top level: a key within two edits of a known one is a misspelling and an error; any other
// unknown key is someone else's (a launcher's, a comment) and only warned about.
void check_top_level(const ObjectReader& top, std::vector<std::string>& warnings) {
  for (const std::string& path : top.unknown_paths()) {
    const std::string near = top.nearest_known(path);
    if (!near.empty()) {
      throw ConfigError(fmt::format(
          "{}: {}: unknown key (did you mean '{}'?); as written it would be ignored and the "
          "run would go on without it: fix the spelling or remove it",
          top.source(), path, near));
    }
    warnings.push_back(fmt::format("{}: unknown key, ignored", path));
  }
}

OffloadConfig parse_offload(ObjectReader& r, const char* key, int64_t default_buffers,
                            std::vector<std::string>& warnings) {
  OffloadConfig out;
  out.buffer_count = default_buffers;
  std::optional<ObjectReader> o = r.object(key);
  if (!o) return out;
  if (auto d = o->choice("device", {"none", "cpu", "nvme", "auto"}, true)) {
    out.device = *d == "cpu"    ? OffloadDevice::kCpu
                 : *d == "nvme" ? OffloadDevice::kNvme
                                : OffloadDevice::kNone;
    if (*d == "auto") {  // ChatGLM-Finetuning's ds_zero2_no_offload.json writes it
      warnings.push_back(
          fmt::format("zero_optimization.{}.device: \"auto\" is read as \"none\" "
                      "(no offload); write \"cpu\" to offload",
                      key));
    }
  }
  if (auto v = o->boolean("pin_memory")) out.pin_memory = *v;
  if (auto v = o->string("nvme_path")) out.nvme_path = *v;
  if (auto v = o->integer("buffer_count", 1)) out.buffer_count = *v;
  if (std::string(key) == "offload_optimizer") {
    if (auto v = o->number("ratio", 0.0, 1.0)) out.ratio = *v;
  }
  o->known(
      {"buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write", "fast_init", "pipeline"});
  if (out.device == OffloadDevice::kNvme) {
    o->fail_value("device",
                  "NVMe offload is not built into zerotrain; use \"cpu\" (pinned host memory)");
  }
  reject_unknown(*o);
  return out;
}

ZeroConfig parse_zero(ObjectReader& top, std::vector<std::string>& warnings) {
  ZeroConfig z;
  std::optional<ObjectReader> r = top.object("zero_optimization");
  if (!r) return z;
  if (auto v = r->integer("stage", 0, 3)) z.stage = static_cast<int>(*v);
  if (auto v = r->boolean("contiguous_gradients")) z.contiguous_gradients = *v;
  if (auto v = r->boolean("reduce_scatter")) z.reduce_scatter = *v;
  config::read_auto_int(*r, "reduce_bucket_size", z.reduce_bucket_size, 1);
  if (auto v = r->integer("allgather_bucket_size", 1)) z.allgather_bucket_size = *v;
  if (auto v = r->boolean("overlap_comm")) z.overlap_comm = *v;
  z.offload_optimizer = parse_offload(*r, "offload_optimizer", 4, warnings);
  z.offload_param = parse_offload(*r, "offload_param", 5, warnings);
  // Deprecated spellings DeepSpeed still maps onto the offload blocks.
  if (auto v = r->boolean("cpu_offload"); v && *v) z.offload_optimizer.device = OffloadDevice::kCpu;
  if (auto v = r->boolean("cpu_offload_param"); v && *v)
    z.offload_param.device = OffloadDevice::kCpu;
  if (auto v = r->boolean("cpu_offload_use_pin_memory"); v && *v) {
    z.offload_optimizer.pin_memory = true;
    z.offload_param.pin_memory = true;
  }
  if (auto v = r->integer("sub_group_size", 1)) z.sub_group_size = *v;
  config::read_auto_int(*r, "stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, 0);
  config::read_auto_int(*r, "stage3_param_persistence_threshold",
                        z.stage3_param_persistence_threshold, 0);
  if (auto v = r->integer("stage3_max_live_parameters", 0)) z.stage3_max_live_parameters = *v;
  if (auto v = r->integer("stage3_max_reuse_distance", 0)) z.stage3_max_reuse_distance = *v;
  if (auto v = r->boolean("stage3_gather_16bit_weights_on_model_save")) {
    z.stage3_gather_16bit_weights_on_model_save = *v;
  }
  if (auto v = r->boolean("stage3_gather_fp16_weights_on_model_save")) {  // older spelling
    z.stage3_gather_16bit_weights_on_model_save = *v;
  }
  if (auto v = r->boolean("round_robin_gradients")) z.round_robin_gradients = *v;
  if (auto v = r->boolean("ignore_unused_parameters")) z.ignore_unused_parameters = *v;
  // Accepted; zerotrain's behaviour already matches what they ask for or they are moot here.
  r->known({"allgather_partitions", "load_from_fp32_weights", "elastic_checkpoint",
            "memory_efficient_linear", "stage3_model_persistence_threshold",
            "use_multi_rank_bucket_allreduce", "legacy_stage1", "log_trace_cache_warnings",
            "zeropp_loco_param", "pipeline_loading_checkpoint", "override_module_apply"});

  // MiCS / hybrid sharding (docs/engine.md). The group size must divide the world: checked
  // where the world is known (resolve_settings).
  if (auto v = r->integer("mics_shard_size", -1, 1 << 20)) z.mics_shard_size = *v == 0 ? -1 : *v;
  if (auto v = r->boolean("mics_hierarchical_params_gather")) {
    z.mics_hierarchical_params_gather = *v;
  }

  // ZeRO++: hpZ (checked against the world in resolve_settings), qwZ and qgZ (docs/engine.md).
  if (auto v = r->integer("zero_hpz_partition_size", 1, 1 << 20)) z.zero_hpz_partition_size = *v;
  if (auto v = r->boolean("zero_quantized_weights")) z.zero_quantized_weights = *v;
  if (auto v = r->boolean("zero_quantized_gradients")) z.zero_quantized_gradients = *v;
  if (auto v = r->boolean("zero_quantized_nontrainable_weights"); v && *v) {
    r->fail_value("zero_quantized_nontrainable_weights",
                  "quantizing only the frozen weights' gathers is not supported; "
                  "zero_quantized_weights quantizes every stage-3 weight gather, or set false");
  }

  if (z.offload_optimizer.enabled() && z.stage == 0) {
    r->fail_value("offload_optimizer.device",
                  "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)");
  }
  if (z.offload_param.enabled() && z.stage != 3) {
    r->fail_value("offload_param.device",
                  fmt::format("parameter offload needs ZeRO stage 3 (stage is {})", z.stage));
  }
  reject_unknown(*r);
  return z;
}

Fp16Config parse_fp16(ObjectReader& top) {
  Fp16Config f;
  std::optional<ObjectReader> r = top.object("fp16");
  if (!r) return f;
  config::read_auto_bool(*r, "enabled", f.enabled);
  if (auto v = r->boolean("auto_cast")) f.auto_cast = *v;
  if (auto v = r->number("loss_scale", 0.0)) f.loss_scale = *v;
  for (const char* k : {"initial_scale_power", "loss_scale_window", "hysteresis",
                        "consecutive_hysteresis", "min_loss_scale"}) {
    if (r->has(k)) f.scaler_keys_given = true;
  }
  if (auto v = r->integer("initial_scale_power", 0, 62)) f.initial_scale_power = *v;
  if (auto v = r->integer("loss_scale_window", 1)) f.loss_scale_window = *v;
  if (auto v = r->integer("hysteresis", 1)) f.hysteresis = *v;
  if (auto v = r->boolean("consecutive_hysteresis")) f.consecutive_hysteresis = *v;
  if (auto v = r->number("min_loss_scale", 1e-30)) f.min_loss_scale = *v;
  if (auto v = r->boolean("fp16_master_weights_and_grads"); v && *v) {
    r->fail_value("fp16_master_weights_and_grads",
                  "fp16 master weights are not supported; zerotrain keeps fp32 masters");
  }
  r->known({"type"});
  reject_unknown(*r);
  return f;
}

Bf16Config parse_bf16(ObjectReader& top) {
  Bf16Config b;
  // "bfloat16" is DeepSpeed's older spelling of the same block.
  const char* key = top.has("bf16") ? "bf16" : "bfloat16";
  top.known({"bf16", "bfloat16"});
  std::optional<ObjectReader> r = top.object(key);
  if (!r) return b;
  config::read_auto_bool(*r, "enabled", b.enabled);
  if (auto v = r->boolean("bf16_master_weights_and_grads")) b.master_weights_and_grads = *v;
  if (auto v = r->boolean("bf16_optimizer_states")) b.optimizer_states = *v;
  r->known({"immediate_grad_update", "check_grad_overflow"});
  reject_unknown(*r);
  return b;
}

OptimizerConfig parse_optimizer(ObjectReader& top) {
  OptimizerConfig o;
  std::optional<ObjectReader> r = top.object("optimizer");
  if (!r) return o;
  o.present = true;
  std::optional<std::string> type = r->string("type");
  if (!type) r->fail("type", "an optimizer name (Adam, AdamW or SGD)");
  std::string lower;
  for (char c : *type) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  o.type_name = *type;
  if (lower == "adamw") {
    o.type = OptimizerType::kAdamW;
  } else if (lower == "adam") {
    o.type = OptimizerType::kAdamW;  // DeepSpeed's Adam is AdamW unless adam_w_mode is false
  } else if (lower == "sgd") {
    o.type = OptimizerType::kSgd;
  } else {
    r->fail_value("type", fmt::format("optimizer \"{}\" is not supported by zerotrain; use "
                                      "\"Adam\", \"AdamW\" or \"SGD\"",
                                      *type));
  }
  std::optional<ObjectReader> p = r->object("params");
  if (p) {
    config::read_auto_number(*p, "lr", o.lr, 0.0);
    config::read_auto_number(*p, "eps", o.eps, 0.0);
    config::read_auto_number(*p, "weight_decay", o.weight_decay, 0.0);
    config::read_auto_betas(*p, "betas", o.betas);
    if (auto v = p->boolean("adam_w_mode")) {
      if (lower == "adam" && !*v) o.type = OptimizerType::kAdam;
    }
    if (auto v = p->boolean("bias_correction")) o.bias_correction = *v;
    if (auto v = p->boolean("amsgrad"); v && *v) {
      p->fail_value("amsgrad", "AMSGrad is not supported; remove it or set false");
    }
    if (auto v = p->number("momentum", 0.0, 1.0)) o.momentum = *v;
    if (auto v = p->boolean("nesterov"); v && *v) {
      p->fail_value("nesterov", "Nesterov momentum is not supported; remove it or set false");
    }
    if (auto v = p->number("dampening"); v && *v != 0.0) {
      p->fail_value("dampening", "SGD dampening is not supported; remove it or set 0");
    }
    p->known({"torch_adam", "fused", "foreach", "capturable", "maximize"});
    reject_unknown(*p);
  }
  reject_unknown(*r);
  return o;
}

SchedulerConfig parse_scheduler(ObjectReader& top, std::vector<std::string>& warnings) {
  SchedulerConfig s;
  std::optional<ObjectReader> r = top.object("scheduler");
  if (!r) return s;
  s.present = true;
  std::optional<std::string> type =
      r->choice("type", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"});
  if (!type) r->fail("type", "a scheduler name (WarmupLR, WarmupDecayLR, WarmupCosineLR, ...)");
  s.type_name = *type;
  s.type = *type == "WarmupLR"         ? SchedulerType::kWarmupLR
           : *type == "WarmupDecayLR"  ? SchedulerType::kWarmupDecayLR
           : *type == "WarmupCosineLR" ? SchedulerType::kWarmupCosineLR
           : *type == "OneCycle"       ? SchedulerType::kOneCycle
                                       : SchedulerType::kLRRangeTest;
  std::optional<ObjectReader> p = r->object("params");
  if (p) {
    switch (s.type) {
      case SchedulerType::kWarmupLR:
      case SchedulerType::kWarmupDecayLR:
      case SchedulerType::kWarmupCosineLR:
        config::read_auto_number(*p, "warmup_min_lr", s.warmup_min_lr, 0.0);
        config::read_auto_number(*p, "warmup_max_lr", s.warmup_max_lr, 0.0);
        config::read_auto_int(*p, "warmup_num_steps", s.warmup_num_steps, 0);
        if (s.type != SchedulerType::kWarmupLR) {
          config::read_auto_int(*p, "total_num_steps", s.total_num_steps, 1);
        }
        // DeepSpeed's WarmupLR takes any other name (ChatGLM-Finetuning's configs write
        // "cosine") as log, with a warning; so does zerotrain.
        if (auto v = p->string("warmup_type")) {
          s.warmup_type = *v == "linear" ? WarmupType::kLinear : WarmupType::kLog;
          if (*v != "log" && *v != "linear") {
            warnings.push_back(fmt::format(
                "scheduler.params.warmup_type: \"{}\" is not a warmup DeepSpeed knows (log, "
                "linear); like DeepSpeed, zerotrain warms up with log",
                *v));
          }
        }
        if (s.type == SchedulerType::kWarmupCosineLR) {
          if (auto v = p->number("warmup_min_ratio", 0.0, 1.0)) s.warmup_min_ratio = *v;
          if (auto v = p->number("cos_min_ratio", 0.0, 1.0)) s.cos_min_ratio = *v;
        }
        p->known({"last_batch_iteration"});
        break;
      case SchedulerType::kOneCycle:
        if (auto v = p->number("cycle_min_lr", 0.0)) s.cycle_min_lr = *v;
        if (auto v = p->number("cycle_max_lr", 0.0)) s.cycle_max_lr = *v;
        if (auto v = p->number("decay_lr_rate", 0.0)) s.decay_lr_rate = *v;
        if (auto v = p->integer("cycle_first_step_size", 1)) s.cycle_first_step_size = *v;
        if (auto v = p->integer("cycle_second_step_size", 1)) s.cycle_second_step_size = *v;
        if (auto v = p->integer("cycle_first_stair_count", 0)) s.cycle_first_stair_count = *v;
        if (auto v = p->integer("cycle_second_stair_count", 0)) s.cycle_second_stair_count = *v;
        if (auto v = p->integer("decay_step_size", 0)) s.decay_step_size = *v;
        if (auto v = p->boolean("cycle_momentum"); v && *v) {
          p->fail_value("cycle_momentum",
                        "momentum cycling is not supported; set \"cycle_momentum\": false");
        }
        p->known({"cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"});
        if (!p->has("cycle_momentum")) {
          p->fail_value("cycle_momentum",
                        "DeepSpeed's OneCycle cycles momentum by default, which zerotrain does not "
                        "support; add \"cycle_momentum\": false");
        }
        break;
      case SchedulerType::kLRRangeTest:
        if (auto v = p->number("lr_range_test_min_lr", 0.0)) s.lr_range_test_min_lr = *v;
        if (auto v = p->integer("lr_range_test_step_size", 1)) s.lr_range_test_step_size = *v;
        if (auto v = p->number("lr_range_test_step_rate", 0.0)) s.lr_range_test_step_rate = *v;
        if (auto v = p->boolean("lr_range_test_staircase")) s.lr_range_test_staircase = *v;
        p->known({"last_batch_iteration"});
        break;
    }
    reject_unknown(*p);
  } else if (s.type == SchedulerType::kOneCycle) {
    r->fail_value("params", "OneCycle needs params with at least \"cycle_momentum\": false");
  }
  reject_unknown(*r);
  return s;
}

// Blocks that switch on a DeepSpeed feature zerotrain lacks: enabled is an error.
void reject_enabled_features(ObjectReader& top) {
  for (const char* key :
       {"amp", "elasticity", "curriculum_learning", "data_efficiency", "compression_training",
        "torch_autocast", "nebula", "sparse_attention", "pipeline_parallelism"}) {
    const rapidjson::Value* v = top.find(key);
    if (v == nullptr) continue;
    bool enabled = true;
    if (v->IsObject()) {
      auto it = v->FindMember("enabled");
      enabled = it != v->MemberEnd() && it->value.IsBool() && it->value.GetBool();
    }
    if (enabled) {
      top.fail_value(key,
                     "this DeepSpeed feature is not supported by zerotrain; remove the block "
                     "or set \"enabled\": false");
    }
  }
}

}  // namespace

LossScalerParams Fp16Config::scaler() const {
  LossScalerParams p;
  if (loss_scale > 0.0) {
    p.dynamic = false;
    p.initial_scale = loss_scale;
    return p;
  }
  if (!scaler_keys_given) return p;  // DeepSpeed's class defaults: 2^32, hysteresis 1
  p.initial_scale = std::ldexp(1.0, static_cast<int>(initial_scale_power));
  p.scale_window = loss_scale_window;
  p.hysteresis = hysteresis;
  p.consecutive_hysteresis = consecutive_hysteresis;
  p.min_scale = min_loss_scale;
  return p;
}

DeepSpeedConfig parse_deepspeed_config(std::string_view text, const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  ObjectReader top(doc, "", source);
  DeepSpeedConfig ds;
  ds.source = source;
  config::read_auto_int(top, "train_batch_size", ds.train_batch_size, 1);
  config::read_auto_int(top, "train_micro_batch_size_per_gpu", ds.train_micro_batch_size_per_gpu,
                        1);
  config::read_auto_int(top, "gradient_accumulation_steps", ds.gradient_accumulation_steps, 1);
  config::read_auto_number(top, "gradient_clipping", ds.gradient_clipping, 0.0);
  if (auto v = top.integer("steps_per_print", 1)) ds.steps_per_print = *v;
  if (auto v = top.integer("sequence_parallel_size", 1, 1 << 20)) ds.sequence_parallel_size = *v;
  if (auto v = top.boolean("wall_clock_breakdown")) ds.wall_clock_breakdown = *v;
  if (auto v = top.boolean("prescale_gradients")) ds.prescale_gradients = *v;
  if (auto v = top.number("gradient_predivide_factor", 1e-12)) ds.gradient_predivide_factor = *v;
  if (auto v = top.choice("communication_data_type", {"fp32", "fp16", "bf16", "bfp16"})) {
    ds.communication_data_type = *v == "fp32"   ? CommDataType::kFp32
                                 : *v == "fp16" ? CommDataType::kFp16
                                                : CommDataType::kBf16;
  }
  ds.optimizer = parse_optimizer(top);
  ds.scheduler = parse_scheduler(top, ds.warnings);
  ds.zero = parse_zero(top, ds.warnings);
  ds.fp16 = parse_fp16(top);
  ds.bf16 = parse_bf16(top);
  reject_enabled_features(top);
  // Accepted without effect: zerotrain's optimizer is always its own sharded implementation.
  top.known({"zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown",
             "dump_state", "checkpoint", "aio", "data_types", "seed"});
  for (const char* key : {"tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler",
                          "activation_checkpointing", "monitor_config"}) {
    if (top.find(key) != nullptr) {
      ds.warnings.push_back(
          fmt::format("{}: not supported by zerotrain, ignored (activation checkpointing is the "
                      "gradient_checkpointing option; metrics go to the log)",
                      key));
    }
  }
  if (ds.fp16.enabled.is_set() && ds.fp16.enabled.value() && ds.bf16.enabled.is_set() &&
      ds.bf16.enabled.value()) {
    throw ConfigError(
        fmt::format("{}: fp16.enabled and bf16.enabled are both true; enable at most one", source));
  }
  check_top_level(top, ds.warnings);
  for (const std::string& w : ds.warnings) log::warn("{}: {}", source, w);
  return ds;
}

DeepSpeedConfig load_deepspeed_config(const std::string& path) {
  return parse_deepspeed_config(files::read_text(path, "DeepSpeed config"), path);
}

}  // namespace zt
