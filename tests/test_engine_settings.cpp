// The engine's settings on their own: resolve_settings is a pure function of the DeepSpeed
// config, the EngineOptions and the world, so every decision the engine's parts branch on is
// checked here without building an engine.
#include "support/catch.hpp"

#include <algorithm>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "support/messages.hpp"
#include "util/capacity.hpp"
#include "zero/keep_budget.hpp"
#include "zero/settings.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"

using namespace zt;
using Catch::Matchers::Contains;
using zero::GradientPath;

namespace {

struct World {
  int size = 1;
  bool shared = false;
};

// A resolved config from `zero` (the zero_optimization body), `top` (more top-level keys) and
// the precision: fp32, fp16, bf16 (fp32 masters, DeepSpeed's default) or bf16m (bf16 masters
// and gradients, bf16_master_weights_and_grads).
DeepSpeedConfig config(int stage, const std::string& precision, const std::string& zero = "",
                       const std::string& top = "", int world = 1) {
  const std::string prec =
      precision == "fp16"   ? R"(, "fp16": {"enabled": true})"
      : precision == "bf16" ? R"(, "bf16": {"enabled": true})"
      : precision == "bf16m"
          ? R"(, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true})"
          : "";
  DeepSpeedConfig ds = parse_deepspeed_config(
      fmt::format(R"({{"zero_optimization": {{"stage": {}{}{}}},
                      "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}}{}{}}})",
                  stage, zero.empty() ? "" : ", ", zero, prec, top.empty() ? "" : ", " + top),
      "settings.json");
  TrainingArguments args;
  resolve_config(ds, args, ResolveContext{world, 16, 10});
  return ds;
}

zero::EngineSettings settings(const DeepSpeedConfig& ds, World w, bool in_backward = false,
                              bool units = false) {
  EngineOptions o;
  o.update_in_backward = in_backward;
  if (units) o.units.push_back(UnitSpec{});
  zero::EngineFacts f;
  f.world = w.size;
  f.rank = 0;
  return zero::resolve_settings(ds, o, f);
}

}  // namespace

TEST_CASE("settings: the update-inside-backward eligibility table", "[engine][settings]") {
  // Each row is one reason the update cannot move into backward without changing the math;
  // the first row has none.
  struct Row {
    const char* what;
    int stage;
    const char* precision;
    const char* zero;
    const char* top;
    World world;
    bool eligible;
    const char* reason;  ///< a word of update_in_backward_blocker's reason
  };
  const Row rows[] = {
      {"bf16 masters, stage 2, one rank", 2, "bf16m", "", "", {1, false}, true, ""},
      {"fp32, stage 0, one rank", 0, "fp32", "", "", {1, false}, true, ""},
      {"two ranks", 2, "bf16m", "", "", {2, false}, false, "rank"},
      {"fp32 masters under bf16 (the parameters are written from them)",
       2,
       "bf16",
       "",
       "",
       {1, false},
       true,
       ""},
      {"offload",
       2,
       "fp32",
       R"("offload_optimizer": {"device": "cpu"})",
       "",
       {1, false},
       false,
       "offload"},
      {"stage 3 at one rank (nothing partitioned)", 3, "bf16m", "", "", {1, false}, true, ""},
      {"stage 3 with parameters offloaded",
       3,
       "bf16m",
       R"("offload_param": {"device": "cpu"})",
       "",
       {1, false},
       false,
       "partitioned units"},
      {"accumulation",
       2,
       "bf16m",
       "",
       R"("gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1)",
       {1, false},
       false,
       "accumulation"},
      {"fp16", 2, "fp16", "", "", {1, false}, false, "fp16"},
      {"clipping", 2, "bf16m", "", R"("gradient_clipping": 1.0)", {1, false}, false, "clipping"},
      // Tied weights across units: their shares are summed before the update.
      {"tied weights across units", 2, "bf16m", "", "", {1, true}, true, ""},
  };
  for (const Row& r : rows) {
    INFO(r.what);
    const DeepSpeedConfig ds = config(r.stage, r.precision, r.zero, r.top, r.world.size);
    const zero::EngineSettings s = settings(ds, r.world, /*in_backward=*/true);
    CHECK(s.in_backward() == r.eligible);
    const std::string reason = zero::update_in_backward_blocker(s);
    CHECK(reason.empty() == r.eligible);
    if (!r.eligible) CHECK(reason.find(r.reason) != std::string::npos);
    // Not asked for: never.
    CHECK_FALSE(settings(ds, r.world, false).in_backward());
  }
}

