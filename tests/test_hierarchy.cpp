// Across nodes (issue [7/7]). With a frozen base: LoRA on the tiny LLaMA fixture (transformers'
// weights) under MiCS shard groups and hpZ's secondary copies, at world 4 played as two nodes of
// two, follows world 1's curve; hpZ's gathers stay inside the group once each value has crossed
// the job, which a counting communicator shows. ZeRO++'s int8 blocks: the quantizer's error
// bound, the quantized gather and reduce-scatter against exact ones, and training with them
// within a stated band of the unquantized run over a few hundred steps.
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/quantized.hpp"
#include "support/forwarding_comm.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

namespace {

const std::vector<std::string> kSettings = {"0", "3", "3 hpz", "3 mics", "2 mics", "1 mics"};

// The bound quantize_blocks promises for each value of `x` (rows × n): half its block's step,
// amax / 254, with a little room for fp32 rounding of the product.
at::Tensor block_bounds(const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t blocks = (n + comm::kQuantBlock - 1) / comm::kQuantBlock;
  at::Tensor padded =
      at::constant_pad_nd(x.abs().to(at::kFloat), {0, blocks * comm::kQuantBlock - n});
  at::Tensor amax = padded.view({rows, blocks, comm::kQuantBlock}).amax({2}, true);
  return (amax / 254.0 * (1 + 1e-5))
      .expand({rows, blocks, comm::kQuantBlock})
      .reshape({rows, blocks * comm::kQuantBlock})
      .narrow(1, 0, n);
}

// Counts the all-gathers over the whole job (group exchanges are all-to-alls) and the bytes this
// rank sends, inside its node of `per_node` consecutive ranks and across, as a direct exchange
// would send them (a collective's data to each other rank; an all-reduce's twice 1/world),
// forwarding every call to the communicator it wraps.
class CountingCommunicator final : public test::ForwardingCommunicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner, int per_node = 1)
      : ForwardingCommunicator(std::move(inner)), per_node_(per_node) {}
  int64_t all_gathers = 0;
  double intra_bytes = 0, inter_bytes = 0;
  WorkHandle all_reduce(const at::Tensor& t, ReduceOp op) override {
    to_each(2.0 * static_cast<double>(t.nbytes()) / world_size());
    return ForwardingCommunicator::all_reduce(t, op);
  }
  WorkHandle reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    to_each(static_cast<double>(out.nbytes()));
    return ForwardingCommunicator::reduce_scatter(out, in, op);
  }
  WorkHandle all_gather(const at::Tensor& out, const at::Tensor& in) override {
    ++all_gathers;
    to_each(static_cast<double>(in.nbytes()));
    return ForwardingCommunicator::all_gather(out, in);
  }
  WorkHandle broadcast(const at::Tensor& t, int root) override {
    if (root == rank()) to_each(static_cast<double>(t.nbytes()));
    return ForwardingCommunicator::broadcast(t, root);
  }

 protected:
  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& recv,
                      const std::vector<int64_t>& send) override {
    for (int q = 0; q < world_size(); ++q) {
      if (q != rank())
        add(q, static_cast<double>(send[static_cast<size_t>(q)] * in.element_size()));
    }
    return ForwardingCommunicator::exchange(out, in, recv, send);
  }

 private:
  void add(int q, double bytes) {
    (q / per_node_ == rank() / per_node_ ? intra_bytes : inter_bytes) += bytes;
  }
  void to_each(double bytes) {
    for (int q = 0; q < world_size(); ++q) {
      if (q != rank()) add(q, bytes);
    }
  }
  int per_node_;
};

PeftConfig lora_config() {
  PeftConfig lora;
  lora.type = FinetuningType::kLora;
  lora.lora.r = 4;
  lora.lora.alpha = 8;
  return lora;
}

}  // namespace

