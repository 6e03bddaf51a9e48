// Malformed and inconsistent configuration: each is rejected with the JSON path (or option
// name) in the message, never a crash or a silent default.
#include "support/catch.hpp"

#include <cmath>
#include <variant>

#include <fmt/format.h>

#include "config/training_options.hpp"
#include "support/ranks.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"

using namespace zt;
using Catch::Contains;

namespace {

struct Bad {
  const char* json;
  std::vector<const char*> must_contain;
};

}  // namespace

TEST_CASE("malformed DeepSpeed configs are rejected with the path and the found value",
          "[config][errors]") {
  const std::vector<Bad> cases = {
      {R"({"zero_optimization": {"stage": "two"}})",
       {"zero_optimization.stage", "expected an integer 0-3", "\"two\""}},
      {R"({"zero_optimization": {"stage": 4}})", {"zero_optimization.stage", "0-3", "found 4"}},
      {R"({"train_batch_size": -8})", {"train_batch_size", "found -8"}},
      {R"({"train_micro_batch_size_per_gpu": 2.5})", {"train_micro_batch_size_per_gpu", "2.5"}},
      {R"({"gradient_accumulation_steps": "many"})", {"gradient_accumulation_steps", "\"many\""}},
      {R"({"zero_optimization": {"reduce_bucket_size": "big"}})",
       {"zero_optimization.reduce_bucket_size", "\"auto\"", "\"big\""}},
      {R"({"zero_optimization": {"overlap_comm": "yes"}})",
       {"zero_optimization.overlap_comm", "true or false"}},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       {"zero_optimization.offload_param.device", "stage 3"}},
      {R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})",
       {"zero_optimization.offload_optimizer.device", "stage 1, 2 or 3"}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})",
       {"zero_optimization.offload_optimizer.device", "NVMe"}},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "tpu"}}})",
       {"zero_optimization.offload_optimizer.device", "\"none\", \"cpu\", \"nvme\""}},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})",
       {"zero_optimization.offload_optimizer.ratio", "1.5"}},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "half"}}})",
       {"zero_optimization.offload_optimizer.ratio", "\"half\""}},
      {R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": "int8"}})",
       {"zero_optimization.zero_quantized_weights", "\"int8\""}},
      {R"({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": true}})",
       {"zero_optimization.zero_quantized_nontrainable_weights", "zero_quantized_weights"}},
      {R"({"zero_optimization": {"zero_hpz_partition_size": 0}})",
       {"zero_optimization.zero_hpz_partition_size", "0"}},
      {R"({"zero_optimization": {"zero_hpz_partition_size": 1.5}})",
       {"zero_optimization.zero_hpz_partition_size", "1.5"}},
      {R"({"zero_optimization": {"stage": 3, "mics_shard_size": -5}})",
       {"zero_optimization.mics_shard_size", "-5"}},
      {R"({"zero_optimization": {"stage": 3, "mics_shard_size": "node"}})",
       {"zero_optimization.mics_shard_size", "\"node\""}},
      {R"({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": "yes"}})",
       {"zero_optimization.mics_hierarchical_params_gather"}},
      {R"({"fp16": {"enabled": true, "hysteresis": 0}})", {"fp16.hysteresis", ">= 1"}},
      {R"({"fp16": {"enabled": true, "loss_scale": -1}})", {"fp16.loss_scale"}},
      {R"({"fp16": {"enabled": 1}})", {"fp16.enabled", "true, false or \"auto\""}},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {"fp16", "bf16", "both"}},
      {R"({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}})",
       {"optimizer.type", "Lamb", "AdamW"}},
      {R"({"optimizer": {"params": {"lr": 0.1}}})", {"optimizer.type"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
       {"optimizer.params.betas", "[beta1, beta2]"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})",
       {"optimizer.params.lr", "\"fast\""}},
      {R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})",
       {"optimizer.params.amsgrad"}},
      {R"({"scheduler": {"type": "CosineLR"}})", {"scheduler.type", "WarmupLR"}},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": 3}}})",
       {"scheduler.params.warmup_type"}},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}})",
       {"scheduler.params.cycle_momentum"}},
      {R"({"communication_data_type": "int8"})", {"communication_data_type", "\"int8\""}},
      {R"({"gradient_predivide_factor": 0})", {"gradient_predivide_factor"}},
      {R"({"zero_optimization": []})", {"zero_optimization", "expected an object"}},
      {R"({"amp": {"enabled": true}})", {"amp", "not supported"}},
      {R"({"zero_optimization": {"stage": 1, "stage": 2}})", {"zero_optimization.stage", "twice"}},
      {R"([1, 2])", {"expected an object"}},
      {R"({"train_batch_size": 8,})", {"invalid JSON", "line 1"}},
      {"{\n  \"zero_optimization\": {\n    \"stage\": 2\n  \n", {"invalid JSON", "line 5"}},
  };
  for (const Bad& c : cases) {
    INFO("config: " << c.json);
    try {
      parse_deepspeed_config(c.json, "bad.json");
      FAIL("accepted a malformed config");
    } catch (const ConfigError& e) {
      std::string msg = e.what();
      INFO("message: " << msg);
      CHECK_THAT(msg, Contains("bad.json"));
      for (const char* part : c.must_contain) CHECK_THAT(msg, Contains(part));
    }
  }
}

