// Checkpoints: the engine's optimizer state saved at one world size and ZeRO stage resumes at
// another and continues exactly as the uninterrupted run (fp32 tolerance 2e-5, as the
// equivalence tests); checkpoint folders are atomic, `latest` names a complete one, rotation
// keeps the best, and a failure on any rank leaves earlier checkpoints intact.
#include "support/catch.hpp"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "support/build.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/schedule.hpp"

using namespace zt;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kMicro = 2, kGlobal = 8;  // the global batch every world size keeps
constexpr int64_t kSaveAt = 3, kTotal = 6;

// An engine over the tiny LLaMA at `stage`, accumulation chosen to keep kGlobal samples per step.
// `offload_ratio`: offload_optimizer.ratio, or negative for no optimizer offload.
std::unique_ptr<Engine> make_engine(const std::shared_ptr<test::TestModel>& model,
                                    const std::shared_ptr<Communicator>& comm, int stage,
                                    double offload_ratio = -1.0, int mics = -1,
                                    const std::string& zero_extra = "") {
  const int64_t accum = kGlobal / (kMicro * comm->world_size());
  std::string offload =
      offload_ratio < 0 ? ""
                        : fmt::format(R"(, "offload_optimizer": {{"device": "cpu", "ratio": {}}})",
                                      offload_ratio);
  if (mics > 0) offload += fmt::format(R"(, "mics_shard_size": {})", mics);
  if (!zero_extra.empty()) offload += ", " + zero_extra;
  DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
      R"({{"zero_optimization": {{"stage": {}, "reduce_bucket_size": 300,
           "stage3_param_persistence_threshold": 20{}}},
          "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
          "gradient_clipping": 1.0}})",
      stage, offload));
  TrainingArguments args;
  args.per_device_train_batch_size = kMicro;
  args.gradient_accumulation_steps = accum;
  args.lr_scheduler_type = "linear";  // the learning rate depends on the restored step count
  resolve_config(ds, args, ResolveContext{comm->world_size(), 16, kTotal});
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->unit_gate();
  eo.total_train_steps = kTotal;
  eo.learning_rate = learning_rate_schedule(ds, args, kTotal);
  return std::make_unique<Engine>(model, ds, comm, eo);
}

// Optimizer steps [from, to) on the world-independent global batches.
void train(Engine& engine, test::TestModel& model, int64_t from, int64_t to) {
  const int world = engine.communicator().world_size(), rank = engine.communicator().rank();
  const int accum = engine.gradient_accumulation_steps();
  for (int64_t s = from; s < to; ++s) {
    const double divisor = static_cast<double>(test::make_batch("llm", s, 0, kGlobal).tokens());
    for (int m = 0; m < accum; ++m) {
      test::Batch b = test::make_batch("llm", s, (m * world + rank) * kMicro, kMicro);
      engine.backward(model.loss_sum(b.inputs, b.labels), divisor);
      engine.step();
    }
  }
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE(v != nullptr);
  return v;
}

}  // namespace

// Phase "save": train kSaveAt steps, checkpoint, train on to kTotal and record the parameters.
// Phase "resume": load the checkpoint (any world size / stage), train on to kTotal, compare.
TEST_CASE("rank: engine state resumes across world sizes", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string dir = env("ZT_DIR"), phase = env("ZT_PHASE");
  const int stage = std::stoi(env("ZT_STAGE"));
  const char* ratio = std::getenv("ZT_OFFLOAD_RATIO");             // partial offload's runs only
  const char* mics = std::getenv("ZT_MICS");                       // MiCS runs only
  const char* extra = std::getenv("ZT_ZERO_EXTRA");                // more zero_optimization keys
  const char* tolerance = std::getenv("ZT_TOLERANCE");             // quantized runs' band
  auto model = test::make_model("llm", phase == "save" ? 7 : 99);  // resume starts elsewhere
  auto engine = make_engine(model, comm, stage, ratio ? std::stod(ratio) : -1.0,
                            mics ? std::atoi(mics) : -1, extra ? extra : "");
  if (phase == "save") {
    train(*engine, *model, 0, kSaveAt);
    CheckpointWriter writer(*comm, dir, kSaveAt);
    save_engine_state(*engine, writer.dir());
    writer.commit(true);
    train(*engine, *model, kSaveAt, kTotal);
    auto params = engine->gather_full_parameters();
    if (comm->rank() == 0) save_safetensors(dir + "/uninterrupted.safetensors", params);
    comm->barrier();
    return;
  }
  const std::string ckpt = dir + "/checkpoint-" + std::to_string(kSaveAt);
  load_engine_state(*engine, ckpt);
  CHECK(engine->global_step() == kSaveAt);
  train(*engine, *model, kSaveAt, kTotal);
  auto params = engine->gather_full_parameters();
  if (comm->rank() == 0) {
    SafetensorsFile want(dir + "/uninterrupted.safetensors");
    for (const auto& [name, value] : params) {
      INFO(name);
      CHECK((value.to(at::kFloat) - want.load(name)).abs().max().item<double>() <
            (tolerance ? std::stod(tolerance) : 2e-5));
    }
  }
  comm->barrier();
}