TEST_CASE("rank: lora under hpz and mics", "[.rank]") {
  auto counting = std::make_shared<CountingCommunicator>(test::join());
  std::shared_ptr<Communicator> comm = counting;
  const std::string llama = std::string(ZT_FIXTURES) + "/models/llama";
  const PeftConfig lora = lora_config();
  std::vector<std::vector<double>> curves;
  std::vector<int64_t> gathers;  // over the whole job, per setting
  for (const std::string& setting : kSettings) {
    INFO(setting);
    auto model = std::make_shared<CausalLM>(load_model_config(llama), at::TensorOptions(),
                                            /*allocate=*/false);
    apply_peft(*model, lora, 3);
    const int64_t before = counting->all_gathers;
    curves.push_back(test::fixture_batch_losses(comm, model, checkpoint_source(llama), setting, 5));
    gathers.push_back(counting->all_gathers - before);
  }
  if (comm->world_size() == 4) {
    // Plain stage 3 gathers every unit over the job twice a step; with hpZ the frozen base
    // crosses the job once, the adapters once a step, and the backward's gathers never.
    INFO("all-gathers over the job: stage 3 " << gathers[1] << ", with hpZ " << gathers[2]);
    CHECK(gathers[2] > 0);
    CHECK(gathers[2] * 2 < gathers[1]);
    CHECK(gathers[3] < gathers[1]);  // MiCS gathers within its group only
  }
  test::write_curves(comm->rank(), curves);
  comm->barrier();
}

TEST_CASE("LoRA over a frozen base trains the same under hpZ and MiCS at world 4 as at world 1",
          "[engine][hierarchy]") {
  std::vector<std::vector<std::vector<double>>> by_world;
  for (int world : {1, 4}) {
    if (test::skip_cpu_world(world)) return;
    by_world.push_back(
        test::curves_at_world(world, "rank: lora under hpz and mics", std::chrono::seconds(300)));
    REQUIRE(by_world.back().size() == kSettings.size());
  }
  const std::vector<double>& reference = by_world[0][0];
  CHECK(reference.back() < 0.95 * reference.front());  // it learns
  for (size_t w = 0; w < by_world.size(); ++w) {
    for (size_t s = 0; s < kSettings.size(); ++s) {
      INFO("world index " << w << ", " << kSettings[s]);
      const std::vector<double>& curve = by_world[w][s];
      REQUIRE(curve.size() == reference.size());
      for (size_t k = 0; k < reference.size(); ++k) {
        CHECK(curve[k] == Approx(reference[k]).epsilon(2e-4));
      }
    }
  }
}

// ---- ZeRO++'s int8 blocks -----------------------------------------------------------------------

TEST_CASE("int8 blocks: each value within half its block's step, zeros exact, non-finite kept",
          "[comm][quantized]") {
  at::manual_seed(5);
  for (int64_t n : {1, 255, 256, 257, 1000}) {
    for (double scale : {1e-6, 1.0, 3e4}) {
      INFO("n " << n << ", scale " << scale);
      at::Tensor x = at::randn({3, n}) * scale;
      x[1].narrow(0, 0, std::min<int64_t>(n, 300)).mul_(100);  // blocks of other magnitudes
      const at::Tensor bytes = comm::quantize_blocks(x);
      CHECK(bytes.scalar_type() == at::kByte);
      CHECK(bytes.size(1) == comm::quantized_bytes(n));
      const at::Tensor back = comm::dequantize_blocks(bytes, n);
      CHECK(back.sizes() == x.sizes());
      CHECK(((back - x).abs() <= block_bounds(x)).all().item<bool>());
      if (n > 1) CHECK((back - x).abs().max().item<double>() > 0);  // it does quantize
    }
  }
  // bf16 in, about half of bf16's bytes on the wire.
  at::Tensor h = at::randn({1, 4096}).to(at::kBFloat16);
  CHECK(comm::quantized_bytes(4096) * 2 < 4096 * 2 * 0.53 * 2);
  CHECK(((comm::dequantize_blocks(comm::quantize_blocks(h), 4096) - h.to(at::kFloat)).abs() <=
         block_bounds(h))
            .all()
            .item<bool>());
  // A block of zeros comes back as zeros; a non-finite value spoils its own block only.
  at::Tensor z = at::zeros({1, 600});
  z[0][400] = std::numeric_limits<float>::infinity();
  z[0].narrow(0, 512, 88).fill_(0.5);
  const at::Tensor back = comm::dequantize_blocks(comm::quantize_blocks(z), 600);
  CHECK(back[0].narrow(0, 0, 256).eq(0).all().item<bool>());
  CHECK_FALSE(at::isfinite(back[0].narrow(0, 256, 256)).all().item<bool>());
  CHECK(back[0].narrow(0, 512, 88).eq(0.5).all().item<bool>());
}

