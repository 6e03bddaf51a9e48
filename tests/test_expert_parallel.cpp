// Expert parallelism (moe.hpp, docs/model.md): a mixture whose experts are split over the ranks
// of a group, rows sent to their experts and back by all-to-all, against the same mixture whole
// in one process (world 1) — outputs, the inputs' and the experts' gradients — at world 2 and 4
// over real Gloo processes; the trainer's runs against world 1's; the settings it refuses.
#include "support/catch.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/blocks.hpp"
#include "model/layers.hpp"
#include "model/moe.hpp"
#include "quant/four_bit_weight.hpp"
#include "support/forwarding_comm.hpp"
#include "support/jobs.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;

namespace {

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// The largest difference relative to the reference's largest value (at least 1): fp32 on a GPU
// against the CPU's reference rounds differently.
double relative(const at::Tensor& got, const at::Tensor& want) {
  return max_abs(got.cpu(), want) / std::max(1.0, want.abs().max().item<double>());
}

// The mixtures the rank test shards: softmax routing (Qwen3-MoE), gpt-oss's biased [E, in, out]
// experts with the clamped SwiGLU, GLM-4.5's sigmoid groups with a shared expert, and 4-bit
// experts (QLoRA).
struct Case {
  const char* name;
  model::MoeSpec spec;
  bool four_bit = false;
};

std::vector<Case> cases() {
  model::MoeSpec qwen{8, 2, 16, true, model::Activation::kSilu};
  model::MoeSpec oss = qwen;
  oss.router = model::MoeSpec::Router::kTopKSoftmax;
  oss.router_bias = oss.transposed = oss.expert_bias = oss.clamped_swiglu = true;
  model::MoeSpec glm = qwen;
  glm.router = model::MoeSpec::Router::kSigmoidGroups;
  glm.groups = 4;
  glm.top_groups = 2;
  glm.scaling = 2.5;
  glm.shared_intermediate = 16;
  return {
      {"qwen3_moe", qwen}, {"gpt_oss", oss}, {"glm4_moe", glm}, {"qwen3_moe 4-bit", qwen, true}};
}

// The mixture of `spec` (sharded as spec says) with values from one seed whatever the shard: each
// parameter of the whole mixture drawn in full, a shard taking its experts' rows.
std::shared_ptr<model::SparseMoe> seeded_mixture(const model::MoeSpec& spec, bool four_bit,
                                                 int64_t hidden) {
  // Without double quantization each expert's blocks quantize alone, a shard's as the whole's
  // (double quantization's offset is the mean over the whole tensor's scales).
  static const QuantizationConfig nf4 = [] {
    QuantizationConfig q;
    q.double_quant = false;
    return q;
  }();
  model::ParamFactory o{at::TensorOptions().dtype(at::kFloat)};
  if (four_bit) o.quantization = &nf4;
  auto m = std::make_shared<model::SparseMoe>(spec, hidden, o);
  model::MoeSpec whole_spec = spec;
  whole_spec.shard_size = 1;
  whole_spec.shard_rank = 0;
  auto whole =
      std::make_shared<model::SparseMoe>(whole_spec, hidden, model::ParamFactory{o.options});
  at::NoGradGuard no_grad;
  at::manual_seed(17);
  for (auto& item : whole->named_parameters()) item.value().normal_(0.0, 0.4);
  const auto values = whole->named_parameters();
  const int64_t local = spec.local_experts();
  for (auto& item : m->named_parameters()) {
    at::Tensor full = values[item.key()];
    if (model::is_expert_tensor("mlp." + item.key())) {
      full = full.narrow(0, spec.shard_rank * local, local);
    }
    if (item.value().scalar_type() == at::kByte) {
      const size_t t = item.key().find("gate_up") != std::string::npos ? 0 : 1;
      const quant::FourBitLayout& layout = *m->experts->quantized[t];
      item.value().copy_(quant::quantize_weight(layout, full.reshape({layout.rows, layout.cols})));
    } else {
      item.value().copy_(full);
    }
  }
  return m;
}

// Rows of every rank, skewed so that some experts get none: the same on every rank.
at::Tensor all_rows(int world, int64_t per_rank, int64_t hidden) {
  at::manual_seed(23);
  at::Tensor x = at::randn({world * per_rank, hidden});
  x.narrow(1, 0, 2).mul_(3.0);
  return x;
}

}  // namespace