TEST_CASE("optimizer state saved at 2 ranks resumes at 1, 2 and 4 ranks and other stages",
          "[checkpoint][engine]") {
  if (test::skip_cpu_world(4)) return;
  struct Resume {
    int world, stage;
  };
  for (int saved_stage : {1, 3}) {
    const std::string dir = test::temp_dir("resume");
    test::run_ranks(
        2, "rank: engine state resumes across world sizes", std::chrono::seconds(240),
        {{"ZT_DIR", dir}, {"ZT_PHASE", "save"}, {"ZT_STAGE", std::to_string(saved_stage)}});
    for (Resume r : {Resume{1, saved_stage}, Resume{2, saved_stage == 3 ? 0 : 3}, Resume{4, 2}}) {
      INFO("saved at stage " << saved_stage << ", resumed at world " << r.world << " stage "
                             << r.stage);
      test::run_ranks(
          r.world, "rank: engine state resumes across world sizes", std::chrono::seconds(240),
          {{"ZT_DIR", dir}, {"ZT_PHASE", "resume"}, {"ZT_STAGE", std::to_string(r.stage)}});
    }
  }
}

TEST_CASE("MiCS shard groups' checkpoints resume without them, at other world sizes, and back",
          "[checkpoint][engine]") {
  if (test::skip_cpu_world(4)) return;
  struct Run {
    int world, stage, mics;
  };
  auto run = [](const std::string& dir, const std::string& phase, Run r) {
    INFO(phase << " at world " << r.world << " stage " << r.stage << " mics_shard_size " << r.mics);
    test::run_ranks(r.world, "rank: engine state resumes across world sizes",
                    std::chrono::seconds(240),
                    {{"ZT_DIR", dir},
                     {"ZT_PHASE", phase},
                     {"ZT_STAGE", std::to_string(r.stage)},
                     {"ZT_MICS", std::to_string(r.mics)}});
  };
  // Each group of two holds a copy: only the first writes its slices.
  const std::string hybrid = test::temp_dir("resume-mics");
  run(hybrid, "save", Run{4, 3, 2});
  for (Run r : {Run{1, 3, -1}, Run{2, 2, 1}, Run{4, 1, 2}}) run(hybrid, "resume", r);
  const std::string plain = test::temp_dir("resume-plain");
  run(plain, "save", Run{2, 1, -1});
  run(plain, "resume", Run{4, 3, 2});
}

TEST_CASE(
    "hpZ and the quantized exchanges save the plain stage's state: their checkpoints "
    "resume without them and at other world sizes",
    "[checkpoint][engine]") {
  if (test::skip_cpu_world(4)) return;
  struct Run {
    int world, stage;
    std::string extra;
    double tolerance;
  };
  auto run = [](const std::string& dir, const std::string& phase, const Run& r) {
    INFO(phase << " at world " << r.world << " stage " << r.stage << " with {" << r.extra << "}");
    test::run_ranks(r.world, "rank: engine state resumes across world sizes",
                    std::chrono::seconds(240),
                    {{"ZT_DIR", dir},
                     {"ZT_PHASE", phase},
                     {"ZT_STAGE", std::to_string(r.stage)},
                     {"ZT_ZERO_EXTRA", r.extra},
                     {"ZT_TOLERANCE", fmt::format("{}", r.tolerance)},
                     {"ZT_RANKS_PER_NODE", "2"}});
  };
  const std::string hpz = R"("zero_hpz_partition_size": 2)";
  const std::string quantized =
      R"("zero_quantized_weights": true, "zero_quantized_gradients": true)";
  // hpZ is exact: the resumed plain run is the uninterrupted one. The quantized runs are within
  // their noise of it over the three steps after the resume.
  const std::string exact = test::temp_dir("resume-hpz");
  run(exact, "save", Run{4, 3, hpz, 0});
  run(exact, "resume", Run{2, 3, "", 2e-5});
  run(exact, "resume", Run{4, 3, quantized, 2e-2});
  const std::string noisy = test::temp_dir("resume-qg");
  run(noisy, "save", Run{4, 2, R"("zero_quantized_gradients": true)", 0});
  run(noisy, "resume", Run{1, 3, "", 2e-2});
  run(noisy, "resume", Run{4, 3, hpz + ", " + quantized, 2e-2});
}

