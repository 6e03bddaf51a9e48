// The Trainer and the C API on the GPU machine: every fine-tuning method trains on CUDA in bf16
// and writes what a user loads; fp32 on CUDA follows the CPU run step by step; a stopped run
// resumes on CUDA with the uninterrupted run's losses; fp16 with ZeRO-3 and offload; the log
// carries the peak GPU memory. One process (world size 1) each.
#include "support/catch.hpp"

#include <ATen/Context.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/ranks.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/trainer.hpp"
#include "zerotrain/zerotrain.h"

using namespace zt;
using Catch::Contains;
using zt::test::kTinyModel;
using zt::test::logged_losses;
using zt::test::stage_json;
using zt::test::write_data;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> job_flags(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_run_flags(
      dir,
      {"--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--max_steps", "6",
       "--logging_steps", "1", "--save_steps", "3", "--seed", "5"},
      extra);
}

// Runs a whole job in this process; `steps` collects what every optimizer step did.
TrainResult run_job(const std::vector<std::string>& flags, std::vector<StepStats>* steps = nullptr,
                    int64_t cancel_at = 0) {
  TrainingArguments args;
  apply_training_flags(args, flags);
  auto comm = join_training_job(args);
  TrainerCallbacks callbacks;
  Trainer* self = nullptr;
  callbacks.on_step = [&](const StepStats& s) {
    if (steps) steps->push_back(s);
    if (cancel_at > 0 && s.global_step == cancel_at) self->cancel();
  };
  Trainer trainer(args, comm, callbacks);
  self = &trainer;
  return trainer.train();
}

}  // namespace

TEST_CASE("trainer on GPU: every fine-tuning method trains in bf16 and writes its output",
          "[gpu][trainer]") {
  REQUIRE(at::getNumGPUs() > 0);
  struct Method {
    std::vector<std::string> flags;
    int stage;
    bool adapter;
  };
  const std::vector<Method> methods{
      {{"--finetuning_type", "full"}, 2, false},
      {{"--finetuning_type", "lora", "--lora_r", "8", "--lora_dropout", "0.1"}, 2, true},
      {{"--finetuning_type", "lora", "--lora_r", "8"}, 3, true},
      {{"--finetuning_type", "ptuning", "--num_virtual_tokens", "4"}, 1, true},
      {{"--finetuning_type", "prefix", "--pre_seq_len", "4", "--prefix_projection", "true"},
       2,
       true},
      {{"--finetuning_type", "freeze", "--freeze_trainable_layers", "1"}, 0, false},
  };
  for (const Method& m : methods) {
    INFO(m.flags[1] << " at ZeRO stage " << m.stage);
    const std::string dir = test::temp_dir("gpu_method");
    write_data(dir, "train.jsonl", 48, 1);
    std::vector<std::string> extra = m.flags;
    extra.insert(extra.end(), {"--bf16", "true", "--deepspeed", stage_json(m.stage)});
    std::vector<StepStats> steps;
    const TrainResult result = run_job(job_flags(dir, extra), &steps);
    CHECK(result.global_step == 6);
    REQUIRE(steps.size() == 6);
    for (const StepStats& s : steps) {
      CHECK(std::isfinite(s.loss));
      CHECK(std::isfinite(s.grad_norm));
      CHECK_FALSE(s.skipped);
    }
    if (m.flags[1] == "full" || m.flags[1] == "lora") CHECK(steps.back().loss < steps.front().loss);
    const std::string out = dir + "/out";
    if (m.adapter) {
      CHECK(fs::exists(out + "/adapter_config.json"));
      CHECK(fs::exists(out + "/adapter_model.safetensors"));
    } else {
      CHECK(fs::exists(out + "/config.json"));
      CHECK(fs::exists(out + "/model.safetensors"));
    }
    CHECK(list_checkpoints(out).size() == 2);
    const auto peaks = zt::test::logged(out, "peak_memory_gib");  // by step
    REQUIRE(peaks.size() >= 6);
    for (const auto& step_peak : peaks) CHECK(step_peak.second > 0.0);
  }
}