TEST_CASE("rank: an expert-parallel mixture", "[.rank]") {
  // ZT_EP_CUDA=1: over NCCL, the mixture on this rank's GPU (its LOCAL_RANK) in fp32.
  const bool cuda = std::getenv("ZT_EP_CUDA") != nullptr;
  const at::Device device =
      cuda ? at::Device(at::kCUDA, static_cast<int16_t>(std::atoi(std::getenv("LOCAL_RANK"))))
           : at::Device(at::kCPU);
  std::shared_ptr<Communicator> comm(test::join(cuda ? Backend::kNccl : Backend::kAuto, device));
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t ep = std::atoi(std::getenv("ZT_EP"));
  const int64_t hidden = 16, per_rank = 7;
  for (const Case& c : cases()) {
    INFO(c.name << ", rank " << rank << " of " << world << ", expert_parallel_size " << ep);
    // World 1's answer: the whole mixture over every rank's rows (4-bit: the same storage).
    model::MoeSpec whole_spec = c.spec;
    auto whole = seeded_mixture(whole_spec, c.four_bit, hidden);
    model::MoeSpec spec = c.spec;
    spec.shard_size = ep;
    spec.shard_rank = rank % ep;
    auto mine = seeded_mixture(spec, c.four_bit, hidden);
    mine->to(device);
    mine->comm = comm;
    const at::Tensor x0 = all_rows(world, per_rank, hidden);
    const at::Tensor probe = at::randn({world * per_rank, hidden});
    at::Tensor xw = x0.clone().requires_grad_(true);
    (whole->forward(xw) * probe).sum().backward();
    at::Tensor x = x0.narrow(0, rank * per_rank, per_rank).to(device, at::kFloat, false, true);
    x.requires_grad_(true);
    const at::Tensor y = mine->forward(x).cpu();
    (y * probe.narrow(0, rank * per_rank, per_rank)).sum().backward();
    // This rank's rows: their outputs and gradients.
    {
      at::NoGradGuard no_grad;
      const at::Tensor want = whole->forward(x0).narrow(0, rank * per_rank, per_rank);
      CHECK(relative(y, want) < 1e-5);
    }
    CHECK(relative(x.grad(), xw.grad().narrow(0, rank * per_rank, per_rank)) < 1e-5);
    // The router's gradient from this rank's rows, summed over ranks; this rank's experts'
    // gradients from its group's rows that chose them (the exchange's backward), summed over
    // the groups (the ranks holding the same experts).
    at::Tensor router = mine->gate->weight.grad().clone();
    comm->all_reduce(router)->wait();
    CHECK(relative(router, whole->gate->weight.grad()) < 1e-5);
    if (!c.four_bit) {
      const int64_t local = spec.local_experts();
      for (const char* t : {"gate_up_proj", "down_proj"}) {
        INFO(t);
        const at::Tensor grad = mine->experts->named_parameters()[t].grad().contiguous();
        at::Tensor every = at::empty({world * grad.numel()}, grad.options());
        comm->all_gather(every, grad)->wait();
        at::Tensor got = at::zeros_like(grad);
        for (int q = spec.shard_rank; q < world; q += static_cast<int>(ep)) {
          got += every.narrow(0, q * grad.numel(), grad.numel()).view(grad.sizes());
        }
        const at::Tensor want =
            whole->experts->named_parameters()[t].grad().narrow(0, spec.shard_rank * local, local);
        CHECK(relative(got, want) < 1e-5);
      }
    }
  }
  // A sharded mixture without its communicator says what to do.
  model::MoeSpec spec = cases()[0].spec;
  spec.shard_size = ep;
  auto lone = seeded_mixture(spec, false, hidden);
  CHECK_THROWS_WITH(lone->forward(at::randn({3, hidden})),
                    Catch::Contains("set_expert_communicator"));
}

TEST_CASE("expert parallelism over NCCL: world 2 and 4 give world 1's mixture", "[moe][gpu]") {
  // On the GPU machine (LibTorch with CUDA): ranks of their own nodes on GPU 0 where GPUs are
  // fewer (zt::emulated_node_env). Elsewhere there is no NCCL device to run on.
  if (at::getNumGPUs() == 0) {
    WARN("no GPU: expert parallelism over NCCL runs on the GPU machine");
    return;
  }
  for (const auto& [world, ep] : {std::pair<int, int>{2, 2}, {4, 2}}) {
    INFO("world " << world << ", expert_parallel_size " << ep);
    test::run_ranks(world, "rank: an expert-parallel mixture", std::chrono::seconds(240),
                    {{"ZT_EP", std::to_string(ep)}, {"ZT_EP_CUDA", "1"}},
                    test::gpu_ranks_share_a_gpu(world));
  }
}