TEST_CASE("partially offloaded optimizer state resumes with another share offloaded, or none",
          "[checkpoint][engine][offload]") {
  if (test::skip_cpu_world(4)) return;
  // Saved with half the state on the device side (offload_optimizer.ratio 0.5): the checkpoint
  // must hold the device share's latest values, and a resume must put them back there.
  const std::string dir = test::temp_dir("resume-partial");
  auto run = [&](int world, int stage, const std::string& phase, const char* ratio) {
    std::vector<std::pair<std::string, std::string>> env{
        {"ZT_DIR", dir}, {"ZT_PHASE", phase}, {"ZT_STAGE", std::to_string(stage)}};
    if (ratio != nullptr) env.emplace_back("ZT_OFFLOAD_RATIO", ratio);
    test::run_ranks(world, "rank: engine state resumes across world sizes",
                    std::chrono::seconds(240), env);
  };
  run(2, 2, "save", "0.5");
  for (auto [world, ratio] :
       {std::pair<int, const char*>{1, "1"}, {2, nullptr}, {4, "0.3"}, {2, "0.5"}}) {
    INFO("resumed at world " << world << ", ratio " << (ratio ? ratio : "none"));
    run(world, 2, "resume", ratio);
  }
}

TEST_CASE("rank: a failed save leaves earlier checkpoints intact", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string dir = env("ZT_DIR");
  CheckpointWriter first(*comm, dir, 1);
  if (comm->rank() == 0) files::write_atomic(first.dir() + "/marker", "one");
  first.commit(true);
  CheckpointWriter second(*comm, dir, 2);
  if (comm->rank() == 0) files::write_atomic(second.dir() + "/marker", "two");
  // Rank 1 fails its part of the save: every rank learns it and nothing is renamed.
  CHECK_THROWS_WITH(second.commit(comm->rank() != 1),
                    Contains("rank(s) 1") && Contains("checkpoint-2"));
  comm->barrier();
  auto all = list_checkpoints(dir);
  REQUIRE(all.size() == 1);
  CHECK(all[0].step == 1);
  CHECK(latest_checkpoint(dir) == dir + "/checkpoint-1");
  CHECK(files::read_text(dir + "/checkpoint-1/marker") == "one");
  CHECK_FALSE(fs::exists(second.dir()));
  comm->barrier();
}

TEST_CASE("a failure on any rank aborts the save everywhere and keeps the previous checkpoint",
          "[checkpoint]") {
  if (test::skip_cpu_world(2)) return;
  test::run_ranks(2, "rank: a failed save leaves earlier checkpoints intact",
                  std::chrono::seconds(120), {{"ZT_DIR", test::temp_dir("failed_save")}});
}

TEST_CASE("checkpoint folders: atomic names, latest, rotation keeping the best", "[checkpoint]") {
  const std::string dir = test::temp_dir("rotation");
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (int64_t step : {10, 20, 30, 40}) {
    CheckpointWriter w(*comm, dir, step);
    // While being written the folder is invisible to list/latest.
    CHECK(list_checkpoints(dir).size() == std::min<size_t>(static_cast<size_t>(step / 10 - 1), 2));
    CHECK(fs::path(w.dir()).filename().string().rfind("checkpoint-", 0) != 0);
    // Keep at most 2, always keeping checkpoint-10 (the "best").
    w.commit(true, 2, dir + "/checkpoint-10");
    CHECK(files::read_text(dir + "/latest") == fmt::format("checkpoint-{}\n", step));
  }
  auto all = list_checkpoints(dir);
  REQUIRE(all.size() == 2);
  CHECK(all[0].step == 10);
  CHECK(all[1].step == 40);
  CHECK(latest_checkpoint(dir) == dir + "/checkpoint-40");
  // A pointer to something that is not there falls back to the highest step.
  files::write_atomic(dir + "/latest", "checkpoint-999\n");
  CHECK(latest_checkpoint(dir) == dir + "/checkpoint-40");
  // Existing checkpoints are never overwritten.
  CHECK_THROWS_WITH(CheckpointWriter(*comm, dir, 40),
                    Contains("checkpoint-40") && Contains("never overwritten"));
  // An interrupted save (its temporary folder left behind) is not a checkpoint.
  fs::create_directories(dir + "/.tmp-checkpoint-50/optimizer");
  CHECK(latest_checkpoint(dir) == dir + "/checkpoint-40");
  CHECK(list_checkpoints(test::temp_dir("empty")).empty());
  CHECK_FALSE(latest_checkpoint(test::temp_dir("empty")).has_value());
}