TEST_CASE("settings: one gradient path per stage, the one-rank shortcut below them",
          "[engine][settings]") {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    // Several ranks: the stage decides (stage 3 reduces like stage 2).
    const GradientPath many = settings(config(stage, "bf16", "", "", 2), {2}).gradients;
    CHECK(many == (stage == 0   ? GradientPath::kAllReduce
                   : stage == 1 ? GradientPath::kFlatScatter
                                : GradientPath::kStaged));
    // One rank: no collective; fp32 everywhere lets autograd accumulate into the masters'
    // accumulator itself, bf16 with fp32 masters copies up.
    CHECK(settings(config(stage, "fp32"), {1}).gradients == GradientPath::kInAccumulator);
    CHECK(settings(config(stage, "bf16"), {1}).gradients == GradientPath::kOneRank);
    // Updates inside backward take autograd's gradient in any masters' dtype.
    CHECK(settings(config(stage, "bf16"), {1}, true).gradients == GradientPath::kInBackward);
    CHECK(settings(config(stage, "fp32"), {1}, true).gradients == GradientPath::kInBackward);
  }
}

TEST_CASE("settings: gradient scaling around reductions multiplies to 1 / world",
          "[engine][settings]") {
  for (int world : {1, 2, 4}) {
    for (const char* top :
         {"", R"("prescale_gradients": true)", R"("gradient_predivide_factor": 8.0)"}) {
      INFO(world << " ranks, " << top);
      const zero::EngineSettings s = settings(config(2, "fp32", "", top, world), {world});
      CHECK(s.pre_scale * s.post_scale == Approx(1.0 / world));
    }
  }
  const zero::EngineSettings pre =
      settings(config(2, "fp32", "", R"("prescale_gradients": true)", 4), {4});
  CHECK(pre.pre_scale == Approx(0.25));  // DeepSpeed divides before the reduction
  const zero::EngineSettings factor =
      settings(config(2, "fp32", "", R"("gradient_predivide_factor": 8.0)", 4), {4});
  CHECK(factor.pre_scale == Approx(1.0 / 8.0));
  CHECK(factor.post_scale == Approx(8.0 / 4.0));
}

