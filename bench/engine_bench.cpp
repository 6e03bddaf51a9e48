// Engine benchmarks for the GPU machine; one `RESULT {json}` line per measurement.
//
//   zt_bench_engine overhead   step time of zt::Engine (world 1, stages 0-3, offload) against a
//                              plain LibTorch mixed-precision loop on the same model
//   zt_bench_engine adamw      CPU AdamW throughput: zerotrain's kernel vs LibTorch's fused CPU
//                              AdamW where it exists, on all cores
//   zt_bench_engine copies     pinned host<->device copy bandwidth
//
// The model is a stack of residual MLP blocks (hidden 2048, ffn 8192: 33.6M parameters per
// block) in bf16 — the shape of an LLM's MLP half, with no attention so that the measurement is
// the engine's overhead around dense GEMMs.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/adam_cpu.hpp"
#include "optim/shard_optimizer.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"

using namespace zt;
using Clock = std::chrono::steady_clock;

namespace {

struct Block : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  Block(int64_t h, int64_t f) {
    up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(h, f).bias(false)));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(f, h).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down->forward(at::gelu(up->forward(x))); }
};

struct Stack : torch::nn::Module {
  UnitGate gate;
  std::vector<std::shared_ptr<Block>> blocks;
  torch::nn::ModuleList list{nullptr};
  Stack(int layers, int64_t h, int64_t f) {
    list = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(std::make_shared<Block>(h, f));
      list->push_back(blocks.back());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      x = gate(i, {x}, [b = blocks[i]](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{b->forward(in[0])};
      })[0];
    }
    return x;
  }
  std::vector<UnitSpec> units() {
    std::vector<UnitSpec> u;
    for (size_t i = 0; i < blocks.size(); ++i)
      u.push_back({"layer" + std::to_string(i), blocks[i]});
    return u;
  }
};

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// A plain mixed-precision loop with the engine's math: bf16 weights and gradients, fp32 masters,
// global-norm clipping at 1.0 when `clip` (what clip_grad_norm_ does: per-tensor norms, their
// norm, one scale of every gradient), LibTorch's fused AdamW (or ATen ops where there is none),
// weights refreshed from the masters.
double plain_step_seconds(int layers, int64_t h, int64_t f, const at::Tensor& input, int steps,
                          bool clip) {
  at::manual_seed(0);
  auto model = std::make_shared<Stack>(layers, h, f);
  model->to(input.device(), at::kBFloat16);
  std::vector<at::Tensor> params = model->parameters(), masters, ms, vs, grads32;
  for (auto& p : params) {
    masters.push_back(p.detach().to(at::kFloat));
    ms.push_back(at::zeros_like(masters.back()));
    vs.push_back(at::zeros_like(masters.back()));
  }
  at::Tensor step = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(input.device()));
  double total = 0;
  for (int s = 0; s < steps + 2; ++s) {
    sync(input.device());
    auto t0 = Clock::now();
    at::Tensor loss = model->forward(input).to(at::kFloat).pow(2).mean();
    loss.backward();
    grads32.clear();
    for (auto& p : params) grads32.push_back(p.grad().to(at::kFloat));
    if (clip) {
      std::vector<at::Tensor> norms;
      for (auto& g : grads32) norms.push_back(g.norm());
      at::Tensor coef = (1.0 / (at::stack(norms).norm() + 1e-6)).clamp_max(1.0);
      for (auto& g : grads32) g.mul_(coef);
    }
    step.add_(1);
    if (compat::has_fused_adamw(input.device())) {
      compat::fused_adamw(masters, grads32, ms, vs, step, 1e-5, 0.9, 0.999, 0.0, 1e-8);
    } else {
      for (size_t i = 0; i < masters.size(); ++i) {
        ms[i].mul_(0.9).add_(grads32[i], 0.1);
        vs[i].mul_(0.999).addcmul_(grads32[i], grads32[i], 0.001);
        masters[i].addcdiv_(ms[i], vs[i].sqrt().add_(1e-8), -1e-5);
      }
    }
    {
      at::NoGradGuard ng;
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(masters[i]);
        params[i].mutable_grad().reset();
      }
    }
    sync(input.device());
    if (s >= 2) total += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return total / steps;
}