TEST_CASE("inconsistent configs and arguments are rejected naming both sides", "[config][errors]") {
  auto resolve_err = [](const char* ds_json, std::vector<std::string> flags, int world) {
    DeepSpeedConfig ds = parse_deepspeed_config(ds_json, "ds.json");
    TrainingArguments a;
    apply_training_flags(a, flags);
    try {
      resolve_config(ds, a, ResolveContext{world, std::nullopt, std::nullopt});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK_THAT(resolve_err(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2})",
                         {}, 2),
             Contains("train_batch_size 30") && Contains("world size 2") && Contains("= 16"));
  CHECK_THAT(resolve_err(R"({"train_micro_batch_size_per_gpu": 4})",
                         {"--per_device_train_batch_size", "2"}, 1),
             Contains("train_micro_batch_size_per_gpu is 4") &&
                 Contains("per_device_train_batch_size is 2"));
  CHECK_THAT(resolve_err(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})",
                         {"--learning_rate", "2e-5"}, 1),
             Contains("optimizer.params.lr") && Contains("learning_rate"));
  CHECK_THAT(resolve_err(R"({"gradient_clipping": 1.0})", {"--max_grad_norm", "0.5"}, 1),
             Contains("gradient_clipping") && Contains("max_grad_norm"));
  CHECK_THAT(resolve_err(R"({"bf16": {"enabled": false}})", {"--bf16"}, 1),
             Contains("bf16.enabled") && Contains("training argument bf16"));
  CHECK_THAT(resolve_err(R"({"fp16": {"enabled": true}})", {"--bf16"}, 1),
             Contains("fp16 and bf16 are both enabled"));
  CHECK_THAT(resolve_err(R"({"train_batch_size": 10})", {"--per_device_train_batch_size", "4"}, 1),
             Contains("train_batch_size 10 is not divisible"));
  CHECK_THAT(
      resolve_err(R"({"train_batch_size": 16})",
                  {"--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"}, 1),
      Contains("gradient_accumulation_steps"));
  CHECK_THAT(resolve_err(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}})",
                         {"--adam_beta2", "0.999"}, 1),
             Contains("optimizer.params.betas[1]") && Contains("adam_beta2"));
  CHECK_THAT(
      resolve_err(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})",
                  {"--warmup_steps", "20"}, 1),
      Contains("warmup_num_steps") && Contains("warmup_steps"));
}

