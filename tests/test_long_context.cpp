// Long context (docs/long_context.md). Ulysses sequence parallelism (CausalLM::
// set_sequence_parallel): groups of ranks sharing each sequence, positions swapped for heads
// around attention, against the same model whole in one process — the loss, its token count,
// every gradient and the per-token log-probabilities, summed over a group — at world 2 and 4 over
// real Gloo processes (and NCCL on the GPU machine); the trainer's runs against world 1's,
// resumed at another degree; what it refuses and how its options are spelled. The tiled MLP
// (CausalLM::set_tiled_mlp): the untiled model's values and gradients, dropout's draws replayed
// tile by tile, in the trainer at every ZeRO stage.
#include "support/catch.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/layers.hpp"
#include "model/tiled_mlp.hpp"
#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;

namespace {

std::string fixture_config(const std::string& name) {
  return std::string(ZT_FIXTURES) + "/models/" + name + "/config.json";
}

// The largest difference relative to the reference's largest value (at least 1e-3, so that a
// gradient that is all but zero is compared absolutely).
double relative(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.cpu().to(at::kDouble), w = want.cpu().to(at::kDouble);
  return (g - w).abs().max().item<double>() / std::max(1e-3, w.abs().max().item<double>());
}

// A batch the ranks of a group share: two rows of 13 positions (a multiple of neither 2 nor 4,
// so the last rank's slice is partly padding).
struct SharedBatch {
  at::Tensor ids, labels, mask, positions;
};

// "plain": every position real; "padded": the second row's last 5 positions padding; "packed":
// documents whose boundaries fall inside the slices (each document's first label -100,
// positions restarting), the second row ending in padding.
SharedBatch shared_batch(const std::string& layout, int64_t vocab) {
  at::manual_seed(31);
  const int64_t b = 2, t = 13;
  SharedBatch s;
  s.ids = at::randint(1, vocab, {b, t}, at::kLong);
  s.labels = s.ids.clone();
  s.labels.index_put_({0, 2}, -100);
  if (layout == "padded") {
    s.mask = at::ones({b, t}, at::kLong);
    s.mask.index_put_({1, at::indexing::Slice(8, t)}, 0);
    s.labels.index_put_({1, at::indexing::Slice(8, t)}, -100);
  }
  if (layout == "packed") {
    // Row 0's second document reaches 9 positions: past phi3_longrope_long's original 8, which
    // no slice of it alone reaches.
    const std::vector<std::vector<int64_t>> docs{{1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2},
                                                 {1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0}};
    s.mask = at::zeros({b, t}, at::kLong);
    s.positions = at::zeros({b, t}, at::kLong);
    for (int64_t r = 0; r < b; ++r) {
      int64_t pos = 0;
      for (int64_t i = 0; i < t; ++i) {
        const int64_t d = docs[static_cast<size_t>(r)][static_cast<size_t>(i)];
        const bool starts = i == 0 || docs[static_cast<size_t>(r)][static_cast<size_t>(i - 1)] != d;
        pos = starts ? 0 : pos + 1;
        s.mask.index_put_({r, i}, d);
        s.positions.index_put_({r, i}, d == 0 ? 0 : pos);
        if (starts || d == 0) s.labels.index_put_({r, i}, -100);
      }
    }
  }
  return s;
}

// Sums `t` over the job in place and divides by the number of groups: every group computed the
// same batch, so this is one group's sum.
at::Tensor group_sum(Communicator& comm, const at::Tensor& t, int64_t groups) {
  at::Tensor x = t.detach().to(comm.device(), at::kFloat).contiguous().clone();
  comm.all_reduce(x)->wait();
  return (x / static_cast<double>(groups)).cpu();
}

}  // namespace

