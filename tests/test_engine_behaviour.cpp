// Engine behaviour across real ranks (Gloo): overflow skipping, non-finite errors, overlap of
// gradient reduction with backward, memory per rank against the ZeRO formulas, the stage-3
// live-parameter bound, identical initial weights whatever the stage, and updates inside
// backward.
#include "support/catch.hpp"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "support/counting_allocator.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"

using namespace zt;

namespace {

struct Setup {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<test::TestModel> model;
  std::unique_ptr<Engine> engine;
};

// An engine over `kind` with the given zero_optimization body and precision.
// `top_extra`: more top-level DeepSpeed keys; `in_backward`: EngineOptions::update_in_backward.
Setup make_engine(std::shared_ptr<Communicator> comm, const std::string& kind, int stage,
                  const std::string& dtype, const std::string& zero_extra = "", bool trace = false,
                  int accum = 1, const std::string& top_extra = "", bool in_backward = false,
                  double weight_decay = 0.0, bool unused_parameter = false,
                  bool checkpointing = false, bool overlap_step_gather = true) {
  Setup s;
  s.comm = std::move(comm);
  s.model = test::make_model(kind, 99);
  // A trainable parameter the loss never uses: it gets no gradient, only weight decay.
  if (unused_parameter) s.model->register_parameter("unused", at::ones({5}));
  DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
      R"({{"zero_optimization": {{"stage": {}{}}}, "optimizer": {{"type": "AdamW",
          "params": {{"lr": 0.01, "weight_decay": {}}}}}{}}})",
      stage, zero_extra.empty() ? "" : ", " + zero_extra, weight_decay,
      top_extra.empty() ? "" : ", " + top_extra));
  TrainingArguments args;
  apply_training_json(args, fmt::format(R"({{"per_device_train_batch_size": 2,
      "gradient_accumulation_steps": {}, "lr_scheduler_type": "constant", "fp16": {},
      "bf16": {}}})",
                                        accum, dtype == "fp16", dtype == "bf16"));
  resolve_config(ds, args, ResolveContext{s.comm->world_size(), 16, 10});
  EngineOptions eo;
  eo.units = s.model->units();
  eo.gate = &s.model->unit_gate();  // the CausalLM-based kinds have their own
  eo.total_train_steps = 10;
  eo.trace = trace;
  eo.update_in_backward = in_backward;
  eo.activation_checkpointing = checkpointing;
  eo.overlap_step_gather = overlap_step_gather;
  // Checkpointing recomputes every unit here, the embedding and the head too: each unit's
  // backward is then a node of its own, and a weight they share gets a gradient from each.
  if (checkpointing) {
    for (UnitSpec& u : eo.units) u.recompute = true;
  }
  s.engine = std::make_unique<Engine>(s.model, ds, s.comm, eo);
  return s;
}

void train_step(Setup& s, const std::string& kind, int64_t step, double loss_factor = 1.0) {
  const int rank = s.comm->rank(), world = s.comm->world_size();
  const int accum = s.engine->gradient_accumulation_steps();
  for (int m = 0; m < accum; ++m) {
    test::Batch b = test::make_batch(kind, step, (m * world + rank) * 2, 2);
    at::Tensor loss = s.model->loss_sum(b.inputs, b.labels) * loss_factor;
    s.engine->backward(loss, 10.0);
    s.engine->step();
  }
}

int64_t total_numel(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.second.numel();
  return n;
}

bool same_values(const std::vector<std::pair<std::string, at::Tensor>>& a,
                 const std::vector<std::pair<std::string, at::Tensor>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first ||
        !at::equal(a[i].second.to(at::kFloat), b[i].second.to(at::kFloat))) {
      return false;
    }
  }
  return true;
}

}  // namespace

// ---- fp16 overflow on one rank skips the step everywhere ----------------------------------------