TEST_CASE("expert parallelism: world 2 and 4 give world 1's mixture, outputs and gradients",
          "[moe][ranks]") {
  const std::pair<int, int> settings[] = {{2, 2}, {4, 4}, {4, 2}};
  for (const auto& [world, ep] : settings) {
    if (test::skip_cpu_world(world)) return;
    INFO("world " << world << ", expert_parallel_size " << ep);
    test::run_ranks(world, "rank: an expert-parallel mixture", std::chrono::seconds(180),
                    {{"ZT_EP", std::to_string(ep)}});
  }
}

namespace {

// Logs each all-to-all as issued and as waited for, and passes everything on.
class LoggingCommunicator final : public test::ForwardingCommunicator {
 public:
  LoggingCommunicator(std::shared_ptr<Communicator> inner, std::vector<std::string>& log)
      : ForwardingCommunicator(std::move(inner)), log_(log) {}

 protected:
  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& recv,
                      const std::vector<int64_t>& send) override {
    log_.emplace_back("issue");
    return std::make_unique<Logged>(ForwardingCommunicator::exchange(out, in, recv, send), log_);
  }

 private:
  struct Logged final : Work {
    Logged(WorkHandle w, std::vector<std::string>& log) : inner(std::move(w)), log(log) {}
    void wait() override {
      inner->wait();
      if (!waited) log.emplace_back("wait");
      waited = true;
    }
    void synchronize() override { wait(); }
    WorkHandle inner;
    std::vector<std::string>& log;
    bool waited = false;
  };
  std::vector<std::string>& log_;
};

// How many exchanges were issued and not yet waited for when `log[at]` happened.
int in_flight(const std::vector<std::string>& log, size_t at) {
  int n = 0;
  for (size_t k = 0; k < at; ++k) n += log[k] == "issue" ? 1 : log[k] == "wait" ? -1 : 0;
  return n;
}

}  // namespace

TEST_CASE("rank: shared experts beside the exchange", "[.rank]") {
  std::vector<std::string> log;
  auto comm =
      std::make_shared<LoggingCommunicator>(std::shared_ptr<Communicator>(test::join()), log);
  const int world = comm->world_size(), rank = comm->rank();
  model::MoeSpec spec = cases()[2].spec;  // GLM-4.5's, with a shared expert
  REQUIRE(spec.shared_intermediate > 0);
  spec.shard_size = world;
  spec.shard_rank = rank;
  auto mine = seeded_mixture(spec, false, 16);
  mine->comm = comm;
  // The shared expert's first weight marks when its gradient is computed.
  at::Tensor weight = mine->shared_experts->parameters()[0];
  weight.register_hook([&log](const at::Tensor& g) {
    log.emplace_back("shared backward");
    return g;
  });
  const at::Tensor x = all_rows(world, 7, 16).narrow(0, rank * 7, 7).clone().requires_grad_(true);
  const at::Tensor y = mine->forward(x);
  const size_t forward_end = log.size();
  y.sum().backward();
  INFO(fmt::format("rank {}: {}", rank, fmt::join(log, ", ")));
  // Forward: three exchanges (the counts, the rows out, the rows back), each waited for.
  CHECK(std::count(log.begin(), log.begin() + forward_end, "issue") == 3);
  CHECK(in_flight(log, forward_end) == 0);
  // Backward: the rows' gradients go back (two exchanges), and the shared expert's backward runs
  // while the first of them (the returning rows' gradients) is in flight. The autograd engine
  // runs the newest ready node first, so this also says that forward made the shared expert's
  // nodes between the return's start and finish (computed there, while the rows travelled).
  const auto shared = std::find(log.begin(), log.end(), "shared backward");
  REQUIRE(shared != log.end());
  CHECK(in_flight(log, static_cast<size_t>(shared - log.begin())) == 1);
  CHECK(std::count(log.begin() + forward_end, log.end(), "issue") == 2);
  CHECK(in_flight(log, log.size()) == 0);
}

