// zerotrain demo: a small but real data-parallel job on the embedded default config.
//
// Until the trainer exists, the demo trains a linear regression with the ZeRO-2 data path done
// by hand on the public Communicator: each rank computes gradients on its slice of the global
// batch, the gradients are reduce-scattered so each rank owns one shard, the global norm is
// clipped across shards, each rank updates its shard and the parameters are all-gathered. At the
// end rank 0 replays the same steps in one process and checks that the weights agree — the
// world size does not change the math.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/launch.hpp"
#include "zerotrain/log.hpp"

namespace zt::cli {
namespace {

// The embedded default: "auto" values as HF users write them, resolved below.
const char* kDemoConfig = R"({
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}
})";

constexpr int64_t kFeatures = 64;   // the "hidden size" that resolves the bucket size
constexpr int64_t kSamples = 4096;

struct Problem {
  at::Tensor x, y;
};

// Generated on the CPU (the same numbers on every rank and device), then moved.
Problem make_problem(int64_t seed, at::Device device) {
  at::manual_seed(static_cast<uint64_t>(seed));
  at::Tensor w_true = at::randn({kFeatures}, at::kDouble);
  at::Tensor x = at::randn({kSamples, kFeatures}, at::kDouble);
  at::Tensor y = at::mv(x, w_true) + 0.01 * at::randn({kSamples}, at::kDouble);
  return {x.to(device), y.to(device)};
}

// Indices of global step `step`, micro-step `micro`, for `rank`: the global batch is cut into
// accumulation × world micro-batches; rank r takes every world-th sample (a distributed sampler).
at::Tensor batch_indices(int64_t step, int64_t micro, int rank, int world, int64_t micro_bs,
                         int64_t accum) {
  int64_t global = micro_bs * accum * world;
  int64_t base = (step * global + micro * micro_bs * world) % kSamples;
  at::Tensor idx = at::arange(micro_bs, at::kLong) * world + rank + base;
  return idx.remainder(kSamples);
}

// Gradient and loss sum of 0.5·Σ(xw − y)² over the given rows.
std::pair<at::Tensor, double> grad_and_loss(const Problem& p, const at::Tensor& w,
                                            const at::Tensor& rows) {
  at::Tensor on_device = rows.to(p.x.device());
  at::Tensor xb = p.x.index_select(0, on_device);
  at::Tensor err = at::mv(xb, w) - p.y.index_select(0, on_device);
  return {at::mv(xb.t(), err), 0.5 * err.pow(2).sum().item<double>()};
}

double clip_coefficient(double norm, double max_norm) {
  return max_norm > 0.0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

// The same steps in one process: the reference the distributed run must match.
at::Tensor reference_run(const Problem& p, int world, int64_t micro_bs, int64_t accum,
                         int64_t steps, double lr, double max_norm) {
  at::Tensor w = at::zeros({kFeatures}, p.x.options());
  const double global = static_cast<double>(micro_bs * accum * world);
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor g = at::zeros_like(w);
    for (int64_t m = 0; m < accum; ++m) {
      for (int r = 0; r < world; ++r) {
        g += grad_and_loss(p, w, batch_indices(s, m, r, world, micro_bs, accum)).first / global;
      }
    }
    w -= lr * clip_coefficient(g.norm().item<double>(), max_norm) * g;
  }
  return w;
}

}  // namespace

int cmd_demo(const Args& in) {
  Args args = in;
  int nproc = at::getNumGPUs() > 0 ? static_cast<int>(at::getNumGPUs()) : 2;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--nproc_per_node") {
      nproc = std::atoi(args[i + 1].c_str());
      args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
      break;
    }
  }
  if (nproc < 1) throw ConfigError("--nproc_per_node must be at least 1");
  log_message(LogLevel::kInfo, "demo: starting " + std::to_string(nproc) + " ranks");
  Args command{self_path(), "demo-rank"};
  command.insert(command.end(), args.begin(), args.end());
  LocalLaunchOptions o;
  o.nproc = nproc;
  LaunchResult r = launch_local(command, o);
  if (!r.ok()) {
    log_message(LogLevel::kError, "demo failed\n" + r.summary());
    return 1;
  }
  return 0;
}

