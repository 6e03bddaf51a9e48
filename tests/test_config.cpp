// DeepSpeed config parsing, training arguments and "auto" resolution (HF Trainer semantics).
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <variant>

#include <fmt/format.h>

#include "config/training_options.hpp"
#include "support/messages.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

using namespace zt;
using Catch::Contains;

namespace {

// Every key REFERENCE §1 lists, with non-default values, so a key that is not read shows up as
// a default in the assertions below.
const char* kFull = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 8,
  "gradient_clipping": 0.5,
  "steps_per_print": 7,
  "wall_clock_breakdown": true,
  "prescale_gradients": true,
  "gradient_predivide_factor": 2.0,
  "communication_data_type": "bf16",
  "optimizer": {"type": "AdamW",
                "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 3e-4, "warmup_num_steps": 50,
                           "total_num_steps": 1000, "warmup_type": "linear"}},
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": false,
    "reduce_scatter": false,
    "reduce_bucket_size": 2e8,
    "allgather_bucket_size": 3e8,
    "overlap_comm": false,
    "offload_optimizer": {"device": "cpu", "pin_memory": true, "buffer_count": 6, "ratio": 0.4},
    "offload_param": {"device": "cpu", "pin_memory": false},
    "sub_group_size": 1e8,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 2e9,
    "stage3_max_reuse_distance": 3e9,
    "stage3_gather_16bit_weights_on_model_save": true,
    "round_robin_gradients": true,
    "ignore_unused_parameters": false,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": false,
    "zero_quantized_gradients": false,
    "mics_shard_size": 4,
    "mics_hierarchical_params_gather": true
  },
  "fp16": {"enabled": true, "auto_cast": false, "loss_scale": 0, "initial_scale_power": 12,
           "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": true,
           "min_loss_scale": 0.25},
  "bf16": {"enabled": false}
})";

}  // namespace

TEST_CASE("every DeepSpeed key of REFERENCE §1 is parsed", "[config]") {
  DeepSpeedConfig ds = parse_deepspeed_config(kFull, "full.json");
  CHECK(ds.warnings.empty());
  CHECK(ds.train_batch_size.value() == 64);
  CHECK(ds.train_micro_batch_size_per_gpu.value() == 4);
  CHECK(ds.gradient_accumulation_steps.value() == 8);
  CHECK(ds.gradient_clipping.value() == 0.5);
  CHECK(ds.steps_per_print == 7);
  CHECK(ds.wall_clock_breakdown);
  CHECK(ds.prescale_gradients);
  CHECK(ds.gradient_predivide_factor == 2.0);
  CHECK(ds.communication_data_type == CommDataType::kBf16);

  CHECK(ds.optimizer.present);
  CHECK(ds.optimizer.type == OptimizerType::kAdamW);
  CHECK(ds.optimizer.lr.value() == Approx(3e-4));
  CHECK(ds.optimizer.betas.value()[0] == 0.8);
  CHECK(ds.optimizer.betas.value()[1] == 0.95);
  CHECK(ds.optimizer.eps.value() == 1e-6);
  CHECK(ds.optimizer.weight_decay.value() == 0.1);

  CHECK(ds.scheduler.present);
  CHECK(ds.scheduler.type == SchedulerType::kWarmupDecayLR);
  CHECK(ds.scheduler.warmup_min_lr.value() == 1e-6);
  CHECK(ds.scheduler.warmup_max_lr.value() == 3e-4);
  CHECK(ds.scheduler.warmup_num_steps.value() == 50);
  CHECK(ds.scheduler.total_num_steps.value() == 1000);
  CHECK(ds.scheduler.warmup_type == WarmupType::kLinear);

  const ZeroConfig& z = ds.zero;
  CHECK(z.stage == 3);
  CHECK_FALSE(z.contiguous_gradients);
  CHECK_FALSE(z.reduce_scatter);
  CHECK(z.reduce_bucket_size.value() == 200000000);
  CHECK(z.allgather_bucket_size == 300000000);
  CHECK(z.mics_shard_size == 4);
  CHECK(z.mics_hierarchical_params_gather);
  CHECK_FALSE(z.overlap());
  CHECK(z.offload_optimizer.device == OffloadDevice::kCpu);
  CHECK(z.offload_optimizer.pin_memory);
  CHECK(z.offload_optimizer.buffer_count == 6);
  CHECK(z.offload_optimizer.ratio == 0.4);
  CHECK(z.offload_param.ratio == 1.0);  // DeepSpeed's default: all of it offloaded
  CHECK(z.offload_param.device == OffloadDevice::kCpu);
  CHECK_FALSE(z.offload_param.pin_memory);
  CHECK(z.sub_group_size == 100000000);
  CHECK(z.stage3_prefetch_bucket_size.value() == 10000000);
  CHECK(z.stage3_param_persistence_threshold.value() == 10000);
  CHECK(z.stage3_max_live_parameters == 2000000000);
  CHECK(z.stage3_max_reuse_distance == 3000000000);
  CHECK(z.stage3_gather_16bit_weights_on_model_save);
  CHECK(z.round_robin_gradients);
  CHECK_FALSE(z.ignore_unused_parameters);

  CHECK(ds.fp16.enabled.value());
  LossScalerParams s = ds.fp16.scaler();
  CHECK(s.dynamic);
  CHECK(s.initial_scale == 4096.0);
  CHECK(s.scale_window == 500);
  CHECK(s.hysteresis == 3);
  CHECK(s.consecutive_hysteresis);
  CHECK(s.min_scale == 0.25);
  CHECK_FALSE(ds.bf16.enabled.value());
}

TEST_CASE("DeepSpeed defaults apply to keys left out", "[config]") {
  DeepSpeedConfig ds = parse_deepspeed_config("{}");
  CHECK(ds.zero.stage == 0);
  CHECK(ds.zero.contiguous_gradients);
  CHECK(ds.zero.reduce_scatter);
  CHECK(ds.zero.reduce_bucket_size.value() == 500000000);
  CHECK(ds.zero.allgather_bucket_size == 500000000);
  CHECK(ds.zero.stage3_prefetch_bucket_size.value() == 50000000);
  CHECK(ds.zero.stage3_param_persistence_threshold.value() == 100000);
  CHECK(ds.zero.stage3_max_live_parameters == 1000000000);
  CHECK(ds.zero.sub_group_size == 1000000000);
  CHECK_FALSE(ds.zero.stage3_gather_16bit_weights_on_model_save);
  CHECK(ds.steps_per_print == 10);
  CHECK(ds.gradient_predivide_factor == 1.0);
  CHECK_FALSE(ds.optimizer.present);
  CHECK_FALSE(ds.scheduler.present);
}

TEST_CASE("overlap_comm defaults to true at every stage; written false turns it off", "[config]") {
  for (int stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    const std::string zero = fmt::format(R"("stage": {})", stage);
    CHECK(parse_deepspeed_config(fmt::format(R"({{"zero_optimization": {{{}}}}})", zero))
              .zero.overlap());
    CHECK_FALSE(parse_deepspeed_config(
                    fmt::format(R"({{"zero_optimization": {{{}, "overlap_comm": false}}}})", zero))
                    .zero.overlap());
  }
}