TEST_CASE("rank: quantized exchanges", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t n = 700;
  // Every rank's values, from seeds all ranks know.
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) {
    at::manual_seed(100 + r);
    inputs.push_back(at::randn({world, n}) * (r + 1));
  }
  std::vector<int> pair{rank - rank % 2, rank - rank % 2 + 1};
  for (const std::vector<int>& group : {std::vector<int>{}, pair}) {
    if (!group.empty() && world % 2 != 0) continue;
    const std::vector<int> members = group.empty() ? [&] {
      std::vector<int> all;
      for (int r = 0; r < world; ++r) all.push_back(r);
      return all;
    }()
                                                   : group;
    const int64_t m = static_cast<int64_t>(members.size());
    const int place =
        static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    INFO("group of " << m);
    // The gather: every member's row 0, each within its own block bound.
    at::Tensor gathered = at::empty({m * n});
    comm::quantized_all_gather(*comm, gathered, inputs[static_cast<size_t>(rank)][0].contiguous(),
                               group)
        ->wait();
    for (int64_t j = 0; j < m; ++j) {
      const at::Tensor want =
          inputs[static_cast<size_t>(members[static_cast<size_t>(j)])][0].reshape({1, n});
      const at::Tensor got = gathered.narrow(0, j * n, n).reshape({1, n});
      CHECK(((got - want).abs() <= block_bounds(want)).all().item<bool>());
    }
    // The reduce-scatter: chunk `place` of the members' inputs summed, within the sum of their
    // bounds (and the fp32 sum's rounding).
    at::Tensor mine = at::empty({n});
    comm::quantized_reduce_scatter(
        *comm, mine, inputs[static_cast<size_t>(rank)].narrow(0, 0, m).contiguous(), group)
        ->wait();
    at::Tensor exact = at::zeros({1, n}), bound = at::zeros({1, n});
    for (int q : members) {
      const at::Tensor chunk = inputs[static_cast<size_t>(q)][place].reshape({1, n});
      exact += chunk;
      bound += block_bounds(chunk);
    }
    CHECK(((mine.reshape({1, n}) - exact).abs() <= bound + 1e-5).all().item<bool>());
    if (m > 1) CHECK((mine.reshape({1, n}) - exact).abs().max().item<double>() > 0);
  }
  comm->barrier();
}

TEST_CASE(
    "the quantized all-gather and reduce-scatter stay within their error bounds at world "
    "sizes 1, 2 and 4, over the job and over pairs",
    "[comm][quantized]") {
  for (int world : {1, 2, 4}) {
    if (test::skip_cpu_world(world)) continue;
    test::run_ranks(world, "rank: quantized exchanges", std::chrono::seconds(120));
  }
}

// A few hundred steps of LoRA on the fixture with ZeRO++'s quantized exchanges, at world 4 as two
// nodes of two (ZT_RANKS_PER_NODE: qgZ reduces within the node, then across): the curve stays
// within a band of the same run unquantized.
const std::vector<std::string> kQuantized = {"3", "3 qw", "3 qg", "2 qg", "3 qw qg hpz"};

TEST_CASE("rank: quantized lora", "[.rank]") {
  setenv("ZT_RANKS_PER_NODE", "2", 1);
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string llama = std::string(ZT_FIXTURES) + "/models/llama";
  std::vector<std::vector<double>> curves;
  for (const std::string& setting : kQuantized) {
    auto model = std::make_shared<CausalLM>(load_model_config(llama), at::TensorOptions(),
                                            /*allocate=*/false);
    apply_peft(*model, lora_config(), 3);
    curves.push_back(
        test::fixture_batch_losses(comm, model, checkpoint_source(llama), setting, 200));
  }
  test::write_curves(comm->rank(), curves);
  comm->barrier();
}