TEST_CASE("rank: engine overflow skip", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const char* extra = std::getenv("ZT_ZERO_EXTRA");  // qgZ: int8 blocks carry the overflow too
  Setup s = make_engine(comm, "mlp", 2, "fp16", extra ? extra : "");
  train_step(s, "mlp", 0);
  REQUIRE_FALSE(s.engine->last_step_skipped());
  auto before = s.engine->gather_full_parameters();
  const double scale = s.engine->loss_scale();
  // Rank 1 produces an infinite gradient; every rank must skip and halve the scale.
  train_step(s, "mlp", 1, comm->rank() == 1 ? std::numeric_limits<double>::infinity() : 1.0);
  CHECK(s.engine->last_step_skipped());
  CHECK(s.engine->loss_scale() == scale / 2);
  CHECK(same_values(before, s.engine->gather_full_parameters()));
  train_step(s, "mlp", 2);
  CHECK_FALSE(s.engine->last_step_skipped());
  CHECK_FALSE(same_values(before, s.engine->gather_full_parameters()));
}

TEST_CASE("engine: an fp16 overflow on one rank skips the step on every rank", "[engine]") {
  if (test::skip_cpu_world(2)) return;
  test::run_ranks(2, "rank: engine overflow skip");
  test::run_ranks(2, "rank: engine overflow skip", std::chrono::seconds(180),
                  {{"ZT_ZERO_EXTRA", R"("zero_quantized_gradients": true)"}});
}

// ---- a non-finite loss in fp32/bf16 is an error naming the step ---------------------------------

TEST_CASE("rank: engine nonfinite", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  Setup s = make_engine(comm, "mlp", 1, std::getenv("ZT_DTYPE"));
  train_step(s, "mlp", 0);
  try {
    train_step(s, "mlp", 1, comm->rank() == 0 ? std::nan("") : 1.0);
    FAIL("a NaN loss was trained on");
  } catch (const NumericError& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("optimizer step 2"));
  }
}

TEST_CASE("engine: a non-finite loss in fp32 or bf16 stops every rank with the step number",
          "[engine]") {
  if (test::skip_cpu_world(2)) return;
  for (const char* dtype : {"fp32", "bf16"}) {
    test::run_ranks(2, "rank: engine nonfinite", std::chrono::seconds(120), {{"ZT_DTYPE", dtype}});
  }
}

// ---- gradient buckets overlap backward only with overlap_comm -----------------------------------

TEST_CASE("rank: engine overlap trace", "[.rank]") {
  const bool overlap = std::string(std::getenv("ZT_OVERLAP")) == "1";
  auto comm = std::shared_ptr<Communicator>(test::join());
  Setup s = make_engine(comm, "transformer", 2, "fp32",
                        fmt::format(R"("reduce_bucket_size": 300, "overlap_comm": {})", overlap),
                        /*trace=*/true, /*accum=*/2);
  train_step(s, "transformer", 0);
  int during = 0, after = 0;
  bool in_backward = false;
  for (const TraceEvent& e : s.engine->trace()) {
    if (e.kind == TraceEvent::Kind::kBackwardBegin) in_backward = true;
    if (e.kind == TraceEvent::Kind::kBackwardEnd) in_backward = false;
    if (e.kind == TraceEvent::Kind::kBucketLaunch) (in_backward ? during : after) += 1;
  }
  INFO("launches during backward " << during << ", after " << after);
  CHECK(during + after >= 2 * 3);  // several buckets, two micro-steps (stage 2 reduces each)
  if (overlap) {
    CHECK(during > 0);
  } else {
    CHECK(during == 0);
  }
}

TEST_CASE("engine: with overlap_comm buckets are reduced while backward runs, without it after",
          "[engine]") {
  if (test::skip_cpu_world(2)) return;
  test::run_ranks(2, "rank: engine overlap trace", std::chrono::seconds(120),
                  {{"ZT_OVERLAP", "1"}});
  test::run_ranks(2, "rank: engine overlap trace", std::chrono::seconds(120),
                  {{"ZT_OVERLAP", "0"}});
}

// ---- stages 1-2: a step's parameter all-gathers overlap the next forward
// -------------------------