TEST_CASE("fp16 without scaler keys uses DeepSpeed's class defaults (2^32, hysteresis 1)",
          "[config]") {
  LossScalerParams quirk = parse_deepspeed_config(R"({"fp16": {"enabled": true}})").fp16.scaler();
  CHECK(quirk.dynamic);
  CHECK(quirk.initial_scale == std::ldexp(1.0, 32));
  CHECK(quirk.hysteresis == 1);
  CHECK(quirk.scale_window == 1000);
  CHECK(quirk.min_scale == 1.0);

  // loss_scale 0 is not one of the five scaler keys: still the quirk.
  LossScalerParams zero =
      parse_deepspeed_config(R"({"fp16": {"enabled": true, "loss_scale": 0}})").fp16.scaler();
  CHECK(zero.initial_scale == std::ldexp(1.0, 32));

  // Any one scaler key switches to the config defaults: 2^16, hysteresis 2.
  LossScalerParams one =
      parse_deepspeed_config(R"({"fp16": {"enabled": true, "loss_scale_window": 1000}})")
          .fp16.scaler();
  CHECK(one.initial_scale == std::ldexp(1.0, 16));
  CHECK(one.hysteresis == 2);

  LossScalerParams fixed =
      parse_deepspeed_config(R"({"fp16": {"enabled": true, "loss_scale": 128}})").fp16.scaler();
  CHECK_FALSE(fixed.dynamic);
  CHECK(fixed.initial_scale == 128.0);
}

TEST_CASE("DeepSpeed's Adam is AdamW unless adam_w_mode is false, and SGD is accepted",
          "[config]") {
  CHECK(parse_deepspeed_config(R"({"optimizer": {"type": "Adam"}})").optimizer.type ==
        OptimizerType::kAdamW);
  CHECK(
      parse_deepspeed_config(R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}}})")
          .optimizer.type == OptimizerType::kAdam);
  CHECK(parse_deepspeed_config(
            R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})")
            .optimizer.type == OptimizerType::kAdamW);
  DeepSpeedConfig sgd = parse_deepspeed_config(
      R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})");
  CHECK(sgd.optimizer.type == OptimizerType::kSgd);
  CHECK(sgd.optimizer.momentum == 0.9);
}

TEST_CASE("all five DeepSpeed schedulers parse with their parameters", "[config]") {
  DeepSpeedConfig cos = parse_deepspeed_config(R"({"scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
                 "cos_min_ratio": 0.01}}})");
  CHECK(cos.scheduler.type == SchedulerType::kWarmupCosineLR);
  CHECK(cos.scheduler.warmup_min_ratio == 0.1);
  CHECK(cos.scheduler.cos_min_ratio == 0.01);
  CHECK(cos.scheduler.warmup_type == WarmupType::kLog);
  DeepSpeedConfig one = parse_deepspeed_config(R"({"scheduler": {"type": "OneCycle", "params": {
      "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 100,
      "cycle_second_step_size": 50, "decay_lr_rate": 0.5, "decay_step_size": 10,
      "cycle_momentum": false}}})");
  CHECK(one.scheduler.type == SchedulerType::kOneCycle);
  CHECK(one.scheduler.cycle_max_lr == 0.01);
  CHECK(*one.scheduler.cycle_second_step_size == 50);
  CHECK(one.scheduler.decay_step_size == 10);
  DeepSpeedConfig range = parse_deepspeed_config(R"({"scheduler": {"type": "LRRangeTest",
      "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 20,
                 "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": true}}})");
  CHECK(range.scheduler.type == SchedulerType::kLRRangeTest);
  CHECK(range.scheduler.lr_range_test_staircase);
  CHECK(range.scheduler.lr_range_test_step_size == 20);
  DeepSpeedConfig warm = parse_deepspeed_config(
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})");
  CHECK(warm.scheduler.type == SchedulerType::kWarmupLR);
  CHECK(warm.scheduler.warmup_num_steps.value() == 5);
}

TEST_CASE("older spellings: bfloat16 block, cpu_offload, gather_fp16", "[config]") {
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"bfloat16": {"enabled": true},
      "zero_optimization": {"stage": 2, "cpu_offload": true,
                            "stage3_gather_fp16_weights_on_model_save": true}})");
  CHECK(ds.bf16.enabled.value());
  CHECK(ds.zero.offload_optimizer.device == OffloadDevice::kCpu);
  CHECK(ds.zero.stage3_gather_16bit_weights_on_model_save);
}

TEST_CASE("an unknown key inside a DeepSpeed section is an error naming it and the nearest key",
          "[config][errors]") {
  // DeepSpeed's sections forbid extra keys; every section zerotrain reads does too.
  struct Row {
    const char* json;
    const char* path;
    const char* nearest;  // "" when nothing is near
  };
  const std::vector<Row> rows{
      {R"({"zero_optimization": {"stage": 1, "stagee": 2}})", "zero_optimization.stagee", "stage"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimzer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimzer", "offload_optimizer"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pinmemory": true}}})",
       "zero_optimization.offload_optimizer.pinmemory", "pin_memory"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}})",
       "zero_optimization.offload_param.devise", "device"},
      {R"({"fp16": {"enabled": false, "loss_scael": 1}})", "fp16.loss_scael", "loss_scale"},
      {R"({"bf16": {"enabeld": true}})", "bf16.enabeld", "enabled"},
      {R"({"optimizer": {"type": "AdamW", "parms": {"lr": 1e-4}}})", "optimizer.parms", "params"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decy": 0.1}}})",
       "optimizer.params.weight_decy", "weight_decay"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})",
       "scheduler.params.warmup_num_step", "warmup_num_steps"},
      {R"({"zero_optimization": {"stage": 1, "something_else_entirely": 2}})",
       "zero_optimization.something_else_entirely", ""},
  };
  for (const Row& row : rows) {
    INFO(row.json);
    try {
      parse_deepspeed_config(row.json, "ds.json");
      FAIL("accepted");
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK_THAT(msg, Contains(std::string("ds.json: ") + row.path + ": unknown key"));
      if (*row.nearest) {
        CHECK_THAT(msg, Contains(std::string("did you mean '") + row.nearest + "'"));
      } else {
        CHECK_THAT(msg, !Contains("did you mean"));
      }
    }
  }
}

TEST_CASE("an unknown top-level DeepSpeed key near a known one is an error, others are warnings",
          "[config][errors]") {
  for (const char* misspelled :
       {"zero_optimisation", "gradient_clipings", "train_batch_sizee", "bf17", "optimiser"}) {
    INFO(misspelled);
    try {
      parse_deepspeed_config(fmt::format(R"({{"{}": {{}}}})", misspelled), "ds.json");
      FAIL("accepted");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(),
                 Contains(fmt::format("ds.json: {}: unknown key (did you mean", misspelled)));
    }
  }
  DeepSpeedConfig ds = parse_deepspeed_config(
      R"({"zero_optimization": {"stage": 1}, "my_extra": 1, "tensorboard": {"enabled": true}})");
  auto has = [&](const std::string& s) {
    for (const std::string& w : ds.warnings) {
      if (w.find(s) != std::string::npos) return true;
    }
    return false;
  };
  CHECK(ds.warnings.size() == 2);
  CHECK(has("my_extra: unknown key, ignored"));
  CHECK(has("tensorboard"));
}

TEST_CASE("a DeepSpeed config file is read from disk", "[config]") {
  std::string dir = test::temp_dir("cfg");
  std::string path = dir + "/ds.json";
  std::ofstream(path) << R"({"zero_optimization": {"stage": 2}})";
  CHECK(load_deepspeed_config(path).zero.stage == 2);
  CHECK(load_deepspeed_config(path).source == path);
  TrainingArguments args;
  args.deepspeed = path;
  CHECK(deepspeed_config_for(args).zero.stage == 2);
  args.deepspeed = R"({"zero_optimization": {"stage": 1}})";
  CHECK(deepspeed_config_for(args).zero.stage == 1);
  args.deepspeed.clear();
  CHECK(deepspeed_config_for(args).source == "<default>");
}