TEST_CASE("bad flags and option keys are errors naming them", "[config][errors][args]") {
  auto flag_err = [](std::vector<std::string> flags) {
    TrainingArguments a;
    try {
      apply_training_flags(a, flags);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK_THAT(flag_err({"--lerning_rate", "1e-4"}),
             Contains("--lerning_rate") && Contains("did you mean 'learning_rate'"));
  CHECK_THAT(flag_err({"--learning_rate", "fast"}), Contains("learning_rate") && Contains("fast"));
  CHECK_THAT(flag_err({"--per_device_train_batch_size", "0"}),
             Contains("per_device_train_batch_size") && Contains("from 1 to"));
  CHECK_THAT(flag_err({"--per_device_train_batch_size"}), Contains("needs a value"));
  CHECK_THAT(flag_err({"--fp16", "--bf16"}), Contains("fp16 and bf16"));
  CHECK_THAT(flag_err({"--lr_scheduler_type", "cosine_warm"}),
             Contains("lr_scheduler_type") && Contains("linear"));
  CHECK_THAT(flag_err({"--fp16=maybe"}), Contains("fp16") && Contains("maybe"));
  CHECK_THAT(flag_err({"--adam_beta1", "1.5"}), Contains("adam_beta1"));
  for (const char* keep : {"lots", "-1", "nan", "4GiB", ""}) {
    INFO(keep);
    CHECK_THAT(flag_err({"--gradient_checkpointing_keep", keep}),
               Contains("gradient_checkpointing_keep") && Contains("GiB"));
  }

  TrainingArguments a;
  CHECK_THROWS_WITH(apply_training_json(a, R"({"learning_rat": 1})", "run.json"),
                    Contains("run.json") && Contains("learning_rat") && Contains("unknown option"));
  CHECK_THROWS_WITH(apply_training_json(a, R"({"seed": "x"})", "run.json"),
                    Contains("run.json: seed"));
  CHECK_THROWS_WITH(apply_training_json(a, R"([1])", "run.json"), Contains("JSON object"));
}

TEST_CASE("every numeric option holds to its range, as a flag, as JSON and set in code",
          "[config][errors][args]") {
  // The table itself is the test's input: each numeric option is tried at its ends, past them
  // and in spellings Python's float() would not read as a decimal number.
  auto flag_error = [](const std::string& name, const std::string& text) -> std::string {
    TrainingArguments a;
    try {
      apply_training_flags(a, {"--" + name, text});
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  auto json_error = [](const std::string& name, const std::string& number) -> std::string {
    TrainingArguments a;
    try {
      apply_training_json(a, fmt::format(R"({{"{}": {}}})", name, number), "run.json");
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  auto text = [](double v) { return fmt::format("{}", v); };
  int numeric = 0;
  for (const config::Option& o : config::options()) {
    const bool integer =
        std::holds_alternative<int64_t TrainingArguments::*>(o.member) ||
        std::holds_alternative<std::optional<int64_t> TrainingArguments::*>(o.member);
    const bool real = std::holds_alternative<double TrainingArguments::*>(o.member) ||
                      std::holds_alternative<std::optional<double> TrainingArguments::*>(o.member);
    if (!integer && !real) continue;
    ++numeric;
    INFO(o.name);
    const config::Range& r = o.range;
    REQUIRE(r.min > -1e300);  // every number has both ends
    REQUIRE(r.max < 1e300);
    if (r.ends != config::Range::kOpenBelow) CHECK(flag_error(o.name, text(r.min)).empty());
    if (r.ends != config::Range::kOpenAbove) CHECK(flag_error(o.name, text(r.max)).empty());
    const double below = r.ends == config::Range::kOpenBelow ? r.min : r.min - 1;
    const double above = r.ends == config::Range::kOpenAbove ? r.max : r.max * 2 + 1;
    for (double outside : {below, above}) {
      CHECK_THAT(flag_error(o.name, text(outside)),
                 Contains("--" + std::string(o.name)) && Contains(r.describe(integer)));
      CHECK_THAT(json_error(o.name, text(outside)), Contains(fmt::format("run.json: {}", o.name)));
    }
    for (const char* spelling : {"0x10", "inf", "-inf", "nan", "1e400", "1_0", "", "1.5.2"}) {
      INFO(spelling);
      CHECK_THAT(flag_error(o.name, spelling), Contains("--" + std::string(o.name)));
    }
    // Leading zeros are decimal, as in Python: "010" is ten wherever ten is in range.
    if (r.contains(10)) CHECK(flag_error(o.name, "010").empty());
  }
  CHECK(numeric > 30);

  // Set in code, past the parser: the Trainer's check names the option just the same.
  TrainingArguments a;
  a.lora_dropout = 1.0;
  CHECK_THROWS_WITH(check_training_arguments(a), Contains("lora_dropout") && Contains("< 1"));
  a = TrainingArguments();
  a.per_device_train_batch_size = int64_t{1} << 40;
  CHECK_THROWS_WITH(check_training_arguments(a), Contains("per_device_train_batch_size"));
  a = TrainingArguments();
  a.learning_rate = std::nan("");
  CHECK_THROWS_WITH(check_training_arguments(a), Contains("learning_rate"));
  CHECK_NOTHROW(check_training_arguments(TrainingArguments()));
}

TEST_CASE("gradient_checkpointing_keep reads as the engine's keep budget", "[config][args]") {
  TrainingArguments a;
  CHECK(recompute_keep_bytes_for(a) == EngineOptions::kAutoKeep);
  apply_training_flags(a, {"--gradient_checkpointing_keep", "none"});
  CHECK(recompute_keep_bytes_for(a) == 0);
  apply_training_flags(a, {"--gradient_checkpointing_keep", "1.5"});
  CHECK(recompute_keep_bytes_for(a) == int64_t{3} << 29);
  apply_training_json(a, R"({"gradient_checkpointing_keep": 2})", "run.json");  // GiB
  CHECK(recompute_keep_bytes_for(a) == int64_t{2} << 30);
  apply_training_json(a, R"({"gradient_checkpointing_keep": "auto"})", "run.json");
  CHECK(recompute_keep_bytes_for(a) == EngineOptions::kAutoKeep);
  CHECK_THROWS_WITH(apply_training_json(a, R"({"gradient_checkpointing_keep": -2})", "run.json"),
                    Contains("run.json") && Contains("gradient_checkpointing_keep"));
}

TEST_CASE("a missing DeepSpeed config file is an IoError naming it", "[config][errors]") {
  CHECK_THROWS_AS(load_deepspeed_config("/nonexistent/ds.json"), IoError);
  CHECK_THROWS_WITH(load_deepspeed_config("/nonexistent/ds.json"),
                    Contains("/nonexistent/ds.json"));
}