TEST_CASE("rank: engine step gather overlap", "[.rank]") {
  const int stage = std::atoi(std::getenv("ZT_STAGE"));
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string zero = R"("reduce_bucket_size": 300)";  // many small buckets
  Setup on = make_engine(comm, "transformer", stage, "fp32", zero, /*trace=*/true);
  Setup off = make_engine(comm, "transformer", stage, "fp32", zero, true, 1, "", false, 0.0, false,
                          false, /*overlap_step_gather=*/false);
  using Kind = TraceEvent::Kind;
  for (int64_t step = 0; step < 3; ++step) {
    const size_t from = on.engine->trace().size();
    train_step(on, "transformer", step);
    train_step(off, "transformer", step);
    // Each wait of `on` comes after the unit it serves started, before backward, in unit order.
    const std::vector<TraceEvent>& trace = on.engine->trace();
    std::vector<int> wait_units;
    int unit = -1;
    bool forward = true;
    for (size_t i = from; i < trace.size(); ++i) {
      if (trace[i].kind == Kind::kBackwardBegin) forward = false;
      if (trace[i].kind == Kind::kUnitRun && forward) unit = trace[i].index;
      if (trace[i].kind == Kind::kParameterWait) {
        CHECK(forward);
        CHECK(unit >= 0);
        wait_units.push_back(unit);
      }
    }
    INFO("step " << step << ": waits at units " << fmt::format("{}", fmt::join(wait_units, " ")));
    if (step == 0) {
      CHECK(wait_units.empty());  // nothing was published before the first step
    } else {
      CHECK(wait_units.size() >= 3);
      CHECK(std::is_sorted(wait_units.begin(), wait_units.end()));
      CHECK(std::set<int>(wait_units.begin(), wait_units.end()).size() >= 2);  // spread out
    }
    for (const TraceEvent& e : off.engine->trace()) CHECK(e.kind != Kind::kParameterWait);
  }
  // Until waited for, `on`'s parameters in units hold the step before's values; the final norm,
  // in no unit, is gathered within the step. Then both compute copies are the same.
  auto mine = on.model->named_parameters(true), theirs = off.model->named_parameters(true);
  bool stale = false;
  for (const auto& item : mine) {
    const bool same = at::equal(item.value(), theirs[item.key()]);
    if (item.key().rfind("norm.", 0) == 0) CHECK(same);
    stale = stale || !same;
  }
  CHECK(stale);
  on.engine->wait_for_parameters();
  for (const auto& item : mine) {
    INFO(item.key());
    CHECK(at::equal(item.value(), theirs[item.key()]));
  }
  CHECK(same_values(on.engine->gather_full_parameters(), off.engine->gather_full_parameters()));
}

TEST_CASE(
    "engine: at stages 1 and 2 a step's parameter all-gathers are waited for unit by unit "
    "in the next forward, with the same values",
    "[engine]") {
  for (const auto& [world, stage] : {std::pair{2, "1"}, {2, "2"}, {4, "2"}, {8, "1"}}) {
    if (test::skip_cpu_world(world)) continue;
    test::run_ranks(world, "rank: engine step gather overlap", std::chrono::seconds(120),
                    {{"ZT_STAGE", stage}});
  }
}

// ---- ranks that disagree on the hierarchy are refused on every rank, before any exchange -------

TEST_CASE("rank: engine hierarchy disagreement", "[.rank]") {
  const std::string what = std::getenv("ZT_DISAGREE");
  auto comm = std::shared_ptr<Communicator>(test::join());
  const int rank = comm->rank();
  std::string zero;
  if (what == "mics") zero = rank == 1 ? R"("mics_shard_size": 1)" : "";
  if (what == "hpz") zero = rank == 0 ? R"("zero_hpz_partition_size": 2)" : "";
  if (what == "node") {
    zero = R"("zero_quantized_gradients": true)";
    setenv("ZT_RANKS_PER_NODE", rank % 2 == 0 ? "2" : "4", 1);
  }
  if (what == "refused") zero = rank == 1 ? R"("mics_shard_size": 3)" : "";
  if (what == "badenv" || (what == "badenv1" && rank == 2)) {  // never read as 2 or 16
    zero = R"("zero_quantized_gradients": true)";
    setenv("ZT_RANKS_PER_NODE", what == "badenv" ? "2x" : "0x10", 1);
  } else if (what == "badenv1") {
    zero = R"("zero_quantized_gradients": true)";
  }
  if (what == "straddle") {  // world 6 as nodes of 3: groups of 2 would cross them
    zero = R"("zero_hpz_partition_size": 2)";
    setenv("ZT_RANKS_PER_NODE", "3", 1);
  }
  try {
    Setup s = make_engine(comm, "transformer", 3, "fp32", zero);
    FAIL("the engine was built");
  } catch (const ConfigError& e) {
    INFO(e.what());
    if (what == "refused") {
      CHECK(rank == 1);
      CHECK_THAT(e.what(), Catch::Contains("mics_shard_size: 3 does not divide"));
    } else if (what == "badenv" || what == "badenv1") {
      CHECK((what == "badenv" || rank == 2));
      CHECK_THAT(e.what(), Catch::Contains(what == "badenv" ? "ZT_RANKS_PER_NODE=2x"
                                                            : "ZT_RANKS_PER_NODE=0x10") &&
                               Catch::Contains("expected a count of ranks"));
    } else if (what == "straddle") {
      CHECK_THAT(e.what(), Catch::Contains("zero_hpz_partition_size: groups of 2 ranks straddle "
                                           "the nodes of 3 ranks"));
    } else {
      const char* key = what == "mics"  ? "mics_shard_size"
                        : what == "hpz" ? "zero_hpz_partition_size"
                                        : "ranks per node";
      CHECK_THAT(e.what(), Catch::Contains(key) && Catch::Contains("differs between the ranks"));
    }
  } catch (const DistributedError& e) {
    INFO(e.what());
    const int alone = what == "refused" ? 1 : 2;  // the rank that refused alone
    CHECK((what == "refused" || what == "badenv1"));
    CHECK(rank != alone);
    CHECK_THAT(e.what(), Catch::Contains(fmt::format("failed on rank(s) {};", alone)));
  }
}