// ---- training arguments ----------------------------------------------------------------------

TEST_CASE("training flags: HF names, booleans, --local_rank, positional", "[config][args]") {
  TrainingArguments a;
  std::vector<std::string> rest = apply_training_flags(a, {"train",
                                                           "--per_device_train_batch_size",
                                                           "4",
                                                           "--learning_rate=2e-5",
                                                           "--bf16",
                                                           "--gradient_checkpointing",
                                                           "True",
                                                           "--fp16",
                                                           "false",
                                                           "--local_rank",
                                                           "3",
                                                           "--max-steps",
                                                           "100",
                                                           "--save_total_limit",
                                                           "2",
                                                           "--lr_scheduler_type",
                                                           "cosine",
                                                           "--local-rank=1",
                                                           "--output_dir",
                                                           "/tmp/x",
                                                           "extra"});
  CHECK(rest == std::vector<std::string>({"train", "extra"}));
  CHECK(a.per_device_train_batch_size == 4);
  CHECK(a.learning_rate == 2e-5);
  CHECK(a.bf16);
  CHECK_FALSE(a.fp16);
  CHECK(a.gradient_checkpointing);
  CHECK(a.max_steps == 100);
  CHECK(*a.save_total_limit == 2);
  CHECK(a.lr_scheduler_type == "cosine");
  CHECK(a.output_dir == "/tmp/x");
  CHECK(a.is_given("learning_rate"));
  CHECK(a.is_given("max_steps"));
  CHECK_FALSE(a.is_given("weight_decay"));
  CHECK_FALSE(a.is_given("local_rank"));
}

TEST_CASE("training JSON uses the same names and parser", "[config][args]") {
  TrainingArguments a;
  apply_training_json(a, R"({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
      "fp16": "True", "weight_decay": 0.01, "save_total_limit": null, "seed": 7,
      "deepspeed": {"zero_optimization": {"stage": 2}}})");
  CHECK(a.per_device_train_batch_size == 2);
  CHECK(a.gradient_accumulation_steps == 4);
  CHECK(a.fp16);
  CHECK(a.weight_decay == 0.01);
  CHECK_FALSE(a.save_total_limit.has_value());
  CHECK(a.seed == 7);
  CHECK(deepspeed_config_for(a).zero.stage == 2);
}

TEST_CASE("HF TrainingArguments defaults", "[config][args]") {
  TrainingArguments a;
  CHECK(a.per_device_train_batch_size == 8);
  CHECK(a.learning_rate == 5e-5);
  CHECK(a.adam_beta2 == 0.999);
  CHECK(a.adam_epsilon == 1e-8);
  CHECK(a.max_grad_norm == 1.0);
  CHECK(a.num_train_epochs == 3.0);
  CHECK(a.max_steps == -1);
  CHECK(a.lr_scheduler_type == "linear");
  CHECK(a.seed == 42);
  CHECK(a.logging_steps == 500);
  CHECK(a.ddp_timeout == 1800);
}

// ---- "auto" resolution ------------------------------------------------------------------------

const char* kAllAuto = R"({
  "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                            "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
      "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
})";

namespace {

// Resolves micro batch `micro` × accumulation 4 at `world` ranks for a run resumed from one saved
// with a global batch of 16 at 2 ranks.
std::pair<DeepSpeedConfig, TrainingArguments> resume_saved_16_at(int64_t micro, int world) {
  std::pair<DeepSpeedConfig, TrainingArguments> r{parse_deepspeed_config(kAllAuto, "auto.json"),
                                                  TrainingArguments{}};
  apply_training_flags(r.second, {"--per_device_train_batch_size", std::to_string(micro),
                                  "--gradient_accumulation_steps", "4"});
  resolve_config(r.first, r.second,
                 ResolveContext{world, std::nullopt, std::nullopt, SavedBatch{16, 2}});
  return r;
}

}  // namespace

TEST_CASE("a resumed run keeps its saved global batch through the accumulation, decided in resolve",
          "[config][auto]") {
  for (const std::pair<int, int>& c : {std::pair{1, 8}, std::pair{4, 2}, std::pair{8, 1}}) {
    const int world = c.first, want = c.second;
    INFO("world " << world);
    test::LogCapture log;
    const auto [ds, a] = resume_saved_16_at(2, world);
    CHECK(a.gradient_accumulation_steps == want);
    CHECK(ds.gradient_accumulation_steps.value() == want);
    CHECK(ds.train_batch_size.value() == 16);
    CHECK(log.contains(
        fmt::format("gradient_accumulation_steps {} keeps the global batch of 16", want)));
  }
  {
    // The same world and batch: nothing to change, nothing said.
    test::LogCapture log;
    const auto [ds, a] = resume_saved_16_at(2, 2);
    CHECK(a.gradient_accumulation_steps == 4);
    CHECK_FALSE(log.contains("resuming"));
  }
  {
    // Not a multiple of micro × world: the run goes on with its own global batch, and says so.
    test::LogCapture log;
    const auto [ds, a] = resume_saved_16_at(3, 2);
    CHECK(a.gradient_accumulation_steps == 4);
    CHECK(ds.train_batch_size.value() == 24);
    CHECK(log.contains("the saved global batch of 16 is not a multiple of micro batch 3"));
  }
  // A saved batch no run writes (a host's own value) is refused, not divided by.
  DeepSpeedConfig ds = parse_deepspeed_config(kAllAuto, "auto.json");
  TrainingArguments a;
  CHECK_THROWS_AS(
      resolve_config(ds, a, ResolveContext{2, std::nullopt, std::nullopt, SavedBatch{0, 2}}),
      InvalidArgument);
}

TEST_CASE("auto values resolve from the arguments, the world size and the model",
          "[config][auto]") {
  DeepSpeedConfig ds = parse_deepspeed_config(kAllAuto, "auto.json");
  TrainingArguments a;
  apply_training_flags(a, {"--per_device_train_batch_size", "3", "--gradient_accumulation_steps",
                           "5", "--learning_rate", "1e-4", "--adam_beta1", "0.85", "--weight_decay",
                           "0.02", "--max_grad_norm", "0.7", "--bf16", "--warmup_ratio", "0.1"});
  resolve_config(ds, a, ResolveContext{4, std::nullopt, std::nullopt});
  CHECK(ds.train_micro_batch_size_per_gpu.value() == 3);
  CHECK(ds.gradient_accumulation_steps.value() == 5);
  CHECK(ds.train_batch_size.value() == 3 * 5 * 4);
  CHECK(ds.gradient_clipping.value() == 0.7);
  CHECK(ds.optimizer.lr.value() == 1e-4);
  CHECK(ds.optimizer.betas.value()[0] == 0.85);
  CHECK(ds.optimizer.betas.value()[1] == 0.999);
  CHECK(ds.optimizer.eps.value() == 1e-8);
  CHECK(ds.optimizer.weight_decay.value() == 0.02);
  CHECK(ds.bf16.enabled.value());
  CHECK_FALSE(ds.fp16.enabled.value());
  CHECK(ds.scheduler.warmup_min_lr.value() == 0.0);
  CHECK(ds.scheduler.warmup_max_lr.value() == 1e-4);
  // Still unknown: the model (bucket sizes) and the run length (schedule).
  std::vector<std::string> left = unresolved_keys(ds);
  CHECK(left.size() == 5);
  CHECK_THROWS_WITH(check_resolved(ds), Catch::Contains("zero_optimization.reduce_bucket_size") &&
                                            Catch::Contains("scheduler.params.total_num_steps"));

  resolve_config(ds, a, ResolveContext{4, 3584, 1000});
  CHECK(ds.zero.reduce_bucket_size.value() == 3584 * 3584);
  const int64_t prefetch = static_cast<int64_t>(0.9 * 3584.0 * 3584.0);
  CHECK(ds.zero.stage3_prefetch_bucket_size.value() == prefetch);
  CHECK(ds.zero.stage3_param_persistence_threshold.value() == 35840);
  CHECK(ds.scheduler.total_num_steps.value() == 1000);
  CHECK(ds.scheduler.warmup_num_steps.value() == 100);  // ceil(0.1 × 1000)
  CHECK_NOTHROW(check_resolved(ds));
}