TEST_CASE("expert parallelism: a mixture's shared experts compute while its rows travel",
          "[moe][ranks]") {
  if (test::skip_cpu_world(2)) return;
  test::run_ranks(2, "rank: shared experts beside the exchange", std::chrono::seconds(120));
}

// The last rank dies (SIGKILL-like, no goodbye) after a first step of an expert-parallel mixture;
// the others, exchanging rows with it, must end with a DistributedError naming it.
TEST_CASE("rank: an expert-parallel peer dies", "[.rank]") {
  std::shared_ptr<Communicator> comm(test::join());
  const int world = comm->world_size(), rank = comm->rank();
  model::MoeSpec spec = cases()[0].spec;
  spec.shard_size = world;
  spec.shard_rank = rank;
  auto mine = seeded_mixture(spec, false, 16);
  mine->comm = comm;
  const at::Tensor x = all_rows(world, 7, 16).narrow(0, rank * 7, 7);
  mine->forward(x).sum().backward();
  if (rank == world - 1) std::_Exit(17);
  const auto start = std::chrono::steady_clock::now();
  std::string caught;
  try {
    for (int i = 0; i < 100; ++i) mine->forward(x).sum().backward();
  } catch (const DistributedError& e) {
    caught = e.what();
  }
  const bool timely = std::chrono::steady_clock::now() - start < std::chrono::seconds(40);
  const bool named =
      caught.find("all_to_all") != std::string::npos &&
      caught.find(fmt::format("rank(s) {} stopped answering", world - 1)) != std::string::npos;
  std::printf("rank %d caught: %s\nnamed=%d timely=%d\n", rank, caught.c_str(), named, timely);
  std::fflush(stdout);
  std::_Exit(named && timely ? 0 : 1);  // destructors of a group with a dead member skipped
}

TEST_CASE("a rank that dies inside the experts' all-to-all is named by the others, no hang",
          "[moe][ranks][errors]") {
  for (int world : {2, 4}) {
    if (test::skip_cpu_world(world)) return;
    test::RankRun run =
        test::launch_ranks(world, "rank: an expert-parallel peer dies", std::chrono::seconds(120),
                           {{"ZT_TEST_TIMEOUT_MS", "10000"}}, std::chrono::seconds(60));
    test::check_last_rank_died(run, 17);
  }
}

namespace {

// The qwen3_moe trainer runs of the tests below: LoRA on q_proj and v_proj beside frozen experts,
// 4 rows a step at every world; under ZeRO-3 every parameter of 10 elements or more sharded (the
// experts would be, were they not each rank's own).
const std::string kEpModel = test::tiny_moe_config(8);

// The run of kind `kind`: "0", "2", "3" (the ZeRO stage), "3 offload" (stage 3 with parameters
// and optimizer offloaded), "q" (QLoRA at stage 2, without double quantization, so that a rank's
// experts quantize as the whole's do), "full 0", "full 2", "full 3 offload" (full fine-tuning:
// the experts trained too), "freeze" (the last layer's MLP — router and experts — trained),
// "dpo 2" and "dpo full 2" (DPO on ZT_EP_DIR/pairs.jsonl: LoRA, and full fine-tuning, whose
// reference is a swapped-in copy of the experts too), anything else stage 2.
std::vector<std::string> ep_run(int world, int ep, const std::string& kind) {
  const bool dpo = kind.rfind("dpo ", 0) == 0;
  const std::string rest = dpo ? kind.substr(4) : kind;
  const bool full = rest.rfind("full ", 0) == 0;
  const std::string stage = full ? rest.substr(5) : rest;
  std::vector<std::string> run{"--max_steps",
                               "4",
                               "--save_steps",
                               "100",
                               "--finetuning_type",
                               "lora",
                               "--lora_r",
                               "4",
                               "--lora_target",
                               "q_proj,v_proj",
                               "--gradient_accumulation_steps",
                               std::to_string(2 / std::min(world, 2)),
                               "--per_device_train_batch_size",
                               std::to_string(world == 4 ? 1 : 2),
                               "--expert_parallel_size",
                               std::to_string(ep)};
  const std::vector<std::string> zero = test::zero_stage_flags(stage);
  run.insert(run.end(), zero.begin(), zero.end());
  if (kind == "q") {
    run.insert(run.end(), {"--quantization_bit", "4", "--double_quantization", "false"});
  }
  if (full) run.insert(run.end(), {"--finetuning_type", "full", "--learning_rate", "2e-3"});
  if (dpo) {
    run.insert(run.end(), {"--stage", "dpo", "--train_file",
                           std::string(std::getenv("ZT_EP_DIR")) + "/pairs.jsonl"});
  }
  // The model itself at a rate where AdamW's near-sign updates of tiny gradients stay within the
  // saved model's tolerance (check_same_model) whatever the build's rounding.
  if (kind == "freeze") {
    run.insert(run.end(), {"--finetuning_type", "freeze", "--freeze_trainable_layers", "1",
                           "--freeze_trainable_modules", "mlp", "--learning_rate", "2e-3"});
  }
  return run;
}

// Two model files hold the same tensors, values equal to fp32 rounding over a few steps.
void check_same_model(const std::string& want_path, const std::string& got_path) {
  SafetensorsFile want(want_path), got(got_path);
  CHECK(want.names().size() == got.names().size());
  for (const std::string& name : want.names()) {
    INFO(got_path << ": " << name);
    REQUIRE(got.contains(name));
    const at::Tensor w = want.load(name, at::kFloat), g = got.load(name, at::kFloat);
    REQUIRE(w.sizes() == g.sizes());
    CHECK(relative(g, w) < 1e-4);
  }
}

}  // namespace