TEST_CASE("rank: a sequence-parallel model", "[.rank]") {
  // ZT_SP_CUDA=1: over NCCL, the models on this rank's GPU (its LOCAL_RANK), in fp32 and then
  // in bf16 (variable-length attention over the documents).
  const bool cuda = std::getenv("ZT_SP_CUDA") != nullptr;
  const at::Device device =
      cuda ? at::Device(at::kCUDA, static_cast<int16_t>(std::atoi(std::getenv("LOCAL_RANK"))))
           : at::Device(at::kCPU);
  std::shared_ptr<Communicator> comm(test::join(cuda ? Backend::kNccl : Backend::kAuto, device));
  const int world = comm->world_size();
  const int64_t sp = std::atoi(std::getenv("ZT_SP"));
  const int64_t groups = world / sp;
  std::vector<at::ScalarType> dtypes{at::kFloat};
  if (cuda) dtypes.push_back(at::kBFloat16);
  // LLaMA (GQA: kv 2 of 4 heads, replicated at degree 4), Gemma 2 (soft-caps, a sliding
  // window), gpt-oss (sinks, windows, YaRN), Qwen3 (q/k norms), Phi-3 with LongRoPE past its
  // original length (tables that depend on the whole sequence's reach), GLM-4 (partial rotary).
  for (const char* family : {"llama", "gemma2", "gpt_oss", "qwen3", "phi3_longrope_long", "glm4"}) {
    const ModelConfig c = load_model_config(fixture_config(family));
    for (const at::ScalarType dtype : dtypes) {
      for (const char* layout : {"plain", "padded", "packed"}) {
        INFO(family << ", " << layout << ", " << c10::toString(dtype) << ", rank " << comm->rank()
                    << " of " << world << ", sequence_parallel_size " << sp);
        const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
        CausalLM whole(c, options), mine(c, options);
        whole.initialize_random(5);
        mine.initialize_random(5);
        mine.set_sequence_parallel(comm, sp);
        REQUIRE(mine.sequence_parallel_size() == sp);
        const SharedBatch s = shared_batch(layout, c.vocab_size);
        LossSum want = whole.loss(s.ids, s.labels, s.mask, 4, s.positions);
        want.sum.backward();
        LossSum got = mine.loss(s.ids, s.labels, s.mask, 4, s.positions);
        got.sum.backward();
        const double tolerance = dtype == at::kFloat ? 1e-5 : 3e-2;
        // The group's losses and counts are the whole sequence's.
        const at::Tensor tokens =
            group_sum(*comm, at::scalar_tensor(static_cast<double>(got.tokens)), groups);
        CHECK(tokens.item<double>() == static_cast<double>(want.tokens));
        CHECK(relative(group_sum(*comm, got.sum, groups), want.sum) < tolerance);
        // So are its gradients: each rank's covers its positions, through the exchanges.
        const auto wanted = whole.named_parameters();
        for (const auto& item : mine.named_parameters()) {
          INFO(item.key());
          REQUIRE(item.value().grad().defined());
          CHECK(relative(group_sum(*comm, item.value().grad(), groups), wanted[item.key()].grad()) <
                tolerance);
        }
        // Per-token log-probabilities: each rank fills its positions, 0 elsewhere.
        at::NoGradGuard no_grad;
        const at::Tensor per_token = mine.label_log_probs(s.ids, s.labels, s.mask, 4, s.positions);
        REQUIRE(per_token.sizes() == s.ids.sizes());
        CHECK(relative(group_sum(*comm, per_token, groups),
                       whole.label_log_probs(s.ids, s.labels, s.mask, 4, s.positions)) < tolerance);
        // Logits stay whole and local (no exchange: ranks need not call them alike).
        if (std::string(layout) == "plain" && dtype == at::kFloat && comm->rank() % 2 == 0) {
          CHECK(relative(mine.logits(s.ids), whole.logits(s.ids)) < 1e-5);
        }
      }
    }
  }
  // A sequence shorter than the degree: every rank but the first few holds only padding.
  {
    const ModelConfig c = load_model_config(fixture_config("llama"));
    CausalLM whole(c, at::TensorOptions().device(device)),
        mine(c, at::TensorOptions().device(device));
    whole.initialize_random(7);
    mine.initialize_random(7);
    mine.set_sequence_parallel(comm, sp);
    const at::Tensor ids = at::tensor({5, 9, 11}, at::kLong).view({1, 3});
    const LossSum want = whole.loss(ids, ids);
    const LossSum got = mine.loss(ids, ids);
    CHECK(group_sum(*comm, at::scalar_tensor(static_cast<double>(got.tokens)), groups)
              .item<double>() == 2.0);
    CHECK(relative(group_sum(*comm, got.sum, groups), want.sum) < 1e-5);
  }
}

TEST_CASE("sequence parallelism: world 2 and 4 give world 1's losses, gradients and log-probs",
          "[ranks][model]") {
  const std::pair<int, int> settings[] = {{2, 2}, {4, 4}, {4, 2}};
  for (const auto& [world, sp] : settings) {
    if (test::skip_cpu_world(world)) return;
    INFO("world " << world << ", sequence_parallel_size " << sp);
    test::run_ranks(world, "rank: a sequence-parallel model", std::chrono::seconds(240),
                    {{"ZT_SP", std::to_string(sp)}});
  }
}