TEST_CASE("a written DeepSpeed value wins over a defaulted argument", "[config][auto]") {
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3, "gradient_clipping": 0.3,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
      "bf16": {"enabled": true}})");
  TrainingArguments a;
  resolve_config(ds, a, ResolveContext{2, std::nullopt, std::nullopt});
  CHECK(a.per_device_train_batch_size == 2);
  CHECK(a.gradient_accumulation_steps == 3);
  CHECK(ds.train_batch_size.value() == 12);
  CHECK(a.max_grad_norm == 0.3);
  CHECK(a.learning_rate == 1e-3);
  CHECK(a.weight_decay == 0.1);
  CHECK(a.bf16);
}

TEST_CASE("missing batch sizes follow DeepSpeed's derivation from train_batch_size",
          "[config][auto]") {
  SECTION("only train_batch_size: accumulation 1, micro = train / world") {
    DeepSpeedConfig ds = parse_deepspeed_config(R"({"train_batch_size": 32})");
    TrainingArguments a;
    resolve_config(ds, a, ResolveContext{2, std::nullopt, std::nullopt});
    CHECK(ds.gradient_accumulation_steps.value() == 1);
    CHECK(ds.train_micro_batch_size_per_gpu.value() == 16);
    CHECK(a.per_device_train_batch_size == 16);
  }
  SECTION("train and micro: accumulation derived") {
    DeepSpeedConfig ds =
        parse_deepspeed_config(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2})");
    TrainingArguments a;
    resolve_config(ds, a, ResolveContext{2, std::nullopt, std::nullopt});
    CHECK(ds.gradient_accumulation_steps.value() == 8);
    CHECK(a.gradient_accumulation_steps == 8);
  }
  SECTION("train with an explicit micro batch argument") {
    DeepSpeedConfig ds = parse_deepspeed_config(R"({"train_batch_size": 24})");
    TrainingArguments a;
    apply_training_flags(a, {"--per_device_train_batch_size", "3"});
    resolve_config(ds, a, ResolveContext{2, std::nullopt, std::nullopt});
    CHECK(ds.gradient_accumulation_steps.value() == 4);
  }
}

TEST_CASE("no DeepSpeed config: plain data parallel with the Trainer's defaults",
          "[config][auto]") {
  DeepSpeedConfig ds;  // as deepspeed_config_for() returns without --deepspeed
  TrainingArguments a;
  resolve_config(ds, a, ResolveContext{2, 64, 100});
  CHECK(ds.zero.stage == 0);
  CHECK(ds.train_batch_size.value() == 16);
  CHECK(ds.gradient_clipping.value() == 1.0);  // HF clips at max_grad_norm
  CHECK(ds.optimizer.type == OptimizerType::kAdamW);
  CHECK(ds.optimizer.lr.value() == 5e-5);
  CHECK_FALSE(ds.fp16.enabled.value());
  CHECK_NOTHROW(check_resolved(ds));
}

TEST_CASE("a DeepSpeed config without gradient_clipping means no clipping unless asked",
          "[config][auto]") {
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"zero_optimization": {"stage": 1}})", "x.json");
  TrainingArguments a;
  resolve_config(ds, a, ResolveContext{});
  CHECK(ds.gradient_clipping.value() == 0.0);
  DeepSpeedConfig ds2 = parse_deepspeed_config(R"({"zero_optimization": {"stage": 1}})", "x.json");
  TrainingArguments b;
  apply_training_flags(b, {"--max_grad_norm", "2.5"});
  resolve_config(ds2, b, ResolveContext{});
  CHECK(ds2.gradient_clipping.value() == 2.5);
}

TEST_CASE("describe() shows the resolved settings", "[config]") {
  DeepSpeedConfig ds = parse_deepspeed_config(kFull, "full.json");
  std::string text = describe(ds);
  CHECK_THAT(text, Catch::Contains("stage=3"));
  CHECK_THAT(text, Catch::Contains("fp16, dynamic loss scale from 4096"));
  CHECK_THAT(text, Catch::Contains("WarmupDecayLR"));
  CHECK_THAT(text, Catch::Contains("mics: shard_size=4"));
}

// ---- HF TrainingArguments compatibility ---------------------------------------------------------

namespace {

rapidjson::Document hf_fields() {
  const std::string path = std::string(ZT_DATA) + "/hf_training_arguments.json";
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  rapidjson::Document doc;
  doc.Parse(text.c_str());
  REQUIRE(doc.IsObject());
  REQUIRE(doc.HasMember("fields"));
  return doc;
}

}  // namespace

TEST_CASE("every TrainingArguments field of transformers 4.40-5.x is accepted with its default",
          "[config][args][hf]") {
  rapidjson::Document doc = hf_fields();
  const auto& fields = doc["fields"];
  REQUIRE(fields.Size() > 100);
  size_t new_defaults = 0;
  for (const auto& f : fields.GetArray()) {
    const std::string name = f["name"].GetString();
    if (name == "local_rank" || name == "deepspeed")
      continue;  // launcher-given / covered elsewhere
    // The 4.x default, and 5.x's where it changed (optim adamw_torch_fused, report_to "none", ...).
    for (const char* key : {"default", "default_5x"}) {
      if (!f.HasMember(key)) continue;
      new_defaults += std::string(key) == "default_5x";
      INFO(name << " = " << zt::json::dump(f[key]));
      rapidjson::Document one(rapidjson::kObjectType);
      one.AddMember(rapidjson::Value(name.c_str(), one.GetAllocator()),
                    rapidjson::Value(f[key], one.GetAllocator()), one.GetAllocator());
      TrainingArguments a;
      CHECK_NOTHROW(apply_training_json(a, zt::json::dump(one), "hf"));
      // Either an option of zerotrain's or one it records as without effect.
      const auto names = training_option_names();
      const bool ours = std::find(names.begin(), names.end(), name) != names.end();
      CHECK((ours || a.ignored.count(name) == 1));
      if (!ours) CHECK_THAT(a.ignored[name], Catch::Contains(name + " has no effect in zerotrain"));
    }
  }
  CHECK(new_defaults >= 4);
}