double engine_step_seconds(int layers, int64_t h, int64_t f, const at::Tensor& input, int steps,
                           int stage, bool offload, std::shared_ptr<Communicator> comm,
                           EngineMemory* memory) {
  at::manual_seed(0);
  auto model = std::make_shared<Stack>(layers, h, f);
  std::string off =
      offload ? R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})" : "";
  if (offload && stage == 3) off += R"(, "offload_param": {"device": "cpu", "pin_memory": true})";
  DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
      R"({{"bf16": {{"enabled": true}}, "gradient_clipping": 1.0,
          "zero_optimization": {{"stage": {}, "reduce_bucket_size": "auto",
                                "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"{}}}}})",
      stage, off));
  TrainingArguments args;
  args.per_device_train_batch_size = input.size(0);
  args.learning_rate = 1e-5;
  args.lr_scheduler_type = "constant";
  resolve_config(ds, args, ResolveContext{comm->world_size(), h, steps + 2});
  EngineOptions eo;
  eo.device = input.device();
  eo.units = model->units();
  eo.gate = &model->gate;
  eo.total_train_steps = steps + 2;
  Engine engine(model, ds, comm, eo);
  double total = 0;
  for (int s = 0; s < steps + 2; ++s) {
    sync(input.device());
    auto t0 = Clock::now();
    at::Tensor loss = model->forward(input).to(at::kFloat).pow(2).mean();
    engine.backward(loss);
    engine.step();
    sync(input.device());
    if (s >= 2) total += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  if (memory) *memory = engine.memory();
  return total / steps;
}

int overhead() {
  const bool cuda = at::getNumGPUs() > 0;
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const int layers = env_int("ZT_BENCH_LAYERS", cuda ? 8 : 2);
  const int64_t h = env_int("ZT_BENCH_HIDDEN", cuda ? 2048 : 256);
  const int64_t f = 4 * h;
  const int64_t tokens = env_int("ZT_BENCH_TOKENS", cuda ? 8192 : 256);
  const int steps = env_int("ZT_BENCH_STEPS", cuda ? 10 : 3);
  at::Tensor input =
      at::randn({tokens, h}, at::TensorOptions().dtype(at::kBFloat16).device(device));
  CommOptions co;
  co.device = device;
  std::shared_ptr<Communicator> comm = create_communicator(LaunchEnv{}, co);
  const double params = static_cast<double>(layers) * 2.0 * static_cast<double>(h * f);
  const double unclipped = plain_step_seconds(layers, h, f, input, steps, false);
  std::printf(
      "RESULT %s\n",
      fmt::format(
          R"J({{"bench": "overhead", "variant": "plain LibTorch loop without clipping", "params": {}, "tokens": {}, "step_s": {:.5f}}})J",
          params, tokens, unclipped)
          .c_str());
  const double plain = plain_step_seconds(layers, h, f, input, steps, true);
  std::printf(
      "RESULT %s\n",
      fmt::format(
          R"J({{"bench": "overhead", "variant": "plain LibTorch loop", "params": {}, "tokens": {}, "step_s": {:.5f}}})J",
          params, tokens, plain)
          .c_str());
  struct Variant {
    int stage;
    bool offload;
  };
  for (Variant v : {Variant{0, false}, Variant{1, false}, Variant{2, false}, Variant{3, false},
                    Variant{2, true}, Variant{3, true}}) {
    EngineMemory m;
    double t = engine_step_seconds(layers, h, f, input, steps, v.stage, v.offload, comm, &m);
    std::printf(
        "RESULT %s\n",
        fmt::format(
            R"J({{"bench": "overhead", "variant": "engine stage {}{}", "params": {}, "step_s": {:.5f}, "overhead_pct": {:.2f}, "engine_bytes": {}}})J",
            v.stage, v.offload ? " + offload" : "", params, t, 100.0 * (t - plain) / plain,
            m.compute_params + m.gradients + m.optimizer_state)
            .c_str());
    std::fflush(stdout);
  }
  return 0;
}