TEST_CASE("sequence parallelism over NCCL: world 2 and 4 give world 1's model", "[model][gpu]") {
  // On the GPU machine: ranks of their own nodes on GPU 0 where GPUs are fewer.
  if (at::getNumGPUs() == 0) {
    WARN("no GPU: sequence parallelism over NCCL runs on the GPU machine");
    return;
  }
  for (const auto& [world, sp] : {std::pair<int, int>{2, 2}, {4, 4}, {4, 2}}) {
    INFO("world " << world << ", sequence_parallel_size " << sp);
    test::run_ranks(world, "rank: a sequence-parallel model", std::chrono::seconds(300),
                    {{"ZT_SP", std::to_string(sp)}, {"ZT_SP_CUDA", "1"}},
                    test::gpu_ranks_share_a_gpu(world));
  }
}

namespace {

// The trainer runs of the tests below, on the tiny LLaMA (4 heads, 2 key/value heads): 4 rows a
// step at every world (2 a micro-batch with one group of ranks, 1 with two), LoRA on q_proj and
// v_proj unless the kind says otherwise: "0", "2", "3" (the ZeRO stage), "3 offload", "q"
// (QLoRA at stage 2), "full 2", "packed" (examples packed into rows of 64 tokens, stage 2),
// "dpo" (DPO on ZT_SP_DIR/pairs.jsonl, the reference the adapters off), "dpo full" (full
// fine-tuning, its reference log-probs precomputed), "kto" (KTO on the same pairs: its KL
// estimate sums every member's part of each KL sequence) and "span" (stage 2, checkpointing with
// one checkpoint per two layers in host memory: the rebuilt layer's all-to-alls run again).
std::vector<std::string> sp_run(int world, int sp, const std::string& kind) {
  const int groups = std::max(1, world / sp);
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
                               "2",
                               "--per_device_train_batch_size",
                               std::to_string(2 / groups),
                               "--sequence_parallel_size",
                               std::to_string(sp)};
  const std::vector<std::string> zero = test::zero_stage_flags(kind);
  run.insert(run.end(), zero.begin(), zero.end());
  if (kind == "q") {
    run.insert(run.end(), {"--quantization_bit", "4", "--double_quantization", "false"});
  }
  if (kind == "full 2")
    run.insert(run.end(), {"--finetuning_type", "full", "--learning_rate", "2e-3"});
  if (kind == "packed") run.insert(run.end(), {"--packing", "true", "--max_length", "64"});
  if (kind == "span") {
    run.insert(run.end(), {"--gradient_checkpointing", "true", "--recompute_num_layers", "2",
                           "--use_unsloth_gc", "true"});
  }
  if (kind.rfind("dpo", 0) == 0) {
    run.insert(run.end(), {"--stage", "dpo", "--train_file",
                           std::string(std::getenv("ZT_SP_DIR")) + "/pairs.jsonl"});
  }
  if (kind == "kto") {
    run.insert(run.end(), {"--stage", "kto", "--train_file",
                           std::string(std::getenv("ZT_SP_DIR")) + "/pairs.jsonl"});
  }
  if (kind == "dpo full") {
    run.insert(run.end(), {"--finetuning_type", "full", "--learning_rate", "2e-3"});
  }
  return run;
}

}  // namespace

// One run per process: ZT_SP_CASE a kind of sp_run, "saved" (stage 2, a checkpoint at step 2),
// "resumed" (stage 2 from ZT_SP_RESUME), or a setting sequence parallelism refuses.
TEST_CASE("rank: sequence-parallel training", "[.rank]") {
  const std::string dir = std::getenv("ZT_SP_DIR"), which = std::getenv("ZT_SP_CASE");
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  const int sp = std::atoi(std::getenv("ZT_SP"));
  const std::string out =
      dir + "/out_" + std::to_string(world) + "_" + std::to_string(sp) + "_" + which;
  std::vector<std::string> run = sp_run(world, sp, which);
  run.insert(run.end(), {"--output_dir", out});
  const auto refused = [&](std::vector<std::string> extra, const std::string& says) {
    run.insert(run.end(), extra.begin(), extra.end());
    CHECK_THROWS_WITH(test::train_on_base(dir, run),
                      Catch::Contains("sequence_parallel_size") && Catch::Contains(says));
  };
  if (which == "grpo") return refused({"--stage", "grpo"}, "stage grpo");
  if (which == "ptuning") return refused({"--finetuning_type", "ptuning"}, "ptuning");
  if (which == "heads") {
    // A model of 3 heads at degree 2 (written by the visible test).
    run.insert(run.end(), {"--model_name_or_path", dir + "/three_heads"});
    return refused({}, "3 attention heads");
  }
  if (which == "saved") run.insert(run.end(), {"--save_steps", "2"});
  if (which == "resumed") {
    run = sp_run(world, sp, "2");
    run.insert(run.end(),
               {"--output_dir", out, "--resume_from_checkpoint", std::getenv("ZT_SP_RESUME")});
  }
  test::write_curves(std::atoi(std::getenv("RANK")), {test::train_on_base(dir, run)});
}