TEST_CASE("HF flags without effect warn once; values zerotrain cannot honour are errors",
          "[config][args][hf]") {
  TrainingArguments a;
  apply_training_flags(a, {"--dataloader_num_workers",
                           "8",
                           "--torch_compile",
                           "--save_safetensors",
                           "True",
                           "--remove_unused_columns",
                           "false",
                           "--ddp_find_unused_parameters",
                           "False",
                           "--dataloader_pin_memory",
                           "--push_to_hub",
                           "False",
                           "--report_to",
                           "tensorboard",
                           "wandb",
                           "--label_names",
                           "labels",
                           "other",
                           "--output_dir",
                           "/tmp/o"});
  for (const char* name :
       {"dataloader_num_workers", "torch_compile", "save_safetensors", "remove_unused_columns",
        "ddp_find_unused_parameters", "dataloader_pin_memory", "push_to_hub", "label_names"}) {
    INFO(name);
    REQUIRE(a.ignored.count(name) == 1);
  }
  CHECK(a.ignored.count("report_to wandb") == 1);
  CHECK(a.report_to == "tensorboard");
  CHECK(a.output_dir == "/tmp/o");  // list values stop at the next option
  auto refused = [](std::vector<std::string> flags) {
    TrainingArguments b;
    apply_training_flags(b, flags);
  };

  CHECK_THROWS_WITH(refused({"--label_smoothing_factor", "0.1"}),
                    Contains("label_smoothing_factor") && Contains("cannot honour"));
  CHECK_THROWS_WITH(refused({"--fsdp", "full_shard", "auto_wrap"}),
                    Contains("fsdp") && Contains("DeepSpeed"));
  CHECK_THROWS_WITH(refused({"--push_to_hub"}), Contains("push_to_hub"));
  CHECK_THROWS_WITH(refused({"--neftune_noise_alpha", "5"}), Contains("neftune_noise_alpha"));
  CHECK_THROWS_WITH(refused({"--report_to", "tensorbored"}),
                    Contains("tensorbored") && Contains("tensorboard"));
  CHECK_NOTHROW(
      refused({"--label_smoothing_factor", "0.0", "--fsdp", "", "--neftune_noise_alpha", "None"}));
  // JSON: the same table.
  TrainingArguments j;
  apply_training_json(j,
                      R"({"dataloader_num_workers": 2, "fsdp": [], "report_to": ["tensorboard"]})");
  CHECK(j.ignored.count("dataloader_num_workers") == 1);
  CHECK(j.report_to == "tensorboard");
  CHECK_THROWS_WITH(apply_training_json(j, R"({"adafactor": true})"), Contains("adafactor"));
}

TEST_CASE("HF spellings zerotrain acts on: aliases, torch_dtype, use_cpu, bad booleans",
          "[config][args][hf]") {
  TrainingArguments a;
  apply_training_flags(
      a, {"--model_max_length", "77", "--per_gpu_train_batch_size", "3", "--torch_dtype",
          "bfloat16", "--use_cpu", "--tf32", "False", "--logging_strategy", "epoch"});
  CHECK(a.max_length == 77);
  CHECK(a.per_device_train_batch_size == 3);
  CHECK(a.bf16);
  CHECK(a.device == "cpu");
  CHECK(a.tf32 == std::optional<bool>(false));
  CHECK(a.logging_strategy == "epoch");
  auto fails = [](std::vector<std::string> flags) {
    TrainingArguments b;
    apply_training_flags(b, flags);
  };
  CHECK_THROWS_WITH(fails({"--torch_dtype", "float16", "--bf16", "True"}),
                    Contains("torch_dtype float16") && Contains("bf16"));
  CHECK_THROWS_WITH(fails({"--bf16", "Ture"}),
                    Contains("bf16") && Contains("Ture") && Contains("True, False"));
  CHECK_THROWS_WITH(fails({"--no_cuda", "--device", "cuda"}), Contains("use_cpu"));
  TrainingArguments c;
  apply_training_flags(c, {"--torch_dtype", "float16"});
  CHECK(c.fp16);
  CHECK_FALSE(c.bf16);
}

TEST_CASE(
    "step intervals: whole steps, or below 1 fractions of the run; transformers 5's sampler names",
    "[config][args][hf]") {
  TrainingArguments a;
  apply_training_flags(
      a, {"--logging_steps", "0.1", "--save_steps", "200", "--eval_steps", "0.05", "--warmup_steps",
          "0.03", "--train_sampling_strategy", "group_by_length"});
  CHECK(a.logging_steps == 0.1);
  CHECK(a.eval_steps == std::optional<double>(0.05));
  CHECK(a.group_by_length);
  CHECK(steps_for(a.logging_steps, 95) == 10);  // ceil(9.5)
  CHECK(steps_for(a.save_steps, 95) == 200);
  CHECK(steps_for(0.001, 10) == 1);  // never 0
  CHECK(warmup_steps_for(a, 100) == 3);
  auto fails = [](std::vector<std::string> flags) {
    TrainingArguments b;
    apply_training_flags(b, flags);
  };
  CHECK_THROWS_WITH(fails({"--logging_steps", "2.5"}),
                    Contains("logging_steps") && Contains("whole number"));
  CHECK_THROWS_WITH(fails({"--save_steps", "0"}), Contains("save_steps") && Contains("> 0"));
  CHECK_THROWS_WITH(fails({"--warmup_steps", "-1"}), Contains("warmup_steps"));
  CHECK_THROWS_WITH(fails({"--train_sampling_strategy", "batch_rebalance"}),
                    Contains("train_sampling_strategy") && Contains("sequential"));
  CHECK_THROWS_WITH(fails({"--group_by_length", "--train_sampling_strategy", "sequential"}),
                    Contains("group_by_length") && Contains("sequential"));
  // load_best_model_at_end: both intervals steps or both fractions, saving a multiple of
  // evaluating.
  const std::vector<std::string> best{"--load_best_model_at_end", "--eval_strategy", "steps",
                                      "--save_strategy", "steps"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), best.begin(), best.end());
    return extra;
  };
  CHECK_NOTHROW(fails(with({"--eval_steps", "0.1", "--save_steps", "0.2"})));
  CHECK_THROWS_WITH(fails(with({"--eval_steps", "0.1", "--save_steps", "200"})), Contains("both"));
  CHECK_THROWS_WITH(fails(with({"--eval_steps", "0.2", "--save_steps", "0.3"})),
                    Contains("multiple"));
  // A fractional warmup meets DeepSpeed's written warmup_num_steps once the run length is known.
  TrainingArguments w;
  apply_training_flags(w, {"--warmup_steps", "0.1"});
  DeepSpeedConfig ds = parse_deepspeed_config(
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": "auto"}}})");
  CHECK_NOTHROW(resolve_config(ds, w, ResolveContext{1, 64, 50}));
  DeepSpeedConfig ds2 = parse_deepspeed_config(
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": "auto"}}})");
  CHECK_THROWS_WITH(resolve_config(ds2, w, ResolveContext{1, 64, 80}),
                    Contains("warmup_num_steps is 5"));
}

namespace {

// Two different values option `o` takes, as command-line text ({} when none can be made).
std::vector<std::string> two_values(const config::Option& o) {
  return std::visit(
      [&](auto m) -> std::vector<std::string> {
        using V = std::decay_t<decltype(TrainingArguments().*m)>;
        if constexpr (std::is_same_v<V, bool> || std::is_same_v<V, std::optional<bool>>) {
          return {"true", "false"};
        } else if constexpr (std::is_same_v<V, std::string>) {
          if (o.choices.size() >= 2) return {o.choices[0], o.choices[1]};
          if (!o.choices.empty()) return {};
          return {"x1", "x2"};
        } else {
          std::vector<std::string> out;
          for (double v : {o.range.min + 1, o.range.min + 2, 1.0, 2.0, 0.25, 0.5}) {
            const std::string text = fmt::format("{}", v);
            if (o.range.contains(v) && std::find(out.begin(), out.end(), text) == out.end())
              out.push_back(text);
            if (out.size() == 2) break;
          }
          return out.size() == 2 ? out : std::vector<std::string>{};
        }
      },
      o.member);
}

}  // namespace