int cmd_demo_rank(const Args& args) {
  at::set_num_threads(1);
  TrainingArguments targs;
  // The demo's own defaults; flags given on the command line override them.
  apply_training_json(targs, R"({"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2,
      "learning_rate": 0.5, "max_grad_norm": 5.0, "max_steps": 60, "logging_steps": 10})",
                      "demo defaults");
  targs.given.clear();
  apply_training_flags(targs, args);
  DeepSpeedConfig ds = targs.deepspeed.empty() ? parse_deepspeed_config(kDemoConfig, "<demo config>")
                                               : deepspeed_config_for(targs);

  LaunchEnv env = launch_env_from_environment();
  // One rank per GPU when there are GPUs (NCCL), else CPU ranks (Gloo).
  const at::Device device = at::getNumGPUs() > 0
                                ? at::Device(at::kCUDA, static_cast<int16_t>(env.local_rank))
                                : at::Device(at::kCPU);
  CommOptions copts;
  copts.device = device;
  copts.timeout = std::chrono::seconds(targs.ddp_timeout);
  copts.rendezvous_timeout = std::chrono::seconds(targs.rendezvous_timeout);
  std::unique_ptr<Communicator> comm = create_communicator(env, copts);
  const int rank = comm->rank(), world = comm->world_size();

  resolve_config(ds, targs, ResolveContext{world, kFeatures, targs.max_steps});
  check_resolved(ds);
  const int64_t micro_bs = ds.train_micro_batch_size_per_gpu.value();
  const int64_t accum = ds.gradient_accumulation_steps.value();
  const double lr = ds.optimizer.lr.value();
  const double max_norm = ds.gradient_clipping.value();
  const int64_t steps = targs.max_steps;
  if (rank == 0) {
    std::printf("zerotrain demo: %d ranks (%s backend on %s), linear regression with %lld "
                "features\n%s\n",
                world, backend_name(comm->backend()), device.str().c_str(),
                static_cast<long long>(kFeatures), describe(ds).c_str());
  }

  // Each rank owns one padded shard of the parameters and of the reduced gradient.
  const int64_t shard = (kFeatures + world - 1) / world;
  const int64_t padded = shard * world;
  const Problem p = make_problem(targs.seed, device);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor w_full = at::zeros({padded}, p.x.options());
  at::Tensor w = w_full.narrow(0, 0, kFeatures);
  const double global = static_cast<double>(ds.train_batch_size.value());

  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor grads = at::zeros({padded}, p.x.options());
    double loss_sum = 0.0;
    for (int64_t m = 0; m < accum; ++m) {
      auto [g, l] = grad_and_loss(p, w, batch_indices(s, m, rank, world, micro_bs, accum));
      grads.narrow(0, 0, kFeatures) += g / global;
      loss_sum += l;
    }
    // fp32 on the wire, as a bf16/fp32 trainer would reduce.
    at::Tensor wire = grads.to(at::kFloat);
    at::Tensor my_grad = at::empty({shard}, f32);
    comm->reduce_scatter(my_grad, wire)->wait();
    at::Tensor stats = at::stack({my_grad.to(at::kDouble).pow(2).sum(),
                                  at::scalar_tensor(loss_sum, p.x.options())})
                           .to(at::kFloat);
    comm->all_reduce(stats)->wait();
    double norm = std::sqrt(stats[0].item<double>());
    double coef = clip_coefficient(norm, max_norm);
    at::Tensor my_w = w_full.narrow(0, rank * shard, shard).to(at::kFloat);
    my_w -= static_cast<float>(lr * coef) * my_grad;
    at::Tensor gathered = at::empty({padded}, f32);
    comm->all_gather(gathered, my_w)->wait();
    w_full.copy_(gathered);
    if (rank == 0 && ((s + 1) % targs.logging_steps == 0 || s == 0)) {
      std::printf("step %3lld  loss %.6f  grad_norm %.4f  lr %g\n", static_cast<long long>(s + 1),
                  stats[1].item<double>() / global, norm, lr);
      std::fflush(stdout);
    }
  }

  // Every rank must hold the same weights, and they must match the one-process replay.
  at::Tensor w32 = w.to(at::kFloat);
  at::Tensor from_root = w32.clone();
  comm->broadcast(from_root, 0)->wait();
  bool same = at::equal(from_root, w32);
  at::Tensor flag = at::full({1}, same ? 0 : 1, at::TensorOptions().dtype(at::kLong).device(device));
  comm->all_reduce(flag, ReduceOp::kMax)->wait();
  if (rank == 0) {
    at::Tensor ref = reference_run(p, world, micro_bs, accum, steps, lr, max_norm);
    double diff = (ref - w).abs().max().item<double>();
    std::printf("ranks agree on the weights: %s\nmax |w - single-process reference| = %.3g "
                "(fp32 communication; tolerance 1e-4)\n",
                flag.item<int64_t>() == 0 ? "yes" : "NO", diff);
    if (flag.item<int64_t>() != 0 || !(diff < 1e-4)) return 1;
    std::printf("demo OK\n");
  }
  comm->barrier();
  return flag.item<int64_t>() == 0 ? 0 : 1;
}

}  // namespace zt::cli
