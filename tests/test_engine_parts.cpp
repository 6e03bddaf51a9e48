// Engine building blocks on their own: the loss scaler's rule, LR schedules against their
// formulas, the CPU Adam kernel against torch::optim::AdamW, weight-decay naming, layouts, and
// the host worker threads.
#include "support/catch.hpp"

#include <torch/optim/adamw.h>

#include <ATen/Parallel.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adam_cpu.hpp"
#include "optim/schedule.hpp"
#include "optim/shard_optimizer.hpp"
#include "precision/loss_scaler.hpp"
#include "util/threads.hpp"
#include "zero/layout.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"

using namespace zt;

namespace {

LossScalerParams scaler_params(double initial, int64_t window, int64_t hysteresis, bool consecutive,
                               double min_scale) {
  LossScalerParams p;
  p.initial_scale = initial;
  p.scale_window = window;
  p.hysteresis = hysteresis;
  p.consecutive_hysteresis = consecutive;
  p.min_scale = min_scale;
  return p;
}

std::vector<double> run_scaler(LossScaler& s, const std::vector<bool>& overflows) {
  std::vector<double> out;
  for (bool o : overflows) {
    s.update(o);
    out.push_back(s.scale());
  }
  return out;
}

}  // namespace

TEST_CASE("loss scaler: growth after the window, hysteresis delays the decrease", "[scaler]") {
  // Hand-worked from DeepSpeed's rule: window 3 counts from last_overflow_iter = -1, so the
  // first doubling is at iteration 2; hysteresis 2 absorbs one overflow before halving.
  LossScaler s(scaler_params(16, 3, 2, false, 1));
  std::vector<bool> overflow = {false, false, false, true, true, false, true, false, false, false};
  std::vector<double> expected = {16, 16, 32, 32, 16, 16, 8, 8, 8, 16};
  CHECK(run_scaler(s, overflow) == expected);
}

TEST_CASE("loss scaler: consecutive hysteresis re-arms after any good step", "[scaler]") {
  LossScaler s(scaler_params(16, 100, 2, true, 1));
  // Without re-arming, the second lone overflow would halve; with it, each is absorbed.
  std::vector<double> got = run_scaler(s, {true, false, true, false, true, true});
  CHECK(got == std::vector<double>({16, 16, 16, 16, 16, 8}));
  LossScaler plain(scaler_params(16, 100, 2, false, 1));
  CHECK(run_scaler(plain, {true, false, true}) == std::vector<double>({16, 16, 8}));
}

TEST_CASE("loss scaler: DeepSpeed's defaults without scaler keys halve at once from 2^32",
          "[scaler]") {
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"fp16": {"enabled": true}})");
  LossScaler s(ds.fp16.scaler());
  CHECK(s.scale() == std::ldexp(1.0, 32));
  s.update(true);
  CHECK(s.scale() == std::ldexp(1.0, 31));
}

TEST_CASE("loss scaler: an overflow at the minimum scale is a NumericError", "[scaler]") {
  LossScaler s(scaler_params(2, 1000, 1, false, 1));
  s.update(true);
  CHECK(s.scale() == 1.0);
  CHECK_THROWS_AS(s.update(true), NumericError);
  LossScaler fixed;  // static scale 1: never changes
  fixed.update(true);
  CHECK(fixed.scale() == 1.0);
}