TEST_CASE("two names of one option given different values are refused, naming both",
          "[config][aliases]") {
  // Every alias pair of the option table (--beta and --pref_beta, --lora_rank and --lora_r,
  // ChatGLM-Finetuning's --lora_dim, ...): given the same value they agree; different values
  // are a ConfigError naming both, on the command line and in one options file. A later
  // source (flags after a file) still overrides, and one name given twice keeps the last.
  int pairs = 0;
  for (const config::Option& a : config::options()) {
    for (const config::Option& b : config::options()) {
      if (&a == &b || !(a.member == b.member) || std::string(a.name) > std::string(b.name))
        continue;
      const std::vector<std::string> va = two_values(a), vb = two_values(b);
      if (va.empty() || vb.empty() || va != vb) continue;
      INFO("--" << a.name << " / --" << b.name);
      TrainingArguments one, other;
      try {
        apply_training_flags(one, {std::string("--") + a.name, va[0]});
        apply_training_flags(other, {std::string("--") + b.name, va[1]});
      } catch (const ConfigError&) {
        continue;  // a value the rest of the arguments refuse alone
      }
      TrainingArguments same;
      CHECK_NOTHROW(apply_training_flags(
          same, {std::string("--") + a.name, va[0], std::string("--") + b.name, va[0]}));
      TrainingArguments both;
      CHECK_THROWS_WITH(apply_training_flags(both, {std::string("--") + a.name, va[0],
                                                    std::string("--") + b.name, va[1]}),
                        Contains(std::string("--") + a.name) &&
                            Contains(std::string("--") + b.name) && Contains("give one of them"));
      ++pairs;
    }
  }
  CHECK(pairs >= 10);
  TrainingArguments file;
  CHECK_THROWS_WITH(apply_training_json(file, R"({"beta": 0.2, "pref_beta": 0.3})", "opts.json"),
                    Contains("opts.json") && Contains("beta 0.2") && Contains("pref_beta 0.3"));
  TrainingArguments layered;
  apply_training_json(layered, R"({"pref_beta": 0.3})", "opts.json");
  apply_training_flags(layered, {"--beta", "0.2", "--beta", "0.25"});
  CHECK(layered.pref_beta == 0.25);
}

// ---- LLaMA-Factory's configs and datasets ------------------------------------------------------