// One run per process (a job's communicator is made once): ZT_EP_CASE a kind of ep_run (under
// stage 3 each rank's experts stay whole on it, offloaded or not), "saved" (stage 2, a checkpoint
// at step 2), "full saved" (full fine-tuning at stage 2, a checkpoint at step 2), "full resumed"
// (full fine-tuning resumed from ZT_EP_RESUME), or a setting expert parallelism refuses.
TEST_CASE("rank: expert-parallel training", "[.rank]") {
  const std::string dir = std::getenv("ZT_EP_DIR"), which = std::getenv("ZT_EP_CASE");
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  const int ep = std::atoi(std::getenv("ZT_EP"));
  const std::string out =
      dir + "/out_" + std::to_string(world) + "_" + std::to_string(ep) + "_" + which;
  std::vector<std::string> run = ep_run(world, ep, which);
  run.insert(run.end(), {"--output_dir", out});
  if (which == "trained experts") {
    run.insert(run.end(), {"--lora_target_parameters", "experts.down_proj"});
    CHECK_THROWS_WITH(test::train_on_base(dir, run),
                      Catch::Contains("experts.") && Catch::Contains("adapter on the experts"));
    return;
  }
  if (which == "saved") run.insert(run.end(), {"--save_steps", "2"});
  if (which == "full saved") {
    run = ep_run(world, ep, "full 2");
    run.insert(run.end(), {"--output_dir", out, "--save_steps", "2"});
  }
  if (which == "full resumed") {
    run = ep_run(world, ep, "full 2");
    run.insert(run.end(),
               {"--output_dir", out, "--resume_from_checkpoint", std::getenv("ZT_EP_RESUME")});
  }
  // Full fine-tuning states the whole model's counts (every rank's experts), as world 1 does.
  std::vector<std::string> said;
  const LogLevel level = log_level();
  if (which == "full 2") {
    set_log_level(LogLevel::kInfo);  // the line is an info line, whatever ZT_LOG_LEVEL says
    set_log_sink([&](LogLevel, const std::string& message) { said.push_back(message); });
  }
  const std::vector<double> curve = test::train_on_base(dir, run);
  set_log_sink(nullptr);
  set_log_level(level);
  if (which == "full 2" && std::atoi(std::getenv("RANK")) == 0) {
    const std::string whole =
        count_parameters(CausalLM(parse_model_config(kEpModel, "ep.json"), at::TensorOptions()))
            .line();
    INFO("the counts of the whole model: " << whole);
    CHECK(std::any_of(said.begin(), said.end(),
                      [&](const std::string& m) { return m.find(whole) != std::string::npos; }));
  }
  test::write_curves(std::atoi(std::getenv("RANK")), {curve});
}