TEST_CASE("trainer on GPU: fp32 on CUDA follows the CPU run step by step", "[gpu][trainer]") {
  // cuBLAS fp32 (no TF32 by default) against the CPU: the same weights, data and steps give
  // the same losses and gradient norms up to fp32 rounding of different reduction orders.
  std::vector<std::vector<StepStats>> runs;
  for (const char* device : {"cpu", "cuda"}) {
    const std::string dir = test::temp_dir("gpu_vs_cpu");
    write_data(dir, "train.jsonl", 48, 2);
    runs.emplace_back();
    run_job(job_flags(dir, {"--device", device, "--deepspeed", stage_json(2), "--finetuning_type",
                            "lora", "--lora_r", "8", "--lora_alpha", "16"}),
            &runs.back());
  }
  REQUIRE(runs[0].size() == 6);
  REQUIRE(runs[1].size() == 6);
  for (size_t i = 0; i < 6; ++i) {
    INFO("step " << i + 1);
    CHECK(runs[1][i].loss == Approx(runs[0][i].loss).epsilon(1e-4));
    CHECK(runs[1][i].grad_norm == Approx(runs[0][i].grad_norm).epsilon(1e-3));
  }
}

TEST_CASE("trainer on GPU: layers' saved inputs in host memory (use_unsloth_gc) change no step",
          "[gpu][trainer]") {
  // Checkpointed LoRA and QLoRA runs on CUDA (with dropout: the recomputations replay its
  // draws), with the layers' inputs and sums sent to page-locked host memory and fetched back one
  // layer ahead, against the same runs keeping them on the GPU; then with one checkpoint per two
  // layers (recompute_num_layers), the second rebuilt from the first in backward.
  for (const char* quantization : {"0", "4"}) {
    INFO("quantization_bit " << quantization);
    std::vector<std::vector<StepStats>> runs;
    for (const char* offload : {"false", "true", "span"}) {
      const bool span = std::string(offload) == "span";
      const std::string dir = test::temp_dir("gpu_unsloth_gc");
      write_data(dir, "train.jsonl", 48, 2);
      runs.emplace_back();
      std::vector<std::string> extra{"--device",
                                     "cuda",
                                     "--deepspeed",
                                     stage_json(2),
                                     "--finetuning_type",
                                     "lora",
                                     "--lora_r",
                                     "8",
                                     "--gradient_checkpointing",
                                     "true",
                                     "--lora_dropout",
                                     "0.1",
                                     "--use_unsloth_gc",
                                     span ? "true" : offload,
                                     "--recompute_num_layers",
                                     span ? "2" : "1"};
      if (std::string(quantization) == "4") extra.insert(extra.end(), {"--quantization_bit", "4"});
      run_job(job_flags(dir, extra), &runs.back());
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      INFO((r == 1 ? "use_unsloth_gc" : "use_unsloth_gc, recompute_num_layers 2"));
      REQUIRE(runs[0].size() == 6);
      REQUIRE(runs[r].size() == 6);
      for (size_t i = 0; i < 6; ++i) {
        INFO("step " << i + 1);
        CHECK(runs[r][i].loss == Approx(runs[0][i].loss).epsilon(1e-5));
        CHECK(runs[r][i].grad_norm == Approx(runs[0][i].grad_norm).epsilon(1e-4));
      }
    }
  }
}

TEST_CASE("trainer on GPU: a stopped run resumes with the uninterrupted run's losses",
          "[gpu][trainer]") {
  // LoRA with dropout in bf16 at ZeRO-2: the resumed run must restore the CUDA random state.
  const std::vector<std::string> method{"--finetuning_type",
                                        "lora",
                                        "--lora_r",
                                        "8",
                                        "--lora_dropout",
                                        "0.1",
                                        "--bf16",
                                        "true",
                                        "--gradient_accumulation_steps",
                                        "2",
                                        "--deepspeed",
                                        stage_json(2)};
  const std::string whole = test::temp_dir("gpu_whole"), parts = test::temp_dir("gpu_parts");
  for (const std::string& d : {whole, parts}) write_data(d, "train.jsonl", 64, 3);
  run_job(job_flags(whole, method));
  CHECK_THROWS_AS(run_job(job_flags(parts, method), nullptr, /*cancel_at=*/4), CancelledError);
  REQUIRE(list_checkpoints(parts + "/out").back().step == 3);
  std::vector<std::string> resume = method;
  resume.insert(resume.end(), {"--resume_from_checkpoint", "True"});
  run_job(job_flags(parts, resume));
  const auto want = logged_losses(whole + "/out"), got = logged_losses(parts + "/out");
  REQUIRE(want.size() == 6);
  for (int64_t step = 4; step <= 6; ++step) {
    INFO("step " << step);
    REQUIRE(got.count(step));
    // Same kernels, same inputs: equal up to the GPU's run-to-run nondeterminism in bf16
    // (attention backward accumulates with atomics). The exact check is the CPU test's.
    CHECK(got.at(step) == Approx(want.at(step)).epsilon(5e-3));
  }
}

