// Engine equivalence cases (see equivalence.hpp).
//
// Tolerances: fp32 (and fp16 on CPU, which computes in fp32 under a power-of-two loss scale):
// 2e-5 relative on norms and 2e-5 absolute on parameters — summation order across ranks moves
// fp32 results by ~1e-7 (REFERENCE §3), so anything near 1e-3 would be a bug. bf16 (and fp16
// on a GPU): norms within 4% and the mean parameter error below 15% of the mean parameter
// movement.
#include "support/equivalence.hpp"

#include "support/catch.hpp"

// First: LibTorch 1.13's clip_grad.h uses Tensor without including it.
#include <torch/types.h>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>

#include "support/models.hpp"
#include "support/ranks.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"

namespace zt::test {

std::string Case::encode() const {
  return fmt::format("{} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {}", stage, world, accum,
                     dtype, int(offload), model, opt, int(ckpt), int(token_norm), bucket, steps,
                     micro, device, clip, int(in_backward), offload_ratio, mics, hpz);
}

Case Case::decode(const std::string& s) {
  Case c;
  std::istringstream in(s);
  in >> c.stage >> c.world >> c.accum >> c.dtype >> c.offload >> c.model >> c.opt >> c.ckpt >>
      c.token_norm >> c.bucket >> c.steps >> c.micro >> c.device >> c.clip >> c.in_backward >>
      c.offload_ratio >> c.mics >> c.hpz;
  if (!in) throw std::runtime_error("malformed ZT_CASE: " + s);
  return c;
}

std::string Case::describe() const {
  return fmt::format(
             "stage {} world {} accum {} {} offload {}{} {} {} ckpt {} {} on {} clip {}{}{}", stage,
             world, accum, dtype, offload,
             offload && offload_ratio != 1.0 ? fmt::format(" (ratio {})", offload_ratio)
                                             : std::string(),
             model, opt, ckpt, token_norm ? "token-normalized" : "mean-normalized", device, clip,
             in_backward ? " updates in backward" : "",
             mics > 0 ? fmt::format(" mics_shard_size {}", mics) : std::string()) +
         (hpz > 1 ? fmt::format(" zero_hpz_partition_size {}", hpz) : std::string());
}

namespace {

constexpr double kLr = 0.01, kWd = 0.1;
constexpr uint64_t kSeed = 1234;

std::string ds_json(const Case& c) {
  std::string offload =
      !c.offload ? ""
      : c.offload_ratio == 1.0
          ? R"(, "offload_optimizer": {"device": "cpu"})"
          : fmt::format(R"(, "offload_optimizer": {{"device": "cpu", "ratio": {}}})",
                        c.offload_ratio);
  // Real fp16 (GPU) starts from 2^8: DeepSpeed's 2^32 default would skip the first steps.
  std::string fp16 = c.device == "cuda" ? R"(, "initial_scale_power": 8)" : "";
  // "bf16_pure": DeepSpeed's bf16 master weights, gradients and optimizer states.
  std::string bf16 =
      c.dtype == "bf16_pure"
          ? R"(, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true)"
          : "";
  if (c.offload && c.stage == 3) offload += R"(, "offload_param": {"device": "cpu"})";
  if (c.mics > 0) offload += fmt::format(R"(, "mics_shard_size": {})", c.mics);
  if (c.hpz > 1) offload += fmt::format(R"(, "zero_hpz_partition_size": {})", c.hpz);
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "fp16": {{"enabled": "auto"{}}}, "bf16": {{"enabled": "auto"{}}},
    "zero_optimization": {{"stage": {}, "reduce_bucket_size": {}, "allgather_bucket_size": {},
       "overlap_comm": true, "stage3_param_persistence_threshold": 20,
       "stage3_prefetch_bucket_size": 1000 {}}}}})",
                     fp16, bf16, c.stage, c.bucket, c.bucket, offload);
}

TrainingArguments args_for(const Case& c) {
  TrainingArguments a;
  apply_training_json(a, fmt::format(R"({{"per_device_train_batch_size": {},
      "gradient_accumulation_steps": {}, "learning_rate": {}, "weight_decay": {},
      "max_grad_norm": {}, "lr_scheduler_type": "constant", "fp16": {}, "bf16": {},
      "optim": "{}", "max_steps": {}}})",
                                     c.micro, c.accum, kLr, kWd, c.clip, c.dtype == "fp16",
                                     c.dtype.rfind("bf16", 0) == 0,
                                     c.opt == "sgd" ? "sgd" : "adamw_torch", c.steps));
  return a;
}