TEST_CASE(
    "sequence-parallel LoRA, QLoRA, full, DPO and KTO training run as world 1 does, and "
    "resume at another degree",
    "[ranks][trainer][slow]") {
  const std::string dir = test::temp_dir("sequence_parallel");
  test::write_data(dir, "train.jsonl", 16, 9);
  test::write_model_folder(dir + "/base", test::kTinyModel, 41);
  test::write_pairs(dir, "pairs.jsonl", 16, 5);
  setenv("ZT_SP_DIR", dir.c_str(), 1);
  const std::vector<std::string> kinds{"0",      "2",   "3",        "3 offload", "q",   "full 2",
                                       "packed", "dpo", "dpo full", "kto",       "span"};
  std::vector<std::vector<double>> reference;
  for (const std::string& kind : kinds) {
    std::vector<std::string> run = sp_run(1, 1, kind);
    run.insert(run.end(), {"--output_dir", dir + "/ref_" + kind});
    reference.push_back(test::train_on_base(dir, run));
    REQUIRE(reference.back().size() == 4);
  }
  if (!test::check_degree_sweep({"rank: sequence-parallel training",
                                 "ZT_SP",
                                 "ZT_SP_CASE",
                                 "sequence_parallel_size",
                                 {{2, 2}, {4, 4}, {4, 2}},
                                 kinds,
                                 reference})) {
    return;
  }
  // Saved at world 4 with sequence_parallel_size 2: resumed at world 1 without it, and at
  // world 2 with it, the remaining steps are world 1's.
  setenv("ZT_SP", "2", 1);
  setenv("ZT_SP_CASE", "saved", 1);
  REQUIRE(test::curves_at_world(4, "rank: sequence-parallel training", std::chrono::seconds(300))
              .size() == 1);
  const std::string saved = dir + "/out_4_2_saved/checkpoint-2";
  std::vector<std::string> resumed = sp_run(1, 1, "2");
  resumed.insert(resumed.end(),
                 {"--output_dir", dir + "/resumed", "--resume_from_checkpoint", saved});
  const std::vector<double> rest = test::train_on_base(dir, resumed);
  REQUIRE(rest.size() == 2);
  for (size_t i = 0; i < rest.size(); ++i)
    CHECK(rest[i] == Approx(reference[1][i + 2]).epsilon(1e-5));
  setenv("ZT_SP_CASE", "resumed", 1);
  setenv("ZT_SP_RESUME", saved.c_str(), 1);
  const std::vector<std::vector<double>> at_two =
      test::curves_at_world(2, "rank: sequence-parallel training", std::chrono::seconds(300));
  REQUIRE(at_two.size() == 1);
  REQUIRE(at_two[0].size() == 2);
  for (size_t i = 0; i < at_two[0].size(); ++i)
    CHECK(at_two[0][i] == Approx(reference[1][i + 2]).epsilon(1e-5));
}