TEST_CASE("trainer on GPU: fp16 with ZeRO-3 and CPU offload trains and exports a model",
          "[gpu][trainer]") {
  const std::string dir = test::temp_dir("gpu_z3_offload");
  write_data(dir, "train.jsonl", 48, 4);
  std::vector<StepStats> steps;
  run_job(
      job_flags(dir, {"--fp16", "true", "--deepspeed",
                      stage_json(3, R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                                           "offload_param": {"device": "cpu", "pin_memory": true},
                                           "stage3_gather_16bit_weights_on_model_save": true)")}),
      &steps);
  REQUIRE(steps.size() == 6);
  int applied = 0;
  for (const StepStats& s : steps) {
    CHECK(std::isfinite(s.loss));
    CHECK(s.loss_scale >= 1.0);
    applied += s.skipped ? 0 : 1;
  }
  CHECK(applied >= 3);  // the scaler may skip the first steps while it finds its scale
  CHECK(fs::exists(dir + "/out/model.safetensors"));
}

TEST_CASE("trainer on GPU: optimizer state the GPU cannot hold is refused in GiB before it is made",
          "[gpu][trainer]") {
  // LLaMA-2-13B fully fine-tuned at one rank without offload: 26 GB of bf16 weights fit the
  // GPU, the 16 bytes per parameter of gradients, fp32 masters and Adam's moments do not.
  const std::string dir = test::temp_dir("gpu_state_fits");
  write_data(dir, "train.jsonl", 8, 4);
  std::vector<std::string> flags = job_flags(dir, {"--bf16", "true", "--deepspeed", stage_json(3)});
  flags[1] = std::string(ZT_EXAMPLES) + "/shapes/llama-2-13b.json";  // the --model_config value
  REQUIRE(flags[0] == "--model_config");
  CHECK_THROWS_MATCHES(run_job(flags), OutOfMemoryError,
                       test::Has({"ZeRO stage 3 over 1 rank", "GiB on cuda", "offload_optimizer"}));
}

TEST_CASE("C API on GPU: create, train_step, evaluate, save, load and export on cuda",
          "[gpu][capi]") {
  const std::string dir = test::temp_dir("gpu_capi");
  const std::string options = fmt::format(
      R"({{"model_config": {}, "device": "cuda", "output_dir": "{}/out", "bf16": true,
          "finetuning_type": "lora", "lora_r": 8, "learning_rate": 0.01, "max_steps": 20}})",
      kTinyModel, dir);
  zt_trainer* t = nullptr;
  REQUIRE(zt_trainer_create(options.c_str(), &t) == ZT_OK);
  std::vector<int64_t> ids;
  for (int i = 0; i < 64; ++i) ids.push_back(3 + (i * 7) % 200);
  zt_step_stats first{}, last{};
  REQUIRE(zt_trainer_train_step(t, ids.data(), nullptr, 2, 32, &first) == ZT_OK);
  for (int i = 0; i < 10; ++i)
    REQUIRE(zt_trainer_train_step(t, ids.data(), nullptr, 2, 32, &last) == ZT_OK);
  CHECK(last.loss < first.loss);
  CHECK(last.global_step == 11);
  ids[5] = 999;  // outside the vocabulary
  CHECK(zt_trainer_train_step(t, ids.data(), nullptr, 2, 32, &last) == ZT_ERR_INVALID_ARGUMENT);
  CHECK_THAT(zt_last_error(), Contains("999"));
  ids[5] = 4;
  double before = 0, after = 0;
  REQUIRE(zt_trainer_evaluate(t, ids.data(), nullptr, 1, 2, 32, &before) == ZT_OK);
  REQUIRE(zt_trainer_save_checkpoint(t, (dir + "/ckpt").c_str()) == ZT_OK);
  REQUIRE(zt_trainer_train_step(t, ids.data(), nullptr, 2, 32, &last) == ZT_OK);
  REQUIRE(zt_trainer_load_checkpoint(t, (dir + "/ckpt").c_str()) == ZT_OK);
  REQUIRE(zt_trainer_evaluate(t, ids.data(), nullptr, 1, 2, 32, &after) == ZT_OK);
  CHECK(after == Approx(before).epsilon(1e-6));
  REQUIRE(zt_trainer_export(t, (dir + "/adapter").c_str()) == ZT_OK);
  CHECK(fs::exists(dir + "/adapter/adapter_model.safetensors"));
  zt_trainer_free(t);
}