TEST_CASE(
    "LoRA with int8 weight gathers (qwZ) and gradient reduce-scatters (qgZ) ends within 1% "
    "of the unquantized run after 200 steps",
    "[engine][quantized][slow]") {
  if (test::skip_cpu_world(4)) return;
  const std::vector<std::vector<double>> curves =
      test::curves_at_world(4, "rank: quantized lora", std::chrono::seconds(600));
  REQUIRE(curves.size() == kQuantized.size());
  const std::vector<double>& plain = curves[0];
  REQUIRE(plain.size() == 200);
  CHECK(plain.back() < 0.8 * plain.front());  // it learns
  for (size_t s = 1; s < curves.size(); ++s) {
    INFO(kQuantized[s] << ": final " << curves[s].back() << " against " << plain.back());
    REQUIRE(curves[s].size() == plain.size());
    CHECK(std::abs(curves[s].back() / plain.back() - 1) <= 0.01);
    // Quantized, not the same run: the first step agrees only where nothing was quantized yet.
    CHECK(curves[s] != plain);
  }
}

// ---- the traffic each mode sends across nodes (bench/tools/scaling_model.py traffic) -----------

// One steady step of full fine-tuning of the tiny LLaMA per mode at world 4 as two nodes of two:
// the bytes rank 0 sends inside its node and across, as JSON lines in ZT_OUT, for
// `scaling_model.py traffic` to set beside its formulas.
TEST_CASE("rank: traffic by mode", "[.rank]") {
  setenv("ZT_RANKS_PER_NODE", "2", 1);
  auto counting = std::make_shared<CountingCommunicator>(test::join(), 2);
  std::shared_ptr<Communicator> comm = counting;
  const int rank = comm->rank(), world = comm->world_size();
  const std::vector<std::pair<int, std::string>> modes = {{3, ""},   {3, "hpz"},       {3, "qw"},
                                                          {3, "qg"}, {3, "hpz+qw+qg"}, {3, "mics"},
                                                          {2, ""},   {2, "mics"},      {2, "qg"}};
  std::string lines;
  for (const auto& [stage, mode] : modes) {
    const auto has = [&mode = mode](const std::string& m) {
      return ("+" + mode + "+").find("+" + m + "+") != std::string::npos;
    };
    std::string keys;
    if (has("hpz")) keys += R"(, "zero_hpz_partition_size": 2)";
    if (has("mics")) keys += R"(, "mics_shard_size": 2)";
    if (has("qw")) keys += R"(, "zero_quantized_weights": true)";
    if (has("qg")) keys += R"(, "zero_quantized_gradients": true)";
    auto model = test::make_model("llm", 3);
    DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
        R"({{"zero_optimization": {{"stage": {}, "reduce_bucket_size": 100000000,
             "stage3_param_persistence_threshold": 0{}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}})",
        stage, keys));
    TrainingArguments args;
    args.per_device_train_batch_size = 2;
    resolve_config(ds, args, ResolveContext{world, 16, 4});
    EngineOptions eo;
    eo.units = model->units();
    eo.gate = &model->unit_gate();
    eo.total_train_steps = 4;
    Engine engine(model, ds, comm, eo);
    double intra = 0, inter = 0;
    for (int64_t step = 0; step < 2; ++step) {  // the second step's traffic
      intra = counting->intra_bytes;
      inter = counting->inter_bytes;
      test::Batch b = test::make_batch("llm", step, rank * 2, 2);
      engine.backward(model->loss_sum(b.inputs, b.labels), 10.0);
      engine.step();
    }
    const double step_intra = counting->intra_bytes - intra;
    const double step_inter = counting->inter_bytes - inter;
    int64_t params = 0;
    for (const auto& item : engine.gather_full_parameters()) params += item.second.numel();
    lines +=
        fmt::format(R"({{"stage": {}, "modes": "{}", "world": {}, "per_node": 2, "params": {}, )"
                    R"("intra_bytes": {}, "inter_bytes": {}}})"
                    "\n",
                    stage, mode, world, params, step_intra, step_inter);
  }
  if (rank == 0) {
    std::ofstream out(std::getenv("ZT_OUT"));
    out << lines;
  }
  comm->barrier();
}

TEST_CASE("tool: traffic by mode", "[.tool]") {
  const char* out = std::getenv("ZT_OUT");
  REQUIRE(out != nullptr);
  test::run_ranks(4, "rank: traffic by mode", std::chrono::seconds(300), {{"ZT_OUT", out}});
}