TEST_CASE("sequence_parallel_size: what it refuses, said on every rank alike", "[ranks][trainer]") {
  if (test::skip_cpu_world(2)) return;
  const std::string dir = test::temp_dir("sequence_parallel_refused");
  test::write_data(dir, "train.jsonl", 8, 3);
  test::write_model_folder(dir + "/base", test::kTinyModel, 41);
  test::write_model_folder(
      dir + "/three_heads",
      R"({"model_type": "llama", "vocab_size": 259, "hidden_size": 48, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 1,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6})",
      3);
  setenv("ZT_SP_DIR", dir.c_str(), 1);
  setenv("ZT_SP", "2", 1);
  for (const char* refused : {"grpo", "ptuning", "heads"}) {
    INFO(refused);
    setenv("ZT_SP_CASE", refused, 1);
    test::run_ranks(2, "rank: sequence-parallel training", std::chrono::seconds(120));
  }
  // The DeepSpeed config's degree and the argument's must agree.
  {
    std::vector<std::string> run = sp_run(1, 2, "2");
    run.insert(run.end(), {"--output_dir", dir + "/both", "--deepspeed",
                           R"({"sequence_parallel_size": 4, "zero_optimization": {"stage": 2}})"});
    CHECK_THROWS_WITH(test::train_on_base(dir, run),
                      Catch::Contains("sequence_parallel_size 4 and the argument "
                                      "sequence_parallel_size 2 differ"));
  }
  // At world 1 a degree of 2 has no group to form.
  std::vector<std::string> run = sp_run(1, 2, "2");
  run.insert(run.end(), {"--output_dir", dir + "/alone"});
  CHECK_THROWS_WITH(test::train_on_base(dir, run),
                    Catch::Contains("sequence_parallel_size 2") &&
                        Catch::Contains("does not divide the 1 ranks"));
}

TEST_CASE("sequence_parallel_size is spelled as DeepSpeed, Megatron and HF's parallelism_config",
          "[config]") {
  const auto size_of = [](const std::vector<std::string>& flags) {
    TrainingArguments args;
    apply_training_flags(args, flags);
    return args.sequence_parallel_size;
  };
  CHECK(size_of({"--sequence_parallel_size", "4"}) == 4);
  CHECK(size_of({"--ds_sequence_parallel_size", "2"}) == 2);
  CHECK(size_of({"--parallelism_config", R"({"sp_size": 4, "sp_backend": "deepspeed"})"}) == 4);
  CHECK(size_of({"--parallelism_config", "{}"}) == 1);
  {
    TrainingArguments args;
    apply_training_json(args,
                        R"({"parallelism_config": {"sp_size": 2, "dp_shard_size": -1,
                            "sp_handler": {"sp_seq_length_is_variable": true}}})",
                        "args.json");
    CHECK(args.sequence_parallel_size == 2);
    CHECK(args.is_given("sequence_parallel_size"));
  }
  // Contradictions and what zerotrain does not split by, named.
  const auto refused = [](const std::vector<std::string>& flags, const std::string& says) {
    TrainingArguments args;
    CHECK_THROWS_WITH(apply_training_flags(args, flags), Catch::Contains(says));
  };
  refused({"--sequence_parallel_size", "2", "--parallelism_config", R"({"sp_size": 4})"},
          "sp_size 4 and sequence_parallel_size 2");
  refused({"--parallelism_config", R"({"sp_size": 4})", "--sequence_parallel_size", "2"},
          "sp_size 4 and sequence_parallel_size 2");
  refused({"--parallelism_config", R"({"tp_size": 2})"}, "no tensor parallelism");
  refused({"--parallelism_config", R"({"cp_size": 2})"}, "context (ring attention)");
  refused({"--parallelism_config", R"({"sp_backend": "ring"})"}, "sp_backend");
  refused({"--parallelism_config", R"({"sp_size": 0})"}, "not a degree");
  refused({"--parallelism_config", R"({"sp_size": "two"})"}, "not a degree");
  refused({"--parallelism_config", R"({"sp_sise": 2})"}, "unknown key 'sp_sise'");
  refused({"--parallelism_config", "[2]"}, "give an object");
  refused({"--sequence_parallel_size", "0"}, "sequence_parallel_size");
  // DeepSpeed's top-level key.
  CHECK(parse_deepspeed_config(R"({"sequence_parallel_size": 4})").sequence_parallel_size == 4);
  CHECK_THROWS_WITH(parse_deepspeed_config(R"({"sequence_parallel_size": 0})"),
                    Catch::Contains("sequence_parallel_size"));
  CHECK_THROWS_WITH(parse_deepspeed_config(R"({"sequence_parallel_size": "4"})"),
                    Catch::Contains("sequence_parallel_size"));
  CHECK(deepspeed_config_json(parse_deepspeed_config(R"({"sequence_parallel_size": 2})"))
            .find("\"sequence_parallel_size\": 2") != std::string::npos);
}