TEST_CASE("DeepSpeed schedules follow their formulas", "[schedule]") {
  TrainingArguments args;
  auto sched = [&](const char* json) {
    DeepSpeedConfig ds = parse_deepspeed_config(json);
    resolve_config(ds, args, ResolveContext{1, 8, 100});
    return LrSchedule::from_config(ds, args, 100);
  };
  // WarmupLR, log warmup over 10 steps from 0.001 to 0.01; the k-th step uses iteration k-1.
  LrSchedule warm = sched(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
      "warmup_max_lr": 0.01, "warmup_num_steps": 10}}})");
  CHECK(warm.lr(0) == Approx(0.001));
  CHECK(warm.lr(1) == Approx(0.001));  // log(1) = 0
  CHECK(warm.lr(2) == Approx(0.001 + 0.009 * std::log(2.0) / std::log(10.0)));
  CHECK(warm.lr(11) == Approx(0.01));
  CHECK(warm.lr(50) == Approx(0.01));
  // WarmupDecayLR, linear warmup 10, total 20.
  LrSchedule decay = sched(R"({"scheduler": {"type": "WarmupDecayLR", "params": {
      "warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "total_num_steps": 20,
      "warmup_type": "linear"}}})");
  CHECK(decay.lr(6) == Approx(0.1 * 5 / 10.0));
  CHECK(decay.lr(16) == Approx(0.1 * (20 - 15) / 10.0));
  CHECK(decay.lr(25) == Approx(0.0));
  // WarmupCosineLR: ratio of the optimizer's lr; 0 before the first step.
  LrSchedule cosine = sched(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.2}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 4,
      "total_num_steps": 12, "warmup_type": "linear", "cos_min_ratio": 0.1}}})");
  CHECK(cosine.lr(0) == 0.0);
  CHECK(cosine.lr(3) == Approx(0.2 * 2 / 4.0));
  const double pi = std::acos(-1.0);
  CHECK(cosine.lr(9) == Approx(0.2 * (0.1 + 0.9 * (1 + std::cos(pi * 5 / 8.0)) / 2)));
  // LRRangeTest: min_lr · (1 + rate · (it + 1) / step_size).
  LrSchedule range = sched(R"({"scheduler": {"type": "LRRangeTest", "params": {
      "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2}}})");
  CHECK(range.lr(0) == Approx(0.01));
  CHECK(range.lr(3) == Approx(0.01 * (1 + 2 * 3 / 4.0)));
  // OneCycle: up over the first 10, down over the next 10, then the floor.
  LrSchedule one = sched(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
      "cycle_max_lr": 0.11, "cycle_first_step_size": 10, "cycle_momentum": false}}})");
  CHECK(one.lr(0) == Approx(0.01));
  CHECK(one.lr(5) == Approx(0.01 + 0.1 * 5 / 10.0));
  CHECK(one.lr(10) == Approx(0.11));
  CHECK(one.lr(15) == Approx(0.11 - 0.1 * 5 / 10.0));
  CHECK(one.lr(30) == Approx(0.01));
}

TEST_CASE("HF lr_scheduler_type schedules follow their formulas", "[schedule]") {
  DeepSpeedConfig ds;
  TrainingArguments args;
  args.learning_rate = 1.0;
  args.warmup_steps = 2;
  auto sched = [&](const char* type) {
    args.lr_scheduler_type = type;
    DeepSpeedConfig copy = ds;
    resolve_config(copy, args, ResolveContext{1, 8, 10});
    return LrSchedule::from_config(copy, args, 10);
  };
  LrSchedule linear = sched("linear");
  CHECK(linear.lr(0) == 0.0);
  CHECK(linear.lr(1) == Approx(0.5));
  CHECK(linear.lr(2) == Approx(1.0));
  CHECK(linear.lr(6) == Approx(0.5));
  CHECK(linear.lr(10) == Approx(0.0));
  LrSchedule cosine = sched("cosine");
  CHECK(cosine.lr(6) == Approx(0.5));
  CHECK(cosine.lr(4) == Approx(0.5 * (1 + std::cos(std::acos(-1.0) * 0.25))));
  LrSchedule warm = sched("constant_with_warmup");
  CHECK(warm.lr(1) == Approx(0.5));
  CHECK(warm.lr(9) == Approx(1.0));
  CHECK(sched("constant").lr(0) == 1.0);
  args.warmup_steps = 0;
  args.warmup_ratio = 0.25;  // ceil(0.25 × 10) = 3 warmup steps
  CHECK(sched("linear").lr(1) == Approx(1.0 / 3.0));
}