namespace {

std::string llamafactory_fixture(const std::string& name) {
  return std::string(ZT_FIXTURES) + "/llamafactory/" + name;
}

// The message of the ConfigError that applying `yaml` throws ("" when it applies).
std::string yaml_error(const std::string& yaml) {
  TrainingArguments a;
  try {
    apply_training_yaml(a, yaml, "cfg.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// A copy of the fixtures' data folder, and arguments that read it into `dir`/out.
TrainingArguments dataset_args(const std::string& dir, const std::string& stage,
                               const std::string& dataset) {
  std::filesystem::copy(
      llamafactory_fixture("data"), dir + "/data",
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::skip_existing);
  TrainingArguments a;
  a.dataset_dir = dir + "/data";
  a.output_dir = dir + "/out";
  a.stage = stage;
  a.dataset = dataset;
  return a;
}

std::vector<std::string> jsonl_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The message of the error prepare_datasets throws for `a` ("" when it succeeds).
std::string prepare_error(TrainingArguments a) {
  try {
    prepare_datasets(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("LLaMA-Factory's YAML configs read into the options, overridden by the line",
          "[config][args][llamafactory]") {
  TrainingArguments a;
  apply_training_file(a, llamafactory_fixture("qwen3_lora_sft.yaml"));
  CHECK(a.model_name_or_path == "Qwen/Qwen3-4B-Instruct-2507");
  CHECK(a.stage == "sft");
  CHECK(a.finetuning_type == "lora");
  CHECK(a.lora_r == 8);
  CHECK(a.lora_target_modules == "all");  // LLaMA-Factory's: its list of linear layers' names
  CHECK(a.dataset == "identity,alpaca_en_demo");
  CHECK(a.dataset_dir == "data");
  CHECK(a.template_name == "chatml");  // qwen3_nothink: ChatML without a default system
  CHECK(a.max_length == 2048);         // cutoff_len
  CHECK(a.max_samples == 1000);
  CHECK(a.output_dir == "saves/qwen3-4b/lora/sft");
  CHECK(a.logging_steps == 10);
  CHECK(a.overwrite_output_dir);
  CHECK(a.report_to == "none");
  CHECK(a.per_device_train_batch_size == 1);
  CHECK(a.gradient_accumulation_steps == 8);
  CHECK(a.learning_rate == 1e-4);
  CHECK(a.num_train_epochs == 3.0);
  CHECK(a.lr_scheduler_type == "cosine");
  CHECK(a.warmup_ratio == 0.1);
  CHECK(a.bf16);
  CHECK(a.ddp_timeout == 180000000);
  CHECK(a.resume_from_checkpoint.empty());  // null: the default
  // What zerotrain has no use for is said once each, never silently dropped.
  for (const char* name : {"trust_remote_code", "preprocessing_num_workers", "plot_loss",
                           "dataloader_num_workers", "save_only_model"}) {
    INFO(name);
    CHECK(a.ignored.count(name) == 1);
  }
  CHECK_THAT(a.ignored["plot_loss"], Contains("loss.svg"));
  // The line overrides the file: --NAME VALUE (and the CLI's NAME=VALUE, as --NAME=VALUE).
  apply_training_flags(a, {"--learning_rate", "2e-4", "--template=alpaca", "--cutoff_len", "512"});
  CHECK(a.learning_rate == 2e-4);
  CHECK(a.template_name == "alpaca");
  CHECK(a.max_length == 512);

  TrainingArguments older;
  apply_training_file(older, llamafactory_fixture("llama3_lora_sft.yaml"));
  CHECK(older.template_name == "llama3");
  CHECK(older.ignored.count("overwrite_cache") == 1);
  TrainingArguments qlora;
  apply_training_file(qlora, llamafactory_fixture("qwen3_lora_sft_otfq.yaml"));
  CHECK(qlora.quantization_bit == 4);
  CHECK(qlora.ignored.count("quantization_method") == 1);
  TrainingArguments full;
  apply_training_file(full, llamafactory_fixture("qwen3_full_sft.yaml"));
  CHECK(full.finetuning_type == "full");
  CHECK(full.deepspeed == "examples/deepspeed/ds_z3_config.json");
  TrainingArguments dpo, kto;
  apply_training_file(dpo, llamafactory_fixture("qwen3_lora_dpo.yaml"));
  apply_training_file(kto, llamafactory_fixture("qwen3_lora_kto.yaml"));
  CHECK((dpo.stage == "dpo" && dpo.pref_beta == 0.1 && dpo.pref_loss == "sigmoid"));
  CHECK((kto.stage == "kto" && kto.dataset == "kto_en_demo"));

  // YAML's scalars as LLaMA-Factory (PyYAML + OmegaConf) reads them; lists and mappings as JSON.
  TrainingArguments s;
  apply_training_yaml(s,
                      "learning_rate: 1e-4   # OmegaConf: a float without a point\n"
                      "seed: 7\nbf16: True\nfp16: no\nrun_name: '10'\n"
                      "report_to: [tensorboard]\n"
                      "deepspeed: {zero_optimization: {stage: 2}}\n"
                      "eval_steps: .5\n",
                      "s.yaml");
  CHECK(s.learning_rate == 1e-4);
  CHECK(s.seed == 7);
  CHECK((s.bf16 && !s.fp16));
  CHECK(s.run_name == "10");
  CHECK(s.report_to == "tensorboard");
  CHECK(s.deepspeed == R"({"zero_optimization":{"stage":2}})");
  CHECK(s.eval_steps == 0.5);
  TrainingArguments empty;
  CHECK_NOTHROW(apply_training_yaml(empty, "# nothing but a comment\n", "e.yaml"));
}

TEST_CASE("hostile or malformed YAML options are ConfigErrors naming the file and where",
          "[config][args][llamafactory][errors]") {
  // Nesting: past zerotrain's JSON limit, and past yaml-cpp's own parser limit.
  CHECK_THAT(yaml_error("a: " + std::string(300, '[') + std::string(300, ']')),
             Contains("cfg.yaml:1:") && Contains("deeper than 256"));
  CHECK_THAT(yaml_error("a: " + std::string(20000, '[') + std::string(20000, ']')),
             Contains("cfg.yaml:1:") && Contains("nested deeper"));
  std::string indented;
  for (int i = 0; i < 3000; ++i) indented += std::string(static_cast<size_t>(i), ' ') + "k:\n";
  CHECK_THAT(yaml_error(indented), Contains("cfg.yaml:") && Contains("nested deeper"));
  // An alias bomb: nine levels of nine aliases, 9^9 values once expanded.
  std::string bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n";
  for (char c = 'b'; c <= 'i'; ++c) {
    bomb += fmt::format("{0}: &{0} [*{1}, *{1}, *{1}, *{1}, *{1}, *{1}, *{1}, *{1}, *{1}]\n", c,
                        static_cast<char>(c - 1));
  }
  CHECK_THAT(yaml_error(bomb), Contains("cfg.yaml:") && Contains("alias bomb"));
  // The top level is a mapping of options.
  CHECK_THAT(yaml_error("- learning_rate\n- 1e-4\n"),
             Contains("cfg.yaml: expected a YAML mapping of options") && Contains("an array"));
  CHECK_THAT(yaml_error("just text\n"), Contains("expected a YAML mapping of options"));
  // Malformed YAML, two documents, a key twice, a tag beyond the core schema, a complex key.
  CHECK_THAT(yaml_error("learning_rate: [1e-4,\n"),
             Contains("cfg.yaml:2:") && Contains("malformed"));
  CHECK_THAT(yaml_error("seed: 1\n---\nseed: 2\n"), Contains("cfg.yaml:2: a second YAML document"));
  CHECK_THAT(yaml_error("learning_rate: 1e-4\nseed: 1\nlearning_rate: 2e-4\n"),
             Contains("cfg.yaml:3:1: 'learning_rate' is given twice (first at line 1)"));
  CHECK_THAT(yaml_error("run_name: !!python/object/apply:os.system [ls]\n"),
             Contains("cfg.yaml:1:") && Contains("!!python/object/apply:os.system") &&
                 Contains("not supported"));
  CHECK_THAT(yaml_error("? [a, b]\n: 1\n"), Contains("cfg.yaml:1:") && Contains("option names"));
  // Found by fuzzing: yaml-cpp's LoadAll never returns on this; zerotrain reads one document.
  CHECK_THAT(yaml_error("&e$,"), Contains("cfg.yaml:"));
  // Wrong types and values: the file and the key.
  CHECK_THAT(yaml_error("learning_rate: [1]\n"),
             Contains("cfg.yaml: learning_rate: expected a number"));
  CHECK_THAT(yaml_error("num_train_epochs: three\n"),
             Contains("cfg.yaml: num_train_epochs") && Contains("\"three\""));
  CHECK_THAT(yaml_error("bf16: maybe\n"), Contains("cfg.yaml: bf16: expected true or false"));
  CHECK_THAT(yaml_error("lora_rank: 010\n"), Contains("cfg.yaml: lora_rank"));  // not octal 8
  CHECK_THAT(yaml_error("max_samples: 0\n"), Contains("cfg.yaml: max_samples"));
  CHECK_THAT(yaml_error("val_size: -0.1\n"), Contains("cfg.yaml: val_size"));
  CHECK_THAT(yaml_error("stage: pt\n"), Contains("cfg.yaml: stage") && Contains("sft, dpo, kto"));
  CHECK_THAT(yaml_error("lerning_rate: 1e-4\n"),
             Contains("cfg.yaml: lerning_rate: unknown option") && Contains("learning_rate"));
  CHECK_THAT(yaml_error("quantization_method: hqq\n"),
             Contains("cfg.yaml: quantization_method") && Contains("cannot honour"));
  CHECK_THAT(yaml_error("mix_strategy: interleave_under\n"), Contains("mix_strategy"));
  CHECK_THAT(yaml_error("cutoff_len: 512\nmax_length: 1024\n"), Contains("give one of them"));
}

TEST_CASE("dataset_info.json's formats, columns and tags become zerotrain's layouts",
          "[data][llamafactory]") {
  const std::string dir = zt::test::temp_dir("dataset_info");
  SECTION("alpaca with its own column names, ShareGPT and OpenAI tags, a folder") {
    TrainingArguments a = dataset_args(dir, "sft", "alpaca_renamed");
    prepare_datasets(a);
    CHECK(a.is_given("train_file"));
    CHECK(a.eval_file.empty());
    CHECK(
        jsonl_lines(a.train_file) ==
        std::vector<std::string>{
            R"({"instruction":"Translate to French.","input":"cat","system":"You translate words.","history":[["Translate to French.\ndog","chien"]],"output":"chat"})",
            R"({"instruction":"What is 2 + 2?","input":"","output":"4"})",
            R"({"instruction":"Spell it backwards.","input":"","output":"olleh"})"});
    TrainingArguments s = dataset_args(dir, "sft", "sharegpt_demo, openai_demo");
    prepare_datasets(s);
    CHECK(
        jsonl_lines(s.train_file) ==
        std::vector<std::string>{
            R"({"conversations":[{"from":"human","value":"Capital of France?"},{"from":"gpt","value":"Paris."}],"system":"Answer in one word."})",
            R"({"conversations":[{"from":"human","value":"Say hi."},{"from":"gpt","value":"Hi!"},{"from":"human","value":"Again."},{"from":"gpt","value":"Hi again!"}],"system":"Be friendly."})",
            R"({"conversations":[{"from":"human","value":"2 + 3?"},{"from":"gpt","value":"5"}],"system":"Be brief."})",
            R"({"conversations":[{"from":"human","value":"Opposite of up?"},{"from":"gpt","value":"Down."}]})"});
    CHECK_THAT(s.train_file,
               Contains(dir + "/out/.cache/datasets/sharegpt_demo+openai_demo.train-"));
    TrainingArguments f = dataset_args(dir, "sft", "folder_demo");
    prepare_datasets(f);
    CHECK(jsonl_lines(f.train_file) ==
          std::vector<std::string>{R"({"instruction":"First part.","input":"","output":"one"})",
                                   R"({"instruction":"Second part.","input":"","output":"two"})",
                                   R"({"instruction":"Third.","input":"","output":"three"})"});
    // A data file named directly is read as it is (zerotrain's layouts).
    TrainingArguments direct = dataset_args(dir, "sft", "identity.json");
    prepare_datasets(direct);
    CHECK(jsonl_lines(direct.train_file).size() == 4);
    CHECK(jsonl_lines(direct.train_file)[2] ==
          R"({"instruction":"What is your name?","input":"","output":"My name is Zed."})");
  }
  SECTION("pairs and KTO examples, each for its stage only") {
    TrainingArguments p = dataset_args(dir, "dpo", "dpo_en_demo,dpo_alpaca_demo");
    prepare_datasets(p);
    const std::vector<std::string> pairs = jsonl_lines(p.train_file);
    REQUIRE(pairs.size() == 11);
    CHECK(
        pairs[0] ==
        R"({"conversations":[{"from":"human","value":"Is 7 odd?"}],"chosen":{"from":"gpt","value":"Yes, 7 is odd."},"rejected":{"from":"gpt","value":"No, 7 is even."}})");
    CHECK(
        pairs[8] ==
        R"({"instruction":"Is 7 odd?","input":"","chosen":"Yes, 7 is odd.","rejected":"No, 7 is even."})");
    TrainingArguments k = dataset_args(dir, "kto", "kto_en_demo");
    prepare_datasets(k);
    const std::vector<std::string> kto = jsonl_lines(k.train_file);
    REQUIRE(kto.size() == 8);
    CHECK(
        kto[2] ==
        R"({"conversations":[{"from":"human","value":"2 + 2?"},{"from":"gpt","value":"5"}],"label":false})");
    CHECK_THAT(prepare_error(dataset_args(dir, "sft", "dpo_en_demo")),
               Contains("'dpo_en_demo' is a preference dataset"));
    CHECK_THAT(prepare_error(dataset_args(dir, "dpo", "identity")),
               Contains("'identity' is not a preference dataset"));
    CHECK_THAT(prepare_error(dataset_args(dir, "kto", "identity")), Contains("kto_tag"));
  }
  SECTION("concatenated in order, max_samples of each, val_size held out with the seed") {
    TrainingArguments all = dataset_args(dir, "sft", "identity,alpaca_en_demo");
    prepare_datasets(all);
    const std::vector<std::string> records = jsonl_lines(all.train_file);
    REQUIRE(records.size() == 8);
    CHECK_THAT(records[0], Contains("\"hi\""));
    CHECK_THAT(records[4], Contains("Add the two numbers."));
    TrainingArguments few = dataset_args(dir, "sft", "identity,alpaca_en_demo");
    few.max_samples = 2;
    prepare_datasets(few);
    CHECK(jsonl_lines(few.train_file) ==
          std::vector<std::string>{records[0], records[1], records[4], records[5]});
    auto split = [&](double val_size, int64_t seed) {
      TrainingArguments v = dataset_args(dir, "sft", "identity,alpaca_en_demo");
      v.val_size = val_size;
      v.seed = seed;
      prepare_datasets(v);
      return std::make_pair(jsonl_lines(v.train_file), jsonl_lines(v.eval_file));
    };
    const auto [train, eval] = split(0.25, 42);  // HF's rule: ceil(0.25 × 8) = 2 held out
    CHECK(train.size() == 6);
    CHECK(eval.size() == 2);
    std::vector<std::string> both = train;
    both.insert(both.end(), eval.begin(), eval.end());
    std::sort(both.begin(), both.end());
    std::vector<std::string> sorted = records;
    std::sort(sorted.begin(), sorted.end());
    CHECK(both == sorted);                  // every record in one part
    CHECK(split(0.25, 42).second == eval);  // the same seed, the same split
    CHECK((split(0.25, 7).second != eval || split(0.25, 8).second != eval));
    CHECK(split(0.1, 42).second.size() == 1);  // ceil(0.8)
    CHECK(split(3, 42).second.size() == 3);    // from 1 up: a count
    TrainingArguments bad = dataset_args(dir, "sft", "identity");
    bad.val_size = 4;
    CHECK_THAT(prepare_error(bad), Contains("val_size 4 of 4") && Contains("at least one"));
    bad.val_size = 1.5;
    CHECK_THAT(prepare_error(bad), Contains("val_size 1.5"));
    // val_size over a train_file too.
    TrainingArguments file;
    file.output_dir = dir + "/out";
    file.train_file = dir + "/data/alpaca_en_demo.json";
    file.val_size = 0.5;
    prepare_datasets(file);
    CHECK(jsonl_lines(file.train_file).size() == 2);
    CHECK(jsonl_lines(file.eval_file).size() == 2);
    // What cannot be both.
    TrainingArguments twice = dataset_args(dir, "sft", "identity");
    twice.train_file = "x.jsonl";
    CHECK_THAT(prepare_error(twice), Contains("dataset (identity) and train_file (x.jsonl)"));
    TrainingArguments eval_too = dataset_args(dir, "sft", "identity");
    eval_too.val_size = 0.5;
    eval_too.eval_dataset = "alpaca_en_demo";
    CHECK_THAT(prepare_error(eval_too), Contains("val_size") && Contains("eval_dataset"));
    // eval_dataset: its own file; without `write`, the same paths and nothing written.
    TrainingArguments e = dataset_args(dir, "sft", "identity");
    e.eval_dataset = "alpaca_en_demo";
    e.output_dir = dir + "/dry";
    prepare_datasets(e, /*write=*/false);
    CHECK(!e.eval_file.empty());
    CHECK(!std::filesystem::exists(e.train_file));
    CHECK(!std::filesystem::exists(dir + "/dry"));
  }
  SECTION("hub datasets say how to download them; bad entries and records name their place") {
    CHECK_THAT(
        prepare_error(dataset_args(dir, "sft", "identity,alpaca_en")),
        Contains("dataset 'alpaca_en'") &&
            Contains("huggingface-cli download --repo-type dataset llamafactory/alpaca_en") &&
            Contains("file_name"));
    CHECK_THAT(prepare_error(dataset_args(dir, "sft", "belle_demo")),
               Contains("modelscope download --dataset AI-ModelScope/train_0.5M_CN"));
    CHECK_THAT(prepare_error(dataset_args(dir, "sft", "tatsu-lab/alpaca")),
               Contains("dataset 'tatsu-lab/alpaca': not an entry of") &&
                   Contains("huggingface-cli download --repo-type dataset tatsu-lab/alpaca"));
    // A record zerotrain cannot train: the file, the element and the key; skip_bad_lines skips.
    CHECK_THAT(
        prepare_error(dataset_args(dir, "sft", "toolcall_demo")),
        Contains("toolcall_demo.json: element 0 (line 2): tools") && Contains("skip_bad_lines"));
    TrainingArguments skip = dataset_args(dir, "sft", "toolcall_demo,identity");
    skip.skip_bad_lines = true;
    prepare_datasets(skip);
    CHECK(jsonl_lines(skip.train_file).size() == 4);
    // A downloaded file of a type zerotrain does not read.
    zt::files::write_atomic(dir + "/data/rows.parquet", "PAR1");
    CHECK_THAT(prepare_error(dataset_args(dir, "sft", "rows.parquet")),
               Contains("rows.parquet") && Contains("JSON and JSONL") && Contains("parquet"));
    // An entry with a misspelt key, a missing file, multimodal columns.
    std::filesystem::create_directories(dir + "/info");
    zt::files::write_atomic(dir + "/info/dataset_info.json", R"({
      "typo": {"file_name": "d.json", "colums": {"prompt": "q"}},
      "gone": {"file_name": "missing.json"},
      "pictures": {"file_name": "d.json", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "images": "images"}},
      "partial": {"file_name": "d.json", "columns": {"prompt": "instruction", "response": "output"}}})");
    zt::files::write_atomic(dir + "/info/d.json",
                            R"([{"instruction": "a", "input": "x", "output": "b"}])");
    TrainingArguments typo = dataset_args(dir, "sft", "typo");
    typo.dataset_dir = dir + "/info";
    CHECK_THAT(prepare_error(typo), Contains("typo.colums") && Contains("did you mean 'columns'"));
    typo.dataset = "gone";
    CHECK_THAT(prepare_error(typo), Contains("missing.json") && Contains("not found"));
    typo.dataset = "pictures";
    CHECK_THAT(prepare_error(typo), Contains("images") && Contains("multimodal"));
    // Columns given replace the defaults: "query" left out is none, so "input" is not read.
    typo.dataset = "partial";
    prepare_datasets(typo);
    CHECK(jsonl_lines(typo.train_file) ==
          std::vector<std::string>{R"({"instruction":"a","input":"","output":"b"})"});
  }
}