TEST_CASE("a tiled MLP gives the untiled model's loss and gradients", "[model][long]") {
  // LLaMA's two projections, GLM-4's fused gate_up, Gemma 2's GeGLU; LoRA on every projection
  // (no dropout: the draws of a tile differ from the whole's), and full fine-tuning.
  for (const char* family : {"llama", "glm4", "gemma2"}) {
    for (const bool lora : {true, false}) {
      for (const int64_t shards : {int64_t{0}, int64_t{3}, int64_t{7}}) {
        INFO(family << (lora ? ", LoRA" : ", full") << ", shards " << shards);
        const ModelConfig c = load_model_config(fixture_config(family));
        CausalLM whole(c, at::TensorOptions()), tiled(c, at::TensorOptions());
        whole.initialize_random(3);
        tiled.initialize_random(3);
        if (lora) {
          PeftConfig p;
          p.type = FinetuningType::kLora;
          p.lora.target_modules = {"all-linear"};
          p.lora.init_lora_weights = "gaussian";  // B not zero: the adapter's gradients count
          apply_peft(whole, p, 11);
          apply_peft(tiled, p, 11);
        }
        tiled.set_tiled_mlp(true, shards);
        const SharedBatch s = shared_batch("padded", c.vocab_size);
        LossSum want = whole.loss(s.ids, s.labels, s.mask, 4);
        want.sum.backward();
        LossSum got = tiled.loss(s.ids, s.labels, s.mask, 4);
        got.sum.backward();
        CHECK(got.tokens == want.tokens);
        CHECK(relative(got.sum, want.sum) < 1e-5);
        const auto wanted = whole.named_parameters();
        int compared = 0;
        for (const auto& item : tiled.named_parameters()) {
          if (!item.value().requires_grad()) continue;
          INFO(item.key());
          REQUIRE(item.value().grad().defined());
          CHECK(relative(item.value().grad(), wanted[item.key()].grad()) < 1e-5);
          ++compared;
        }
        CHECK(compared > 0);
      }
    }
  }
  // Off again: the plain MLP.
  const ModelConfig c = load_model_config(fixture_config("llama"));
  CausalLM m(c, at::TensorOptions());
  m.set_tiled_mlp(true, 2);
  m.set_tiled_mlp(false);
  CHECK_THROWS_AS(m.set_tiled_mlp(true, -1), InvalidArgument);
}

TEST_CASE("a tiled MLP replays its dropout draws tile by tile in backward", "[model][long]") {
  const ModelConfig c = load_model_config(fixture_config("llama"));
  CausalLM model(c, at::TensorOptions());
  model.initialize_random(3);
  PeftConfig p;
  p.type = FinetuningType::kLora;
  p.lora.target_modules = {"gate_proj", "up_proj", "down_proj"};
  p.lora.dropout = 0.5;
  p.lora.init_lora_weights = "gaussian";
  apply_peft(model, p, 11);
  model.train();
  std::shared_ptr<model::Mlp> mlp;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto m = std::dynamic_pointer_cast<model::Mlp>(item.value())) {
      mlp = m;
      break;
    }
  }
  REQUIRE(mlp);
  at::manual_seed(2);
  const at::Tensor x0 = at::randn({2, 11, c.hidden_size});
  const at::Tensor probe = at::randn({2, 11, c.hidden_size});
  const int64_t tiles = 3;
  const auto gradients = [&](const at::Tensor& x) {
    std::vector<at::Tensor> out{x.grad().clone()};
    for (const at::Tensor& q : mlp->parameters()) {
      if (q.requires_grad()) {
        out.push_back(q.grad().clone());
        q.mutable_grad().reset();
      }
    }
    return out;
  };
  // By hand: the tiles in order from one seed, each with its own graph.
  at::manual_seed(9);
  at::Tensor xm = x0.clone().requires_grad_(true);
  const at::Tensor flat = xm.reshape({-1, c.hidden_size});
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t first = i * 8 - std::max<int64_t>(0, i - 1) * 1;  // 8, 7, 7 rows
    const int64_t count = i == 0 ? 8 : 7;
    parts.push_back(mlp->compute(flat.narrow(0, first, count)));
  }
  const at::Tensor by_hand = at::cat(parts, 0).view(x0.sizes());
  (by_hand * probe).sum().backward();
  const std::vector<at::Tensor> want = gradients(xm);
  // Tiled from the same seed: the same draws forward and, replayed, backward.
  at::manual_seed(9);
  at::Tensor xt = x0.clone().requires_grad_(true);
  const at::Tensor y = model::tiled_mlp(*mlp, xt, tiles);
  CHECK(relative(y, by_hand) < 1e-6);
  at::manual_seed(1234);  // what backward finds: the replay must not depend on it
  (y * probe).sum().backward();
  const std::vector<at::Tensor> got = gradients(xt);
  REQUIRE(got.size() == want.size());
  REQUIRE(got.size() == 7);  // x and the three projections' A and B
  for (size_t k = 0; k < got.size(); ++k) {
    INFO("gradient " << k);
    CHECK(relative(got[k], want[k]) < 1e-6);
  }
  // The generator is where backward found it: the replay restores it.
  at::manual_seed(1234);
  const at::Tensor after_seed = at::rand({4});
  at::manual_seed(1234);
  at::Tensor xr = x0.clone().requires_grad_(true);
  {
    at::manual_seed(9);
    const at::Tensor y2 = model::tiled_mlp(*mlp, xr, tiles);
    at::manual_seed(1234);
    (y2 * probe).sum().backward();
  }
  CHECK(at::equal(at::rand({4}), after_seed));
  gradients(xr);
}