TEST_CASE(
    "ranks with different MiCS, hpZ or node settings are refused on every rank, naming the "
    "setting, and one rank's refusal is named by the others",
    "[engine][errors]") {
  if (test::skip_cpu_world(4)) return;
  for (const char* what : {"mics", "hpz", "node", "refused", "badenv", "badenv1"}) {
    INFO(what);
    test::run_ranks(4, "rank: engine hierarchy disagreement", std::chrono::seconds(120),
                    {{"ZT_DISAGREE", what}});
  }
  // Groups that straddle nodes: the same error on every rank.
  test::run_ranks(6, "rank: engine hierarchy disagreement", std::chrono::seconds(120),
                  {{"ZT_DISAGREE", "straddle"}});
}

// ---- memory per rank follows the ZeRO formulas --------------------------------------------------

TEST_CASE("rank: engine memory", "[.rank]") {
  // Ψ parameters, N ranks, bf16 compute. zerotrain keeps fp32 master + Adam m, v (12Ψ/N) and
  // an fp32 gradient slice (4Ψ/N) per rank, so the formulas are:
  //   stage 1: 2Ψ params + 2Ψ grads + 16Ψ/N;  stage 2: 2Ψ + 16Ψ/N;  stage 3: 18Ψ/N.
  // Margin: 1% + 16 KiB (alignment padding, small scratch tensors).
  test::install_counting_allocator();
  const int stage = std::atoi(std::getenv("ZT_STAGE"));
  auto comm = std::shared_ptr<Communicator>(test::join());
  const double n = comm->world_size();
  int64_t before = test::live_cpu_bytes();
  Setup s =
      make_engine(comm, "wide", stage, "bf16",
                  R"("stage3_param_persistence_threshold": 100, "reduce_bucket_size": 70000)");
  const double psi = static_cast<double>(total_numel(s.engine->gather_full_parameters()));
  train_step(s, "wide", 0);
  // Gloo's worker threads drop their references to finished collectives' tensors a moment after
  // the waiting thread returns: settle before reading the allocator.
  comm->barrier();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // The model is built after `before`; its own fp32 parameters were released by the engine.
  const double held = static_cast<double>(test::live_cpu_bytes() - before);
  const double expected = stage == 1   ? 4 * psi + 16 * psi / n
                          : stage == 2 ? 2 * psi + 16 * psi / n
                                       : 18 * psi / n;
  EngineMemory m = s.engine->memory();
  std::printf(
      "stage %d, world %.0f, Ψ=%.0f: allocator says %.0f bytes, formula %.0f, engine "
      "accounts params %lld grads %lld optimizer %lld\n",
      stage, n, psi, held, expected, static_cast<long long>(m.compute_params),
      static_cast<long long>(m.gradients), static_cast<long long>(m.optimizer_state));
  CHECK(held <= expected * 1.01 + 16384);
  CHECK(held >= expected * 0.99 - 16384);
  const double accounted = static_cast<double>(m.compute_params + m.gradients + m.optimizer_state);
  CHECK(std::fabs(accounted - expected) <= expected * 0.01 + 16384);
}