TEST_CASE(
    "expert-parallel LoRA and QLoRA train as world 1 does, stages 0-3 and offload, and resume",
    "[moe][ranks][trainer][slow]") {
  const std::string dir = test::temp_dir("expert_parallel");
  test::write_data(dir, "train.jsonl", 16, 9);
  test::write_model_folder(dir + "/base", kEpModel, 41);
  setenv("ZT_EP_DIR", dir.c_str(), 1);
  // World 1 without expert parallelism: the reference.
  test::write_pairs(dir, "pairs.jsonl", 16, 5);
  const std::vector<std::string> kinds{"0",      "2",      "3",         "3 offload",
                                       "q",      "full 0", "full 2",    "full 3 offload",
                                       "freeze", "dpo 2",  "dpo full 2"};
  std::vector<std::vector<double>> reference;
  for (const std::string& kind : kinds) {
    std::vector<std::string> run = ep_run(1, 1, kind);
    run.insert(run.end(), {"--output_dir", dir + "/ref_" + kind});
    reference.push_back(test::train_on_base(dir, run));
    REQUIRE(reference.back().size() == 4);
  }
  // What full and freeze fine-tuning write is the whole model: every rank's experts.
  const auto same_model = [&](int world, int ep, size_t k) {
    if (kinds[k].find("full") != std::string::npos || kinds[k] == "freeze") {
      const std::string out = fmt::format("{}/out_{}_{}_{}", dir, world, ep, kinds[k]);
      check_same_model(dir + "/ref_" + kinds[k] + "/model.safetensors", out + "/model.safetensors");
    }
  };
  if (!test::check_degree_sweep({"rank: expert-parallel training",
                                 "ZT_EP",
                                 "ZT_EP_CASE",
                                 "expert_parallel_size",
                                 {{2, 2}, {4, 4}, {4, 2}},
                                 kinds,
                                 reference},
                                1e-4, same_model)) {
    return;
  }
  // A run saved at world 4 with expert_parallel_size 2 resumes at world 1 without it: the
  // remaining steps are those of world 1's uninterrupted run.
  setenv("ZT_EP", "2", 1);
  setenv("ZT_EP_CASE", "saved", 1);
  REQUIRE(test::curves_at_world(4, "rank: expert-parallel training", std::chrono::seconds(300))
              .size() == 1);
  std::vector<std::string> resumed = ep_run(1, 1, "2");
  const std::string saved = dir + "/out_4_2_saved";
  resumed.insert(resumed.end(), {"--output_dir", dir + "/resumed", "--resume_from_checkpoint",
                                 saved + "/checkpoint-2"});
  const std::vector<double> rest = test::train_on_base(dir, resumed);
  REQUIRE(rest.size() == 2);
  for (size_t i = 0; i < rest.size(); ++i)
    CHECK(rest[i] == Approx(reference[1][i + 2]).epsilon(1e-4));
  // Full fine-tuning saved at world 4 with expert_parallel_size 2 (each rank's optimizer state
  // of its experts, in the whole tensors' elements) resumes at world 1 and at world 2 with
  // expert_parallel_size 2: the remaining steps and the model are world 1's.
  const size_t full = 6;
  REQUIRE(kinds[full] == "full 2");
  setenv("ZT_EP_CASE", "full saved", 1);
  REQUIRE(test::curves_at_world(4, "rank: expert-parallel training", std::chrono::seconds(300))
              .size() == 1);
  const std::string full_saved = dir + "/out_4_2_full saved/checkpoint-2";
  std::vector<std::string> full_resumed = ep_run(1, 1, "full 2");
  full_resumed.insert(full_resumed.end(), {"--output_dir", dir + "/full_resumed",
                                           "--resume_from_checkpoint", full_saved});
  const std::vector<double> full_rest = test::train_on_base(dir, full_resumed);
  REQUIRE(full_rest.size() == 2);
  for (size_t i = 0; i < full_rest.size(); ++i)
    CHECK(full_rest[i] == Approx(reference[full][i + 2]).epsilon(1e-4));
  check_same_model(dir + "/ref_full 2/model.safetensors", dir + "/full_resumed/model.safetensors");
  setenv("ZT_EP_CASE", "full resumed", 1);
  setenv("ZT_EP_RESUME", full_saved.c_str(), 1);
  const std::vector<std::vector<double>> at_two =
      test::curves_at_world(2, "rank: expert-parallel training", std::chrono::seconds(300));
  REQUIRE(at_two.size() == 1);
  REQUIRE(at_two[0].size() == 2);
  for (size_t i = 0; i < at_two[0].size(); ++i)
    CHECK(at_two[0][i] == Approx(reference[full][i + 2]).epsilon(1e-4));
  check_same_model(dir + "/ref_full 2/model.safetensors",
                   dir + "/out_2_2_full resumed/model.safetensors");
  // What expert parallelism refuses, said on every rank alike.
  setenv("ZT_EP", "2", 1);
  for (const char* refused : {"trained experts"}) {
    INFO(refused);
    setenv("ZT_EP_CASE", refused, 1);
    test::run_ranks(2, "rank: expert-parallel training", std::chrono::seconds(120));
  }
}