TEST_CASE("the CPU Adam kernel matches torch::optim::AdamW", "[optim]") {
  // Tolerance 1e-6 relative to max(1, |p|) after 6 steps (a few fp32 ulps): the same
  // operation order; only vectorized sqrt/division rounding may differ.
  at::manual_seed(7);
  const int64_t n = 100003;  // not a multiple of any vector width
  at::Tensor p0 = at::randn({n});
  at::Tensor ref = p0.clone().requires_grad_(true);
  torch::optim::AdamW opt(
      {ref}, torch::optim::AdamWOptions(3e-3).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1));
  ShardOptimizer mine(OptimizerType::kAdamW, p0.clone(), {Segment{0, n, true}});
  for (int step = 0; step < 6; ++step) {
    at::Tensor g = at::randn({n}) * (step + 1);
    ref.mutable_grad() = g.clone();
    opt.step();
    UpdateHyper h;
    h.lr = 3e-3;
    h.beta1 = 0.8;
    h.beta2 = 0.95;
    h.eps = 1e-6;
    h.weight_decay = 0.1;
    mine.step(g, h);
  }
  at::Tensor want = ref.detach();
  CHECK(((mine.master() - want).abs() / want.abs().clamp_min(1.0)).max().item<double>() < 1e-6);
  INFO("CPU Adam ISA: " << kernels::adam_cpu_isa());
  CHECK(std::string(kernels::adam_cpu_isa()).size() > 0);
}