TEST_CASE("engine: memory per rank at world 4 follows the ZeRO formulas for stages 1, 2, 3",
          "[engine][memory]") {
  if (test::skip_cpu_world(4)) return;
  for (const char* stage : {"1", "2", "3"}) {
    test::run_ranks(4, "rank: engine memory", std::chrono::seconds(120), {{"ZT_STAGE", stage}});
  }
}

// ---- stage 3 keeps gathered parameters within stage3_max_live_parameters ------------------------

TEST_CASE("rank: engine live bound", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  // A wide layer is 256·256 + 256 = 65,792 elements (65,792 padded); allow two at once.
  const int64_t bound = 2 * 65792 + 64;
  Setup s = make_engine(comm, "wide", 3, "fp32",
                        fmt::format(R"("stage3_param_persistence_threshold": 100,
                                       "stage3_max_live_parameters": {},
                                       "stage3_prefetch_bucket_size": 1000000)",
                                    bound));
  for (int64_t step = 0; step < 2; ++step) train_step(s, "wide", step);
  EngineMemory m = s.engine->memory();
  INFO("peak gathered " << m.gathered_peak << ", bound " << bound);
  CHECK(m.gathered_peak > 65792);  // parameters really are gathered and prefetched
  CHECK(m.gathered_peak <= bound);
  CHECK(m.gathered_now == 0);  // and released after use
}

TEST_CASE("engine: stage 3 never holds more gathered parameters than the live bound",
          "[engine][memory]") {
  if (test::skip_cpu_world(2)) return;
  test::run_ranks(2, "rank: engine live bound");
}

// ---- initial weights do not depend on stage or world size ---------------------------------------

TEST_CASE("rank: engine initial weights", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto reference = test::make_model("transformer", 99)->named_parameters();
  for (int stage = 0; stage <= 3; ++stage) {
    Setup s = make_engine(comm, "transformer", stage, "fp32");
    auto params = s.engine->gather_full_parameters();
    REQUIRE(params.size() == reference.size());
    for (const auto& p : params) {
      INFO("stage " << stage << " parameter " << p.first);
      CHECK(at::equal(p.second.to(at::kCPU), reference[p.first]));
    }
  }
}

TEST_CASE("engine: initial weights are the same for every stage and world size", "[engine]") {
  for (int world : {1, 2, 4}) {
    if (!test::skip_cpu_world(world)) test::run_ranks(world, "rank: engine initial weights");
  }
}

// ---- updates inside backward --------------------------------------------------------------------

TEST_CASE("engine: updates inside backward equal updates in step(), with no gradient buffer",
          "[engine]") {
  auto comm = std::shared_ptr<Communicator>(create_communicator(LaunchEnv{}, CommOptions{}));
  const std::string no_clip = R"("gradient_clipping": 0.0)";
  // fp32: the masters are the parameters; bf16: fp32 masters updated from bf16 gradients and
  // written back into the bf16 parameters by the same update.
  for (const std::string dtype : {"fp32", "bf16"}) {
    // llm_tied: the embedding and the head share a weight; with checkpointing each unit runs
    // as a node of its own, so the shared weight's gradient comes in one share per unit.
    for (const std::string kind : {"transformer", "llm", "llm_tied", "mlp"}) {
      for (const auto& [stage, ckpt] : {std::pair{0, false}, {2, false}, {2, true}}) {
        if (ckpt && kind.rfind("llm", 0) != 0) continue;
        INFO(dtype << ", " << kind << ", stage " << stage << (ckpt ? ", checkpointing" : ""));
        const bool unused = kind == "mlp";
        Setup plain =
            make_engine(comm, kind, stage, dtype, "", false, 1, no_clip, false, 0.1, unused, ckpt);
        Setup fused =
            make_engine(comm, kind, stage, dtype, "", false, 1, no_clip, true, 0.1, unused, ckpt);
        CHECK_FALSE(plain.engine->updates_in_backward());
        REQUIRE(fused.engine->updates_in_backward());
        CHECK(plain.engine->memory().gradients > 0);
        CHECK(fused.engine->memory().gradients == 0);
        for (int64_t step = 0; step < 4; ++step) {
          train_step(plain, kind, step);
          train_step(fused, kind, step);
          CHECK(fused.engine->global_step() == step + 1);
          CHECK(fused.engine->learning_rate() == plain.engine->learning_rate());
          CHECK(fused.engine->last_grad_norm() ==
                Approx(plain.engine->last_grad_norm()).epsilon(1e-5));
        }
        const auto a = plain.engine->gather_full_parameters(),
                   b = fused.engine->gather_full_parameters();
        REQUIRE(a.size() == b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          INFO(a[i].first);
          CHECK(at::allclose(a[i].second, b[i].second, 1e-6, 1e-7));
          const at::Tensor initial =
              a[i].first == "unused" ? at::ones({5})
                                     : test::make_model(kind, 99)->named_parameters()[a[i].first];
          CHECK_FALSE(at::equal(a[i].second, initial));
        }
        // The optimizer state is the same too: a checkpoint does not know the difference.
        const auto sa = plain.engine->state_pieces(), sb = fused.engine->state_pieces();
        REQUIRE(sa.size() == sb.size());
        for (size_t i = 0; i < sa.size(); ++i) {
          for (size_t k = 0; k < sa[i].second.size(); ++k) {
            CHECK(at::allclose(sa[i].second[k], sb[i].second[k], 1e-6, 1e-7));
          }
        }
        CHECK(plain.engine->state().optimizer_steps == fused.engine->state().optimizer_steps);
        // The parameters the model computes with: the updated masters, rounded.
        const auto pa = plain.model->named_parameters(), pb = fused.model->named_parameters();
        for (const auto& item : pa) {
          INFO("compute copy " << item.key());
          CHECK(at::equal(item.value(), pb[item.key()]));
        }
      }
    }
  }
}