TEST_CASE("settings: precision, offload and overlap follow DeepSpeed", "[engine][settings]") {
  // fp16 on a CPU computes in fp32 and says so; the loss scaler still runs.
  const zero::EngineSettings fp16 = settings(config(1, "fp16"), {1});
  CHECK(fp16.fp16);
  CHECK(fp16.compute == at::kFloat);
  CHECK(fp16.scaler.dynamic);
  REQUIRE(fp16.warnings.size() == 1);
  CHECK(fp16.warnings[0].find("fp16 on CPU") != std::string::npos);
  const zero::EngineSettings bf16 = settings(config(1, "bf16"), {1});
  CHECK(bf16.compute == at::kBFloat16);
  CHECK(bf16.master_dtype == at::kFloat);
  CHECK(bf16.warnings.empty());

  // Offload: the optimizer from stage 1, parameters at stage 3 (the config refuses them
  // elsewhere).
  const std::string opt = R"("offload_optimizer": {"device": "cpu"})";
  const std::string both = opt + R"(, "offload_param": {"device": "cpu"})";
  CHECK(settings(config(1, "fp32", opt), {1}).offload_optimizer);
  CHECK(settings(config(2, "fp32", opt), {1}).offload_optimizer);
  CHECK_FALSE(settings(config(2, "fp32", opt), {1}).offload_param);
  CHECK(settings(config(3, "fp32", both), {1}).offload_param);
  CHECK_FALSE(settings(config(2, "fp32"), {1}).offload_optimizer);

  // overlap_comm: always on stage 0 (buckets reduce during backward), on by default elsewhere
  // (docs/config.md: unlike DeepSpeed's default for stages 1 and 2), and as written when written.
  CHECK(settings(config(0, "fp32"), {1}).overlap);
  CHECK(settings(config(0, "fp32", R"("overlap_comm": false)"), {1}).overlap);
  CHECK(settings(config(2, "fp32"), {1}).overlap);
  CHECK(settings(config(3, "fp32"), {1}).overlap);
  CHECK_FALSE(settings(config(1, "fp32", R"("overlap_comm": false)"), {1}).overlap);
  CHECK_FALSE(settings(config(2, "fp32", R"("overlap_comm": false)"), {1}).overlap);

  // Stage 3 partitions units (gathered per call, recomputed in backward) wherever a shard is
  // less than the whole: several ranks, or parameters offloaded; without units it warns that
  // nothing is partitioned. At one rank it runs as stage 2.
  const std::string param = R"("offload_param": {"device": "cpu"})";
  for (const auto& [world, zero, shards] :
       {std::tuple{2, std::string(), true}, {1, param, true}, {1, std::string(), false}}) {
    INFO(world << " ranks, " << zero);
    const zero::EngineSettings s =
        settings(config(3, "fp32", zero, "", world), {world}, false, true);
    CHECK(s.shard_units == shards);
    CHECK(s.checkpointing == shards);
    CHECK(s.layout_stage == (shards ? 3 : 2));
    CHECK(s.stage == 3);
    CHECK(s.warnings.empty());
    CHECK(settings(config(3, "fp32", zero, "", world), {world}).warnings.size() ==
          (shards ? 1 : 0));
  }
  CHECK(settings(config(3, "fp32"), {1}, false, true).gradients == GradientPath::kInAccumulator);
  CHECK_FALSE(settings(config(2, "fp32"), {1}).checkpointing);

  // bf16 masters alias the compute copy only where a rank keeps whole buckets.
  CHECK(settings(config(0, "bf16m", "", "", 2), {2}).master_aliases_params);
  CHECK(settings(config(2, "bf16m"), {1}).master_aliases_params);
  CHECK_FALSE(settings(config(2, "bf16m", "", "", 2), {2}).master_aliases_params);
  CHECK_FALSE(settings(config(0, "bf16", "", "", 2), {2}).master_aliases_params);
}