TEST_CASE(
    "tiled_mlp trains as the plain MLP does, ZeRO 0-3 and checkpointing, with recompute_num_layers "
    "and use_unsloth_gc",
    "[trainer][long]") {
  const std::string dir = test::temp_dir("tiled_mlp");
  test::write_data(dir, "train.jsonl", 16, 9);
  test::write_model_folder(dir + "/base", test::kTinyModel, 41);
  for (const char* stage : {"0", "2", "3"}) {
    for (const bool checkpointing : {false, true}) {
      INFO("stage " << stage << (checkpointing ? ", checkpointing" : ""));
      std::vector<std::string> run = sp_run(1, 1, stage);
      run.insert(run.end(), {"--gradient_checkpointing", checkpointing ? "true" : "false",
                             "--lora_target", "all-linear"});
      const std::string name = fmt::format("{}_{}", stage, checkpointing);
      std::vector<std::string> plain = run, tiled = run;
      plain.insert(plain.end(), {"--output_dir", dir + "/plain_" + name});
      tiled.insert(tiled.end(), {"--output_dir", dir + "/tiled_" + name, "--tiled_mlp", "true",
                                 "--tiled_mlp_num_shards", "3"});
      const std::vector<double> want = test::train_on_base(dir, plain);
      const std::vector<double> got = test::train_on_base(dir, tiled);
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-5));
      if (!checkpointing) continue;
      // The long-context recipe: tiled, one checkpoint per two layers, held in host memory.
      tiled.insert(tiled.end(), {"--output_dir", dir + "/span_" + name, "--recompute_num_layers",
                                 "2", "--use_unsloth_gc", "true"});
      const std::vector<double> spanned = test::train_on_base(dir, tiled);
      REQUIRE(spanned.size() == want.size());
      for (size_t i = 0; i < spanned.size(); ++i) {
        CHECK(spanned[i] == Approx(want[i]).epsilon(1e-5));
      }
    }
  }
}

TEST_CASE("a tiled MLP on the GPU: the untiled model's loss and gradients in bf16",
          "[model][gpu]") {
  if (at::getNumGPUs() == 0) {
    WARN("no GPU: the tiled MLP's CUDA path runs on the GPU machine");
    return;
  }
  const ModelConfig c = load_model_config(fixture_config("llama"));
  const at::TensorOptions bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  CausalLM whole(c, bf16), tiled(c, bf16);
  whole.initialize_random(3);
  tiled.initialize_random(3);
  PeftConfig p;
  p.type = FinetuningType::kLora;
  p.lora.target_modules = {"all-linear"};
  p.lora.init_lora_weights = "gaussian";
  apply_peft(whole, p, 11);
  apply_peft(tiled, p, 11);
  tiled.set_tiled_mlp(true, 3);
  const SharedBatch s = shared_batch("padded", c.vocab_size);
  LossSum want = whole.loss(s.ids, s.labels, s.mask, 4);
  want.sum.backward();
  LossSum got = tiled.loss(s.ids, s.labels, s.mask, 4);
  got.sum.backward();
  CHECK(relative(got.sum, want.sum) < 2e-2);
  const auto wanted = whole.named_parameters();
  for (const auto& item : tiled.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    INFO(item.key());
    CHECK(relative(item.value().grad(), wanted[item.key()].grad()) < 5e-2);
  }
}