TEST_CASE("engine: updates stay in step() where backward cannot apply them", "[engine]") {
  auto comm = std::shared_ptr<Communicator>(create_communicator(LaunchEnv{}, CommOptions{}));
  const std::string no_clip = R"("gradient_clipping": 0.0)";
  // Clipping needs the global norm first; accumulation sums micro-steps; fp16 may skip.
  CHECK_FALSE(make_engine(comm, "mlp", 2, "fp32", "", false, 1, R"("gradient_clipping": 1.0)", true)
                  .engine->updates_in_backward());
  CHECK_FALSE(make_engine(comm, "mlp", 2, "fp32", "", false, 2, no_clip, true)
                  .engine->updates_in_backward());
  CHECK_FALSE(make_engine(comm, "mlp", 2, "fp16", "", false, 1, no_clip, true)
                  .engine->updates_in_backward());
  // Stage 3 with partitioned units (here: parameters offloaded) gathers per unit call; at one
  // rank without offload it runs as stage 2 and may update inside backward.
  CHECK_FALSE(make_engine(comm, "mlp", 3, "fp32", R"("offload_param": {"device": "cpu"})", false, 1,
                          no_clip, true)
                  .engine->updates_in_backward());
  CHECK(make_engine(comm, "mlp", 3, "fp32", "", false, 1, no_clip, true)
            .engine->updates_in_backward());
  // An update already applied cannot be rescaled at the boundary.
  Setup fused = make_engine(comm, "mlp", 2, "fp32", "", false, 1, no_clip, true);
  REQUIRE(fused.engine->updates_in_backward());
  test::Batch b = test::make_batch("mlp", 0, 0, 2);
  fused.engine->backward(fused.model->loss_sum(b.inputs, b.labels), 10.0);
  CHECK_THROWS_WITH(fused.engine->step(2.0), Catch::Contains("backward(loss, divisor)"));
}

namespace {

// One unit (a weight of four ones) behind a gate, under `stage` at one rank: stage 0 with
// activation checkpointing, or stage 3 — which partitions, and so recomputes, at one rank only
// with its parameters offloaded; without, it runs as stage 2 and recomputes nothing.
struct OneUnit {
  struct Inner : torch::nn::Module {
    at::Tensor w;
    Inner() { w = register_parameter("w", at::ones({4})); }
  };
  struct Outer : torch::nn::Module {
    UnitGate gate;
    std::shared_ptr<Inner> inner;
    Outer() { inner = register_module("inner", std::make_shared<Inner>()); }
  };
  std::shared_ptr<Outer> model = std::make_shared<Outer>();
  std::unique_ptr<Engine> engine;
  bool recomputes;
  std::string name;  ///< the case, for INFO