TEST_CASE(
    "settings: the optimizer state a rank keeps on its device, refused in GiB where it "
    "cannot fit",
    "[engine][settings]") {
  // DeepSpeed's mixed-precision Adam (the ZeRO paper's K = 12): fp32 masters and two fp32
  // moments per element, beside the fp32 gradient accumulator.
  const int64_t n = 1000;
  const double f32 = 4.0, b16 = 2.0;
  CHECK(zero::device_state_bytes(settings(config(3, "bf16"), {1}), n) == n * (f32 + f32 + 2 * f32));
  CHECK(zero::device_state_bytes(settings(config(1, "fp32", "", "", 2), {2}), n) ==
        n * (f32 + f32 + 2 * f32));
  // Offloaded, the host keeps masters and moments (all, or its ratio's share); the accumulator
  // stays on the device.
  CHECK(zero::device_state_bytes(
            settings(config(2, "bf16", R"("offload_optimizer": {"device": "cpu"})"), {1}), n) ==
        n * f32);
  CHECK(zero::device_state_bytes(
            settings(config(2, "bf16", R"("offload_optimizer": {"device": "cpu", "ratio": 0.25})"),
                     {1}),
            n) == n * f32 + 0.75 * n * (f32 + 2 * f32));
  // bf16 masters that are the parameters themselves add nothing; the accumulator is bf16.
  CHECK(zero::device_state_bytes(settings(config(2, "bf16m"), {1}), n) == n * (b16 + 2 * f32));
  // Updates inside backward keep no accumulator.
  CHECK(zero::device_state_bytes(settings(config(2, "bf16m"), {1}, true), n) == n * 2 * f32);

  // The refusal: 13B fully fine-tuned at one rank asks 16 bytes a parameter of a 141 GB GPU.
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double need = zero::device_state_bytes(settings(config(3, "bf16"), {1}), 13'000'000'000);
  CHECK_THROWS_MATCHES(
      capacity::check_free(need, 139.8 * gib, "cuda:0", "the state", "offload it"),
      OutOfMemoryError,
      test::Has({"the state needs 193.7 GiB on cuda:0", "which has 139.8 GiB free; offload it"}));
  CHECK_NOTHROW(capacity::check_free(need / 2, 139.8 * gib, "cuda:0", "the state", "offload it"));
  CHECK_NOTHROW(capacity::check_free(need, 0.0, "cuda:0", "the state", "unknown: not checked"));
}

TEST_CASE("settings: impossible combinations are refused naming the file", "[engine][settings]") {
  const DeepSpeedConfig offload_bf16 =
      config(2, "bf16m", R"("offload_optimizer": {"device": "cpu"})");
  CHECK_THROWS_AS(settings(offload_bf16, {1}), ConfigError);
  CHECK_THROWS_WITH(settings(offload_bf16, {1}),
                    Contains("settings.json") && Contains("offload_optimizer"));
  DeepSpeedConfig no_bf16 = config(2, "fp32");
  no_bf16.bf16.optimizer_states = true;
  CHECK_THROWS_AS(settings(no_bf16, {1}), ConfigError);
  CHECK_THROWS_WITH(settings(no_bf16, {1}), Contains("bf16.enabled"));
  // The model and the communicator on different kinds of device.
  EngineOptions o;
  o.device = at::Device(at::kCUDA, 0);
  zero::EngineFacts f;
  CHECK_THROWS_AS(zero::resolve_settings(config(2, "fp32"), o, f), ConfigError);
  CHECK_THROWS_WITH(zero::resolve_settings(config(2, "fp32"), o, f),
                    Contains("communicator runs on cpu"));
}

TEST_CASE(
    "settings: mics_shard_size must divide the world; at stage 0 it warns, and it is "
    "refused with expert parallelism",
    "[engine][settings]") {
  auto mics = [](int stage, int64_t g) {
    return config(stage, "fp32", fmt::format(R"("mics_shard_size": {})", g));
  };
  for (int64_t g : {3, 8}) {
    CHECK_THROWS_MATCHES(settings(mics(2, g), {4}), ConfigError,
                         test::Has({"settings.json", "zero_optimization.mics_shard_size",
                                    std::to_string(g), "4 ranks"}));
  }
  CHECK(settings(mics(3, 2), {4}).shard_group == 2);
  CHECK(settings(mics(1, 1), {4}).shard_group == 1);
  CHECK(settings(mics(2, 4), {4}).shard_group == 4);
  CHECK(settings(mics(3, -1), {4}).shard_group == 4);
  CHECK(settings(config(2, "fp32"), {4}).shard_group == 4);
  const zero::EngineSettings zero0 = settings(mics(0, 2), {4});
  CHECK(zero0.shard_group == 4);
  CHECK(std::any_of(zero0.warnings.begin(), zero0.warnings.end(), [](const std::string& w) {
    return w.find("mics_shard_size 2 has no effect at stage 0") != std::string::npos;
  }));
  EngineOptions o;
  o.rank_local = [](const std::string&) { return true; };
  zero::EngineFacts f;
  f.world = 4;
  CHECK_THROWS_MATCHES(zero::resolve_settings(mics(2, 2), o, f), ConfigError,
                       test::Has({"mics_shard_size", "expert parallelism"}));
  CHECK_NOTHROW(zero::resolve_settings(mics(2, 4), o, f));  // one group: nothing changes
}

TEST_CASE(
    "settings: zero_hpz_partition_size must divide the world at stage 3, apart from MiCS "
    "and offload_param; below stage 3 it warns",
    "[engine][settings]") {
  auto hpz = [](int stage, int64_t h, const std::string& more = "") {
    return config(stage, "fp32", fmt::format(R"("zero_hpz_partition_size": {}{})", h, more));
  };
  for (int64_t h : {3, 16}) {
    CHECK_THROWS_MATCHES(settings(hpz(3, h), {8}), ConfigError,
                         test::Has({"settings.json", "zero_optimization.zero_hpz_partition_size",
                                    std::to_string(h), "8 ranks"}));
  }
  CHECK(settings(hpz(3, 2), {8}).hpz_group == 2);
  CHECK(settings(hpz(3, 4), {8}).hpz_group == 4);
  CHECK(settings(hpz(3, 8), {8}).hpz_group == 1);  // the whole job: the shards themselves
  CHECK(settings(config(3, "fp32"), {8}).hpz_group == 1);
  CHECK_THROWS_MATCHES(settings(hpz(3, 2, R"(, "mics_shard_size": 4)"), {8}), ConfigError,
                       test::Has({"zero_hpz_partition_size", "mics_shard_size"}));
  CHECK_THROWS_MATCHES(settings(hpz(3, 2, R"(, "offload_param": {"device": "cpu"})"), {8}),
                       ConfigError, test::Has({"zero_hpz_partition_size", "offload_param"}));
  const zero::EngineSettings two = settings(hpz(2, 2), {8});
  CHECK(two.hpz_group == 1);
  CHECK(std::any_of(two.warnings.begin(), two.warnings.end(), [](const std::string& w) {
    return w.find("zero_hpz_partition_size 2 has no effect below stage 3") != std::string::npos;
  }));
}

TEST_CASE("settings: recompute_num_layers below 1 is refused, without recomputation it warns",
          "[engine][settings]") {
  EngineOptions o;
  zero::EngineFacts f;
  for (int64_t bad : {0, -3}) {
    o.units_per_checkpoint = bad;
    CHECK_THROWS_MATCHES(zero::resolve_settings(config(2, "fp32"), o, f), InvalidArgument,
                         test::Has({"recompute_num_layers", "at least 1", std::to_string(bad)}));
  }
  o.units_per_checkpoint = 2;
  const auto warned = [](const zero::EngineSettings& s) {
    return std::any_of(s.warnings.begin(), s.warnings.end(), [](const std::string& w) {
      return w.find("recompute_num_layers 2 has no effect") != std::string::npos;
    });
  };
  CHECK(warned(zero::resolve_settings(config(2, "fp32"), o, f)));
  o.activation_checkpointing = true;
  CHECK_FALSE(warned(zero::resolve_settings(config(2, "fp32"), o, f)));
}

// EngineOptions::kAutoKeep's budget (zero::KeepBudget), from what a device would report: the
// first step the budget sees keeps nothing and is the measure; from the next one on, 90% of
// the usable memory less the peak reserved, less the first step's activations scaled for calls
// with more rows. A resumed run (its first step numbered above 0) measures the same way.
TEST_CASE("the automatic keep budget is measured on the first step it sees", "[engine][settings]") {
  const int64_t GiB = int64_t{1} << 30;
  for (int64_t first : {0, 7}) {
    INFO("first step " << first);
    zero::KeepBudget budget;
    int reads = 0;
    zero::DeviceMemory now{10 * GiB, 0, 0};  // at the first ask: 10 GiB resident
    budget.memory = [&] {
      ++reads;
      return now;
    };
    CHECK(budget.limit(4096, first) == 0);
    now = {11 * GiB, 30 * GiB, 100 * GiB};  // the first step's peak: 20 GiB of activations
    CHECK(budget.limit(8192, first) == 0);  // still the first step: its largest call has 8192
    CHECK(budget.limit(8192, first + 1) == 60 * GiB);  // 90 − 30
    now = {0, 0, 0};                                   // read once after the first step, not again
    CHECK(budget.limit(8192, first + 2) == 60 * GiB);
    CHECK(budget.limit(4096, first + 2) == 60 * GiB);   // fewer rows: no credit
    CHECK(budget.limit(12288, first + 2) == 50 * GiB);  // 1.5× the rows: half of 20 GiB more
    CHECK(budget.limit(8192 * 5, first + 2) == 0);      // 5×: 80 GiB more, no room
    CHECK(reads == 2);
  }
  zero::KeepBudget fixed;
  fixed.fixed = 123;
  CHECK(fixed.limit(1, 0) == 123);
  CHECK(fixed.limit(1 << 20, 5) == 123);
}