TEST_CASE("the CPU Adam kernel's first touch zeroes every element, in groups and between them",
          "[optim]") {
  // Groups big enough for several threads each, with gaps before, between and after them.
  const int64_t n = 3'000'000;
  std::vector<std::vector<Segment>> groups{
      {Segment{100, 700'000, true}, Segment{700'200, 300'000, false}},
      {Segment{1'500'000, 1'200'000, true}}};
  std::vector<float> a(n, std::nanf("")), b(n, 5.0f);
  kernels::adam_cpu_first_touch({a.data(), b.data()}, n, groups);
  CHECK(std::all_of(a.begin(), a.end(), [](float x) { return x == 0.0f; }));
  CHECK(std::all_of(b.begin(), b.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("weight decay follows HF's name rules", "[engine]") {
  CHECK(applies_weight_decay("model.layers.0.self_attn.q_proj.weight"));
  CHECK(applies_weight_decay("lm_head.weight"));
  CHECK(applies_weight_decay("model.embed_tokens.weight"));
  CHECK_FALSE(applies_weight_decay("model.layers.0.self_attn.q_proj.bias"));
  CHECK_FALSE(applies_weight_decay("model.layers.3.input_layernorm.weight"));
  CHECK_FALSE(applies_weight_decay("model.norm.weight"));
  CHECK_FALSE(applies_weight_decay("transformer.encoder.final_layernorm.weight"));
  CHECK_FALSE(applies_weight_decay("model.layers.1.self_attn.q_norm.weight"));
  CHECK_FALSE(applies_weight_decay("blocks.0.ln1.bias"));
  CHECK(applies_weight_decay("normalizer.weight"));  // "norm" must be a whole component
}

TEST_CASE(
    "layouts: every parameter element is owned by exactly one rank's slice, a rank-local one's "
    "by one of the ranks holding it",
    "[engine]") {
  std::vector<int64_t> sizes = {7, 100, 3, 64, 1000, 1, 33};
  for (int stage : {0, 1, 2, 3}) {
    for (int world : {1, 2, 3, 4}) {
      std::vector<int64_t> owned(sizes.size(), 0);
      int64_t state = -1;
      for (int rank = 0; rank < world; ++rank) {
        std::vector<zero::ParamInfo> params;
        for (size_t i = 0; i < sizes.size(); ++i) {
          zero::ParamInfo p;
          p.name = "p" + std::to_string(i) + (i % 3 == 0 ? ".bias" : ".weight");
          p.numel = sizes[i];
          p.trainable = i != 2;
          p.decay = applies_weight_decay(p.name);
          p.unit = static_cast<int>(i % 2);
          p.rank_local = i == 4 || i == 6;  // an expert-parallel rank's own experts
          params.push_back(p);
        }
        zero::LayoutOptions o;
        o.stage = stage;
        o.world = world;
        o.rank = rank;
        o.bucket_size = 120;
        o.persistence_threshold = 50;
        o.num_units = 2;
        // Expert parallelism of size 2 where the world is even (else the world): rank r's
        // peers hold its block too, every ep-th rank.
        const int ep = world % 2 == 0 ? 2 : world;
        o.local_peers = world / ep;
        o.local_place = rank / ep;
        zero::Layout L = zero::build_layout(params, o);
        if (state >= 0) CHECK(L.state_numel == state);  // equal slices on every rank
        state = L.state_numel;
        for (const zero::Bucket& b : L.buckets) {
          CHECK(b.numel % zero::kAlign == 0);
          if (!b.trainable) continue;
          for (int m : b.params) CHECK(b.local == params[static_cast<size_t>(m)].rank_local);
          if (b.local) {
            CHECK(b.replicated == (stage == 0));
            CHECK_FALSE(b.sharded_params);
            CHECK(b.shard.offset >= L.local_state_begin);
            CHECK(b.shard.offset + b.shard_numel <= L.local_state_end);
          }
          const int64_t lo = b.slice_begin(), hi = lo + b.shard_numel;
          for (size_t k = 0; k < b.params.size(); ++k) {
            CHECK(b.offsets[k] % zero::kAlign == 0);
            int64_t begin = std::max(lo, b.offsets[k]);
            int64_t end = std::min(hi, b.offsets[k] + sizes[static_cast<size_t>(b.params[k])]);
            if (end > begin) owned[static_cast<size_t>(b.params[k])] += end - begin;
          }
        }
        // Segments stay inside the state and cover only owned elements.
        int64_t covered = 0;
        for (const Segment& s : L.segments) {
          CHECK(s.offset >= 0);
          CHECK(s.offset + s.length <= L.state_numel);
          covered += s.length;
        }
        CHECK(covered <= L.state_numel);
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (i == 2) continue;  // frozen: no optimizer state
        INFO("stage " << stage << " world " << world << " param " << i);
        // A rank-local parameter: each of the ep blocks (the same sizes here) once among its
        // peers, or whole on every rank on stage 0.
        const int ep = world % 2 == 0 ? 2 : world;
        const bool local = i == 4 || i == 6;
        CHECK(owned[i] == sizes[i] * (stage == 0 ? world : local ? ep : 1));
      }
    }
  }
}

TEST_CASE("host work takes the rank's share of the cores, not OMP_NUM_THREADS", "[engine][optim]") {
  // Launchers set OMP_NUM_THREADS=1; the offloaded optimizer must still use the machine.
  const char* saved = std::getenv("LOCAL_WORLD_SIZE");
  const std::string keep = saved ? saved : "";
  ::unsetenv("ZT_CPU_THREADS");
  ::setenv("LOCAL_WORLD_SIZE", "1", 1);
  const int all = zt::cpu_worker_threads();
  CHECK(all >= 1);
  CHECK(all >= at::get_num_threads());
  ::setenv("LOCAL_WORLD_SIZE", "60000", 1);  // more ranks than cores: LibTorch's count, at least 1
  CHECK(zt::cpu_worker_threads() == std::max(1, at::get_num_threads()));
  ::setenv("ZT_CPU_THREADS", "5", 1);
  CHECK(zt::cpu_worker_threads() == 5);
  for (const char* bad : {"0", "-2", "many", ""}) {
    ::setenv("ZT_CPU_THREADS", bad, 1);
    CHECK(zt::cpu_worker_threads() == std::max(1, at::get_num_threads()));  // ignored
  }
  ::unsetenv("ZT_CPU_THREADS");
  if (saved) {
    ::setenv("LOCAL_WORLD_SIZE", keep.c_str(), 1);
  } else {
    ::unsetenv("LOCAL_WORLD_SIZE");
  }
  // The update is the same whatever the thread count (each element on its own).
  at::Tensor p0 = at::randn({1 << 20}), g = at::randn({1 << 20});
  at::Tensor p[2], m[2], v[2];
  for (int k = 0; k < 2; ++k) {
    ::setenv("ZT_CPU_THREADS", k == 0 ? "1" : "3", 1);
    p[k] = p0.clone();
    m[k] = at::zeros_like(p0);
    v[k] = at::zeros_like(p0);
    UpdateHyper h;
    h.lr = 1e-3;
    h.weight_decay = 0.01;
    zt::kernels::adam_cpu(p[k].data_ptr<float>(), g.data_ptr<float>(), m[k].data_ptr<float>(),
                          v[k].data_ptr<float>(), p0.numel(), h);
  }
  ::unsetenv("ZT_CPU_THREADS");
  CHECK(at::equal(p[0], p[1]));
  CHECK(at::equal(v[0], v[1]));
}

TEST_CASE("parallel ranges cover every index once, also nested and from two threads at once",
          "[engine]") {
  // Each call hands out [0, n) in ranges; a slot counts how often its index was visited.
  auto cover = [](int64_t n, int64_t threads) {
    std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
    for (auto& s : seen) s.store(0);
    zt::parallel_ranges(n, threads, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
    });
    for (const auto& s : seen) {
      if (s.load() != 1) return false;
    }
    return true;
  };
  for (int64_t n : {1, 2, 3, 7, 64, 1000}) {
    for (int64_t threads : {1, 2, 3, 8, 16}) {
      INFO("n " << n << ", threads " << threads);
      for (int repeat = 0; repeat < 20; ++repeat) REQUIRE(cover(n, threads));
    }
  }
  // A range that starts its own parallel work runs it inline, without deadlock.
  std::atomic<int64_t> inner{0};
  zt::parallel_ranges(4, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      zt::parallel_ranges(10, 4, [&](int64_t a, int64_t b) { inner.fetch_add(b - a); });
    }
  });
  CHECK(inner.load() == 40);
  // Two threads submitting at once each get all their ranges.
  std::atomic<bool> ok0{true}, ok1{true};
  std::thread other([&] {
    for (int r = 0; r < 200; ++r) ok1 = ok1 && cover(100, 5);
  });
  for (int r = 0; r < 200; ++r) ok0 = ok0 && cover(77, 3);
  other.join();
  CHECK(ok0.load());
  CHECK(ok1.load());
}

TEST_CASE("a forked process gets its own parallel-ranges workers", "[engine]") {
  std::atomic<int64_t> before{0};
  zt::parallel_ranges(
      8, 4, [&](int64_t lo, int64_t hi) { before.fetch_add(hi - lo); });  // the pool exists
  REQUIRE(before.load() == 8);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // fork() copied the parent's pool but none of its workers. With workers of its own the
    // ranges meet on two threads at once; without, the caller runs them one after the other
    // and the first waits in vain.
    std::atomic<int64_t> n{0};
    std::atomic<int> inside{0};
    std::atomic<bool> waited_in_vain{false};
    zt::parallel_ranges(2, 2, [&](int64_t lo, int64_t hi) {
      inside.fetch_add(1);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (inside.load() < 2) {
        if (std::chrono::steady_clock::now() > give_up) {
          waited_in_vain = true;
          break;
        }
        std::this_thread::yield();
      }
      n.fetch_add(hi - lo);
    });
    ::_exit(n.load() == 2 && !waited_in_vain.load() ? 0 : 1);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (::waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      FAIL("the forked process hung in parallel_ranges");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