  OneUnit(const std::shared_ptr<Communicator>& comm, int stage, bool offload)
      : recomputes(stage == 0 || offload),
        name(fmt::format("stage {}{}{}", stage, stage == 0 ? " with activation checkpointing" : "",
                         offload ? ", parameters offloaded" : "")) {
    DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
        R"({{"zero_optimization": {{"stage": {}, "stage3_param_persistence_threshold": 0{}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}})",
        stage, offload ? R"(, "offload_param": {"device": "cpu"})" : ""));
    TrainingArguments args;
    args.lr_scheduler_type = "constant";
    resolve_config(ds, args, ResolveContext{1, 4, 1});
    EngineOptions eo;
    eo.units = {UnitSpec{"inner", model->inner}};
    eo.gate = &model->gate;
    eo.activation_checkpointing = stage == 0;
    engine = std::make_unique<Engine>(model, ds, comm, eo);
  }
};

const std::pair<int, bool> kOneUnitCases[] = {{0, false}, {3, true}, {3, false}};

}  // namespace

// ---- recomputation is visible to the unit
// ---------------------------------------------------------

TEST_CASE("engine: a unit knows when backward recomputes it, and only then", "[engine]") {
  auto comm = std::shared_ptr<Communicator>(create_communicator(LaunchEnv{}, CommOptions{}));
  for (const auto& [stage, offload] : kOneUnitCases) {
    OneUnit u(comm, stage, offload);
    INFO(u.name);
    auto& model = u.model;
    Engine& engine = *u.engine;
    std::vector<bool> seen;
    at::Tensor y = model->gate(0, {at::ones({2, 4}).requires_grad_(true)},
                               [&seen, inner = model->inner](const std::vector<at::Tensor>& in) {
                                 seen.push_back(recomputing_for_backward());
                                 return std::vector<at::Tensor>{in[0] * inner->w};
                               })[0];
    CHECK_FALSE(recomputing_for_backward());
    engine.backward(y.sum(), 1.0);
    CHECK(engine.step());
    const bool recomputes = u.recomputes;
    CHECK(seen == (recomputes ? std::vector<bool>{false, true} : std::vector<bool>{false}));
    CHECK_FALSE(recomputing_for_backward());
  }
}

TEST_CASE("engine: what a unit keeps in its first pass comes back, in order, to its recomputation",
          "[engine]") {
  // Outside a recomputed unit nothing is kept.
  CHECK_FALSE(keep_for_recompute(at::ones({2})));
  CHECK_FALSE(kept_for_recompute().defined());
  auto comm = std::shared_ptr<Communicator>(create_communicator(LaunchEnv{}, CommOptions{}));
  for (const auto& [stage, offload] : kOneUnitCases) {
    OneUnit u(comm, stage, offload);
    INFO(u.name);
    auto& model = u.model;
    Engine& engine = *u.engine;
    std::vector<bool> kept;         // first pass: what keep_for_recompute answered
    std::vector<at::Tensor> first;  // first pass: the values kept
    // Recomputation: what came back, one call per tensor kept and one more.
    std::vector<at::Tensor> returned;
    const at::Tensor x = at::arange(8, at::kFloat).view({2, 4}).requires_grad_(true);
    at::Tensor y =
        model->gate(0, {x}, [&, inner = model->inner](const std::vector<at::Tensor>& in) {
          if (!recomputing_for_backward()) {
            for (double f : {2.0, 3.0}) {
              first.push_back(in[0].detach() * f);
              kept.push_back(keep_for_recompute(first.back()));
            }
          } else {
            for (int i = 0; i < 3; ++i) returned.push_back(kept_for_recompute());
          }
          return std::vector<at::Tensor>{in[0] * inner->w};
        })[0];
    engine.backward(y.sum(), 1.0);
    CHECK(engine.step());
    const bool recomputes = u.recomputes;
    CHECK(kept == std::vector<bool>{recomputes, recomputes});
    if (!recomputes) {
      CHECK(returned.empty());
      continue;
    }
    REQUIRE(returned.size() == 3);
    REQUIRE(returned[0].defined());
    REQUIRE(returned[1].defined());
    CHECK(at::equal(returned[0], first[0]));
    CHECK(at::equal(returned[1], first[1]));
    CHECK_FALSE(returned[2].defined());  // nothing more was kept
    CHECK(at::allclose(x.grad(), at::ones({2, 4})));
  }
}