// The reference: one process, fp32, the whole global batch at once.
struct Reference {
  std::vector<double> norms;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

Reference reference_run(const Case& c) {
  auto model = test::make_model(c.model, kSeed);
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : model->named_parameters()) {
    (applies_weight_decay(p.key()) ? decay : no_decay).push_back(p.value());
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.opt == "sgd") {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::SGDOptions>(
                                   torch::optim::SGDOptions(kLr).weight_decay(kWd)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::SGDOptions>(
                                      torch::optim::SGDOptions(kLr).weight_decay(0.0)));
    opt = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(kLr));
  } else {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(kLr).weight_decay(kWd)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(kLr).weight_decay(0.0)));
    opt = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(kLr));
  }
  Reference ref;
  const int64_t global = c.micro * c.accum * c.world;
  for (int64_t s = 0; s < c.steps; ++s) {
    opt->zero_grad();
    at::Tensor loss;
    if (c.token_norm) {
      test::Batch all = test::make_batch(c.model, s, 0, global);
      loss = model->loss_sum(all.inputs, all.labels) / static_cast<double>(all.tokens());
    } else {
      // DeepSpeed's normalization: the mean over micro-batches of each micro-batch's mean.
      loss = at::zeros({});
      for (int64_t m = 0; m < c.accum * c.world; ++m) {
        test::Batch b = test::make_batch(c.model, s, m * c.micro, c.micro);
        loss = loss + model->loss_sum(b.inputs, b.labels) /
                          static_cast<double>(std::max<int64_t>(1, b.tokens()));
      }
      loss = loss / static_cast<double>(c.accum * c.world);
    }
    loss.backward();
    // Without clipping, a bound no norm reaches: the call only measures.
    ref.norms.push_back(
        torch::nn::utils::clip_grad_norm_(model->parameters(), c.clip > 0 ? c.clip : 1e30));
    opt->step();
  }
  for (const auto& p : model->named_parameters())
    ref.params.emplace_back(p.key(), p.value().detach().clone());
  return ref;
}

bool compare(const Case& c, const std::vector<double>& norms,
             const std::vector<std::pair<std::string, at::Tensor>>& params) {
  Reference ref = reference_run(c);
  auto init = test::make_model(c.model, kSeed)->named_parameters();
  const bool bf16 = c.dtype.rfind("bf16", 0) == 0 || (c.dtype == "fp16" && c.device == "cuda");
  bool ok = true;
  for (size_t s = 0; s < norms.size(); ++s) {
    double rel = std::fabs(norms[s] - ref.norms[s]) / std::max(1e-12, ref.norms[s]);
    std::printf("step %zu: grad norm %.9g, reference %.9g (rel %.2g)\n", s, norms[s], ref.norms[s],
                rel);
    if (rel > (bf16 ? 4e-2 : 2e-5)) ok = false;
  }
  double err_sum = 0, move_sum = 0;
  int64_t count = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].first != ref.params[i].first) {
      std::printf("parameter order differs: %s vs %s\n", params[i].first.c_str(),
                  ref.params[i].first.c_str());
      return false;
    }
    at::Tensor got = params[i].second.to(at::kCPU).to(at::kFloat);
    at::Tensor want = ref.params[i].second;
    double max_err = (got - want).abs().max().item<double>();
    err_sum += (got - want).abs().sum().item<double>();
    move_sum += (want - init[params[i].first]).abs().sum().item<double>();
    count += want.numel();
    if (!bf16 && max_err > 2e-5) {
      std::printf("%s: max |engine - reference| = %.3g\n", params[i].first.c_str(), max_err);
      ok = false;
    }
  }
  std::printf("mean |error| %.3g, mean |movement| %.3g\n", err_sum / count, move_sum / count);
  if (move_sum <= 0 || (bf16 && err_sum > 0.15 * move_sum)) ok = false;
  return ok;
}

}  // namespace