TEST_CASE("expert_parallel_size that does not divide the experts or the world, or a dense model",
          "[moe][errors]") {
  ModelConfig c = parse_model_config(kEpModel, "ep.json");
  c.expert_shard = {3, 0};
  CHECK_THROWS_WITH(CausalLM(c, at::TensorOptions(), false),
                    Catch::Contains("expert_parallel_size 3") && Catch::Contains("8 experts"));
  ModelConfig dense = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2})",
      "dense.json");
  dense.expert_shard = {2, 1};
  CHECK_THROWS_WITH(CausalLM(dense, at::TensorOptions(), false),
                    Catch::Contains("no mixture of experts"));
  // A shard of 2 holds half the experts; its source reads its half of the whole tensors.
  c.expert_shard = {2, 1};
  CausalLM half(c, at::TensorOptions(), true);
  const auto params = half.named_parameters();
  CHECK(params["model.layers.0.mlp.experts.gate_up_proj"].size(0) == 4);
  CHECK(params["model.layers.0.mlp.gate.weight"].size(0) == 8);
  // The trainer at one rank: 2 does not divide 1.
  const std::string dir = test::temp_dir("expert_parallel_errors");
  test::write_data(dir, "train.jsonl", 4, 3);
  test::write_model_folder(dir + "/base", kEpModel, 42);
  CHECK_THROWS_WITH(test::train_on_base(dir, ep_run(1, 2, "2")),
                    Catch::Contains("expert_parallel_size 2 does not divide the 1 ranks"));
}

TEST_CASE(
    "a rank's share of the experts reads from every checkpoint layout as a slice of the whole",
    "[moe]") {
  // Fused tensors, Mixtral's one module per expert (4.x names), gpt-oss's MXFP4 blocks and its
  // biases: shard r of 2 is experts [r·E/2, (r+1)·E/2) of what the whole model reads.
  for (const char* family : {"qwen3_moe", "mixtral", "gpt_oss_mxfp4"}) {
    INFO(family);
    const std::string dir = std::string(ZT_FIXTURES) + "/models/" + family;
    const ModelConfig whole_config = load_model_config(dir);
    CausalLM whole(whole_config, at::TensorOptions(), true);
    load_weights(whole, *checkpoint_source(dir));
    const auto want = whole.named_parameters();
    int experts = 0;
    for (int64_t r = 0; r < 2; ++r) {
      ModelConfig c = whole_config;
      c.expert_shard = {2, r};
      CausalLM half(c, at::TensorOptions(), true);
      check_checkpoint(half, dir);  // the file's whole tensors fit the shard's
      load_weights(half, *model::expert_shard_source(checkpoint_source(dir), c.expert_shard));
      for (const auto& item : half.named_parameters()) {
        INFO(item.key());
        at::Tensor full = want[item.key()];
        if (model::is_expert_tensor(item.key())) {
          const int64_t local = item.value().size(0);
          full = full.narrow(0, r * local, local);
          ++experts;
        }
        CHECK(at::equal(item.value(), full));
      }
    }
    CHECK(experts >= 8);
  }
}