int adamw() {
  // The step is memory-bound, so machine noise is a few percent: ours and LibTorch's run
  // interleaved, ZT_BENCH_ITERS times each (default 15) after a warm-up, and both the median
  // and the best run are reported. Ours runs twice: on the arrays LibTorch allocated and filled
  // (its threads touched their pages first), and on copies placed as the engine places offloaded
  // state (kernels::adam_cpu_first_touch: first written by the threads, in the ranges, that
  // update them) — the number that holds for zerotrain's offloaded steps.
  const int64_t n = env_int("ZT_BENCH_ADAM_MILLIONS", 268) * int64_t{1000000};
  const int iters = env_int("ZT_BENCH_ITERS", 15);
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor p = at::randn({n}, o), g = at::randn({n}, o), m = at::zeros({n}, o),
             v = at::zeros({n}, o);
  std::vector<at::Tensor> placed;  // p, g, m, v again, first touched by the kernel's threads
  for (const at::Tensor& t : {p, g, m, v}) {
    at::Tensor copy = at::empty({n}, o);
    kernels::adam_cpu_first_touch({copy.data_ptr<float>()}, n, {{Segment{0, n, true}}});
    placed.push_back(copy.copy_(t));
  }
  int64_t step = 0, placed_step = 0;
  UpdateHyper hyper;
  hyper.lr = 1e-4;
  hyper.weight_decay = 0.01;
  at::Tensor s = at::zeros({}, o);
  const bool with_torch = compat::has_fused_adamw(at::kCPU);
  auto ours = [&] {
    hyper.step = ++step;
    kernels::adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                      v.data_ptr<float>(), n, hyper);
  };
  auto ours_placed = [&] {
    hyper.step = ++placed_step;
    kernels::adam_cpu(placed[0].data_ptr<float>(), placed[1].data_ptr<float>(),
                      placed[2].data_ptr<float>(), placed[3].data_ptr<float>(), n, hyper);
  };
  auto theirs = [&] {
    s.add_(1);
    compat::fused_adamw({p}, {g}, {m}, {v}, s, 1e-4, 0.9, 0.999, 0.01, 1e-8);
  };
  auto seconds = [](auto&& fn) {
    auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  ours();  // warm-up
  ours_placed();
  if (with_torch) theirs();
  std::vector<double> t_ours, t_placed, t_theirs;
  for (int i = 0; i < iters; ++i) {
    t_ours.push_back(seconds(ours));
    t_placed.push_back(seconds(ours_placed));
    if (with_torch) t_theirs.push_back(seconds(theirs));
  }
  auto report = [&](const std::string& impl, int64_t threads, std::vector<double> t) {
    std::sort(t.begin(), t.end());
    std::printf(
        "RESULT %s\n",
        fmt::format(
            R"J({{"bench": "cpu_adamw", "impl": "{}", "threads": {}, "params": {}, "runs": {}, "gparams_per_s": {:.3f}, "best_gparams_per_s": {:.3f}}})J",
            impl, threads, n, t.size(), n / t[t.size() / 2] / 1e9, n / t.front() / 1e9)
            .c_str());
  };
  const int64_t threads = kernels::adam_cpu_threads(n);
  report(fmt::format("zerotrain ({})", kernels::adam_cpu_isa()), threads, t_ours);
  report(
      fmt::format("zerotrain ({}), state placed as the engine places it", kernels::adam_cpu_isa()),
      threads, t_placed);
  if (with_torch) report("LibTorch fused", at::get_num_threads(), t_theirs);
  return 0;
}

int copies() {
  if (at::getNumGPUs() == 0) {
    std::printf("RESULT {\"bench\": \"copies\", \"skipped\": \"no GPU\"}\n");
    return 0;
  }
  const int64_t bytes = int64_t{1} << 30;
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  at::Tensor dev = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0));
  host.fill_(1);
  for (int dir = 0; dir < 2; ++dir) {
    auto run = [&] { dir == 0 ? dev.copy_(host, true) : host.copy_(dev, true); };
    run();
    torch::cuda::synchronize();
    auto t0 = Clock::now();
    for (int i = 0; i < 5; ++i) run();
    torch::cuda::synchronize();
    double s = std::chrono::duration<double>(Clock::now() - t0).count() / 5;
    std::printf("RESULT %s\n",
                fmt::format(R"J({{"bench": "copies", "direction": "{}", "gb_per_s": {:.1f}}})J",
                            dir == 0 ? "host_to_device" : "device_to_host", bytes / s / 1e9)
                    .c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "all";
  int rc = 0;
  if (what == "overhead" || what == "all") rc |= overhead();
  if (what == "adamw" || what == "all") rc |= adamw();
  if (what == "copies" || what == "all") rc |= copies();
  return rc;
}