TEST_CASE("resuming with another model or method is an error naming the difference",
          "[checkpoint][errors]") {
  const std::string dir = test::temp_dir("mismatch");
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    auto model = test::make_model("llm", 1);
    auto engine = make_engine(model, comm, 1);
    CheckpointWriter w(*comm, dir, 1);
    save_engine_state(*engine, w.dir());
    w.commit(true);
  }
  // The MLP has none of these parameters.
  auto other = test::make_model("mlp", 1);
  auto engine = make_engine(other, comm, 1);
  CHECK_THROWS_WITH(load_engine_state(*engine, dir + "/checkpoint-1"),
                    Contains("checkpoint-1") && Contains("no state"));
  // A corrupt shard file is named.
  const std::string shard = dir + "/checkpoint-1/optimizer/rank-00000-of-00001.safetensors";
  fs::resize_file(shard, fs::file_size(shard) / 2);
  auto model = test::make_model("llm", 1);
  auto again = make_engine(model, comm, 1);
  CHECK_THROWS_WITH(load_engine_state(*again, dir + "/checkpoint-1"),
                    Contains("rank-00000-of-00001"));
  CHECK_THROWS_WITH(load_engine_state(*again, dir), Contains("layout.json"));
}

TEST_CASE("merge streams tensor by tensor: memory stays near the largest tensor",
          "[checkpoint][merge]") {
  // A model of ~130 MB in fp32 whose largest tensor (the embedding) is 16 MB.
  const ModelConfig c =
      parse_model_config(R"({"model_type": "llama", "vocab_size": 8192, "hidden_size": 512,
      "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
      "max_position_embeddings": 256, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})");
  const std::string dir = test::temp_dir("merge_mem");
  int64_t model_bytes = 0;
  {
    auto comm = std::shared_ptr<Communicator>(test::join());
    auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
    for (const auto& p : model->parameters()) model_bytes += p.numel() * 4;
    DeepSpeedConfig ds =
        parse_deepspeed_config(R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})");
    TrainingArguments args;
    resolve_config(ds, args, ResolveContext{1, c.hidden_size, 1});
    EngineOptions eo;
    eo.source = random_source(c, 3);
    eo.total_train_steps = 1;
    Engine engine(model, ds, comm, eo);
    CheckpointWriter w(*comm, dir, 1);
    save_engine_state(engine, w.dir());
    files::write_atomic(w.dir() + "/config.json", model_config_json(c));
    w.commit(true);
  }
  MergeReport report = merge_checkpoint(dir + "/checkpoint-1", dir + "/merged");
  const int64_t largest_fp32 = 8192 * 512 * 4;
  INFO("peak RssAnon growth " << report.peak_rss_anon_bytes << " bytes; model " << model_bytes
                              << " bytes");
  CHECK(report.largest_tensor_bytes == largest_fp32 / 2);  // bf16, the model's own dtype
  if (test::kAddressSanitizer) {
    WARN("resident-memory bound not checked: AddressSanitizer's quarantine keeps freed memory");
  } else {
    CHECK(report.peak_rss_anon_bytes < 3 * largest_fp32 + (4 << 20));
  }
  CHECK(3 * largest_fp32 + (4 << 20) < model_bytes / 2);
  // The merged folder holds the masters in the model's dtype.
  SafetensorsCheckpoint merged(dir + "/merged");
  auto values = checkpoint_master_source(dir + "/checkpoint-1");
  at::Tensor want = at::empty({8192, 512});
  values->read("model.embed_tokens.weight", {8192, 512}, 0, want);
  CHECK(merged.info("model.embed_tokens.weight").dtype == at::kBFloat16);
  CHECK(at::equal(merged.load("model.embed_tokens.weight"), want.to(at::kBFloat16)));
  // Sharded output, as HF writes it, with a small shard limit.
  MergeOptions small;
  small.max_shard_bytes = 20 << 20;
  small.dtype = at::kFloat;
  MergeReport sharded = merge_checkpoint(dir + "/checkpoint-1", dir + "/sharded", small);
  CHECK(fs::exists(dir + "/sharded/model.safetensors.index.json"));
  CHECK(fs::exists(dir + "/sharded/model-00001-of-" +
                   fmt::format("{:05d}", sharded.files.size() - 2) + ".safetensors"));
  CHECK(at::equal(SafetensorsCheckpoint(dir + "/sharded").load("model.embed_tokens.weight"), want));
  // An output folder that holds something is never written into.
  CHECK_THROWS_WITH(merge_checkpoint(dir + "/checkpoint-1", dir + "/merged"),
                    Contains("not empty"));
}