TEST_CASE("rank: engine equivalence", "[.rank]") {
  Case c = Case::decode(std::getenv("ZT_CASE"));
  std::printf("case: %s\n", c.describe().c_str());
  const char* local = std::getenv("LOCAL_RANK");
  const at::Device device =
      c.device == "cuda" ? at::Device(at::kCUDA, static_cast<int16_t>(local ? std::atoi(local) : 0))
                         : at::Device(at::kCPU);
  auto comm = std::shared_ptr<Communicator>(test::join(Backend::kAuto, device));
  const int rank = comm->rank(), world = comm->world_size();
  REQUIRE(world == c.world);
  auto model = test::make_model(c.model, kSeed);
  DeepSpeedConfig ds = parse_deepspeed_config(ds_json(c), "case.json");
  TrainingArguments args = args_for(c);
  resolve_config(ds, args, ResolveContext{world, 16, c.steps});
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->unit_gate();
  eo.activation_checkpointing = c.ckpt;
  eo.total_train_steps = c.steps;
  eo.device = device;
  eo.update_in_backward = c.in_backward;
  Engine engine(model, ds, comm, eo);
  REQUIRE(engine.updates_in_backward() == c.in_backward);
  if (c.offload) {
    // Partial offload keeps the share past `ratio` (whole buckets) on the device as well.
    EngineMemory mem = engine.memory();
    const int64_t host_state = mem.optimizer_state - mem.device_optimizer_state;
    CHECK((mem.device_optimizer_state > 0) == (c.offload_ratio < 1.0));
    CHECK(static_cast<double>(mem.device_optimizer_state) <=
          (1.0 - c.offload_ratio) * static_cast<double>(host_state));
  }
  if (device.is_cuda() && c.offload && c.offload_ratio == 1.0 && c.opt != "sgd") {
    // What crosses to the GPU every step (masters, parameter shards, gradient slots) is
    // page-locked; only the Adam moments (two thirds of the optimizer state) are not.
    EngineMemory mem = engine.memory();
    CHECK(mem.host_pageable * 3 == mem.optimizer_state * 2);
    CHECK(mem.host_pinned >= mem.optimizer_state / 3 + (c.stage == 3 ? mem.compute_params : 0));
  }

  std::vector<double> norms;
  const int64_t global = c.micro * c.accum * world;
  for (int64_t s = 0; s < c.steps; ++s) {
    const double divisor = static_cast<double>(test::make_batch(c.model, s, 0, global).tokens());
    for (int64_t m = 0; m < c.accum; ++m) {
      test::Batch b = test::make_batch(c.model, s, (m * world + rank) * c.micro, c.micro);
      at::Tensor loss = model->loss_sum(b.inputs, b.labels);
      if (c.token_norm) {
        engine.backward(loss, divisor);
      } else {
        engine.backward(loss / static_cast<double>(std::max<int64_t>(1, b.tokens())));
      }
      bool stepped = engine.step();
      REQUIRE(stepped == (m == c.accum - 1));
    }
    REQUIRE_FALSE(engine.last_step_skipped());
    norms.push_back(engine.last_grad_norm());
  }
  auto params = engine.gather_full_parameters();
  if (rank == 0) REQUIRE(compare(c, norms, params));
}

Case make_case(int stage, int world, int accum, const char* dtype, bool offload, const char* model,
               const char* opt, bool ckpt) {
  Case c;
  c.stage = stage;
  c.world = world;
  c.accum = accum;
  c.dtype = dtype;
  c.offload = offload;
  c.model = model;
  c.opt = opt;
  c.ckpt = ckpt;
  return c;
}

void run_case(const Case& c) {
  if (c.device == "cpu" && skip_cpu_world(c.world)) return;
  INFO(c.describe());
  // A MiCS or hpZ group is a node of its own (on the emulated GPU tier each rank plays a host,
  // whose groups would otherwise straddle nodes and be refused).
  Env env{{"ZT_CASE", c.encode()}};
  const int group = std::max(c.mics, c.hpz);
  if (group > 1) env.emplace_back("ZT_RANKS_PER_NODE", std::to_string(group));
  test::run_ranks(c.world, "rank: engine equivalence", std::chrono::seconds(240), env,
                  c.device == "cuda" && test::gpu_ranks_share_a_gpu(c.world));
}

}  // namespace zt::test