TEST_CASE("the engine reads rank-local parameters from a source and checks their split",
          "[moe][engine]") {
  const ModelConfig c = parse_model_config(kEpModel, "ep.json");
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  DeepSpeedConfig ds = parse_deepspeed_config(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1})");
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.rank_local = model::is_expert_tensor;
  LaunchEnv single;
  std::shared_ptr<Communicator> comm(create_communicator(single, CommOptions{}));
  // No source to read each rank's own values from.
  CHECK_THROWS_WITH(Engine(model, ds, comm, eo),
                    Catch::Contains("experts.gate_up_proj") && Catch::Contains("no source"));
  // A split that does not fit this rank: holders without it at its block, peers without it.
  eo.source = random_source(c, 3);
  eo.local_split.blocks = 2;
  eo.local_split.index = 1;
  eo.local_split.holders = {0, 1};
  CHECK_THROWS_WITH(Engine(model, ds, comm, eo), Catch::Contains("local_split"));
  eo.local_split = {};
  eo.local_split.peers = {1};
  CHECK_THROWS_WITH(Engine(model, ds, comm, eo), Catch::Contains("local_split"));
  // Trainable experts at one rank of one block: trained as any parameter, their pieces whole.
  eo.local_split = {};
  Engine engine(model, ds, comm, eo);
  bool experts = false;
  for (const auto& [piece, values] : engine.state_pieces()) {
    if (!model::is_expert_tensor(piece.name)) continue;
    experts = true;
    CHECK(piece.begin == 0);
    CHECK(piece.length == model->named_parameters()[piece.name].numel());
  }
  CHECK(experts);
}

// Full fine-tuning's optimizer state of the experts at world 4 with expert_parallel_size 2: each
// rank keeps half of its block's state (its peers the other half), in the whole tensors'
// elements, and the four ranks' pieces cover every whole expert tensor exactly once.
TEST_CASE("rank: experts' state cut among their peers", "[.rank]") {
  std::shared_ptr<Communicator> comm(test::join());
  const int world = comm->world_size(), rank = comm->rank();
  ModelConfig c = parse_model_config(kEpModel, "ep.json");
  c.expert_shard = {2, rank % 2};
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  DeepSpeedConfig ds = parse_deepspeed_config(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}})");
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.rank_local = model::is_expert_tensor;
  eo.source = model::expert_shard_source(random_source(c, 3), c.expert_shard);
  eo.local_split.blocks = 2;
  eo.local_split.index = rank % 2;
  eo.local_split.holders = {rank - rank % 2, rank - rank % 2 + 1};
  for (int q = rank % 2; q < world; q += 2) eo.local_split.peers.push_back(q);
  Engine engine(model, ds, comm, eo);
  const auto params = model->named_parameters();
  int64_t mine = 0, local = 0;
  std::vector<double> ranges;  // (tensor index, begin, length) of every expert piece here
  std::vector<std::string> names;
  for (const auto& item : params) {
    if (model::is_expert_tensor(item.key())) {
      names.push_back(item.key());
      local += item.value().numel();
    }
  }
  for (const auto& [piece, values] : engine.state_pieces()) {
    const auto it = std::find(names.begin(), names.end(), piece.name);
    if (it == names.end()) continue;
    CHECK(piece.shape[0] == 2 * params[piece.name].size(0));  // the whole tensor's shape
    mine += piece.length;
    ranges.insert(ranges.end(),
                  {static_cast<double>(it - names.begin()), static_cast<double>(piece.begin),
                   static_cast<double>(piece.length)});
  }
  CHECK(mine * 2 <= local + 2 * 16 * static_cast<int64_t>(names.size()));  // half, bar padding
  CHECK(mine * 2 >= local - 2 * 16 * static_cast<int64_t>(names.size()));
  // Every rank's ranges, padded to a common count, to check the cover.
  const int64_t most = 3 * static_cast<int64_t>(names.size());
  ranges.resize(static_cast<size_t>(most), -1.0);
  at::Tensor all = at::empty({world * most}, at::kDouble).to(at::kFloat);
  at::Tensor here = at::tensor(ranges, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat);
  comm->all_gather(all, here)->wait();
  for (size_t t = 0; t < names.size(); ++t) {
    INFO(names[t]);
    std::vector<int> covered(static_cast<size_t>(2 * params[names[t]].numel()), 0);
    for (int64_t k = 0; k + 2 < all.numel(); k += 3) {
      if (all[k].item<double>() != static_cast<double>(t)) continue;
      const int64_t begin = all[k + 1].item<int64_t>(), length = all[k + 2].item<int64_t>();
      for (int64_t e = begin; e < begin + length; ++e) ++covered[static_cast<size_t>(e)];
    }
    CHECK(std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; }));
  }
}

TEST_CASE("expert parallelism cuts the experts' optimizer state among the ranks holding them",
          "[moe][ranks][engine]") {
  if (test::skip_cpu_world(4)) return;
  test::run_ranks(4, "rank: experts' state cut among their peers", std::chrono::seconds(120));
}
