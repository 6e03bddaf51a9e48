// The Trainer end to end on real ranks (Gloo): exact resume at the same world size, resume at
// other world sizes with the global batch kept, what a run writes (logs, checkpoints, the final
// model), the output-folder rules, and errors for bad inputs.
#include "support/catch.hpp"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <rapidjson/document.h>

#include <set>

#include "config/training_options.hpp"
#include "model/quantized_weights.hpp"
#include "peft/init_sources.hpp"
#include "peft/linear_adapters.hpp"
#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/ranks.hpp"
#include "train/reporting.hpp"
#include "train/resume_check.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using Catch::Contains;
using zt::test::join_flags;
using zt::test::kTinyModel;
using zt::test::logged_losses;
using zt::test::split_flags;
using zt::test::write_data;
namespace fs = std::filesystem;

namespace {

// Flags of a run: the tiny model, the data in `dir`, and `extra` on top.
std::vector<std::string> run_flags(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_run_flags(
      dir,
      {"--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--lr_scheduler_type",
       "linear", "--max_steps", "8", "--logging_steps", "1", "--save_steps", "4", "--seed", "5"},
      extra);
}

// The run id a checkpoint's zerotrain_state.json records.
std::string train_step_run_id(const std::string& checkpoint) {
  const std::string text = files::read_text(checkpoint + "/zerotrain_state.json");
  const size_t at = text.find("\"run_id\"");
  REQUIRE(at != std::string::npos);
  return text.substr(at, 40);
}

// `model`: an inline config.json in place of kTinyModel.
void train_ranks(int world, const std::string& dir, const std::vector<std::string>& extra,
                 int cancel_at = 0, const std::string& model = "") {
  std::vector<std::string> flags = run_flags(dir, extra);
  if (!model.empty()) flags[1] = model;
  test::run_ranks(world, "rank: trainer run", std::chrono::seconds(240),
                  {{"ZT_FLAGS", join_flags(flags)}, {"ZT_CANCEL_AT", std::to_string(cancel_at)}});
}

// A folder of kTinyModel with seeded random weights, as from_pretrained would read it.
ModelConfig write_base_model(const std::string& folder) {
  return test::write_model_folder(folder, kTinyModel, 11);
}

// The arguments of run_flags over the model folder `dir`/base (write_base_model), writing into
// `dir`/`out`.
TrainingArguments on_base_model(const std::string& dir, const std::string& out,
                                const std::vector<std::string>& extra) {
  std::vector<std::string> flags = run_flags(dir, extra);
  flags[0] = "--model_name_or_path";
  flags[1] = dir + "/base";
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--output_dir") flags[i + 1] = dir + "/" + out;
  }
  TrainingArguments args;
  apply_training_flags(args, flags);
  return args;
}

}  // namespace

// One rank of a training run; with ZT_CANCEL_AT=N the run is cancelled after step N (every
// rank must then stop with CancelledError, the checkpoints before it intact).
TEST_CASE("rank: trainer run", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, split_flags(std::getenv("ZT_FLAGS")));
  const int64_t cancel_at = std::atoll(std::getenv("ZT_CANCEL_AT"));
  TrainerCallbacks callbacks;
  Trainer* self = nullptr;
  callbacks.on_progress = [&](const Progress& p) {
    if (cancel_at > 0 && p.step == cancel_at) self->cancel();
  };
  Trainer trainer(args, comm, callbacks);
  self = &trainer;
  if (cancel_at > 0) {
    // Rank 0 asks; the others learn it at the next step's agreement.
    CHECK_THROWS_AS(trainer.train(), CancelledError);
  } else {
    TrainResult r = trainer.train();
    CHECK(r.global_step == (args.max_steps > 0 ? args.max_steps : r.global_step));
    CHECK(r.global_step > 0);
  }
}

TEST_CASE("a run stopped and resumed gives the uninterrupted run's losses",
          "[trainer][checkpoint]") {
  if (test::skip_cpu_world(2)) return;
  const std::string whole = test::temp_dir("whole"), parts = test::temp_dir("parts");
  for (const std::string& d : {whole, parts}) write_data(d, "train.jsonl", 40, 1);
  // LoRA with dropout: the resumed run must also restore the random state.
  const std::vector<std::string> lora{"--finetuning_type",
                                      "lora",
                                      "--lora_r",
                                      "4",
                                      "--lora_dropout",
                                      "0.1",
                                      "--gradient_accumulation_steps",
                                      "2"};
  train_ranks(2, whole, lora);
  train_ranks(2, parts, lora, /*cancel_at=*/5);
  CHECK(list_checkpoints(parts + "/out").back().step == 4);
  std::vector<std::string> resume = lora;
  resume.insert(resume.end(), {"--resume_from_checkpoint", "True"});
  train_ranks(2, parts, resume);
  const auto want = logged_losses(whole + "/out"), got = logged_losses(parts + "/out");
  REQUIRE(want.size() == 8);
  for (int64_t step = 5; step <= 8; ++step) {
    INFO("step " << step);
    REQUIRE(got.count(step));
    CHECK(got.at(step) == Approx(want.at(step)).epsilon(1e-6));
  }
}

namespace {

// A value of option `o` other than `now` (its JSON rendering in training_args.json), valid for
// the option's type, choices and range; "" when the option has no other value.
std::string other_value(const config::Option& o, const rapidjson::Value& now) {
  return std::visit(
      [&](auto m) -> std::string {
        using V = std::decay_t<decltype(TrainingArguments().*m)>;
        if constexpr (std::is_same_v<V, bool> || std::is_same_v<V, std::optional<bool>>) {
          return now.IsBool() && now.GetBool() ? "false" : "true";
        } else if constexpr (std::is_same_v<V, std::string>) {
          const std::string current = now.IsString() ? now.GetString() : "";
          for (const std::string& c : o.choices) {
            if (c != current) return c;
          }
          return current + "x";
        } else {
          const double v = now.IsNumber() ? now.GetDouble() : o.range.min;
          for (double candidate : {v + 1, v / 2, v * 2, o.range.min, o.range.max}) {
            if (candidate != v && o.range.contains(candidate)) return fmt::format("{}", candidate);
          }
          return "";
        }
      },
      o.member);
}

}  // namespace

TEST_CASE("resume compares every recorded option that says what the model or data is",
          "[trainer][checkpoint][resume]") {
  // Over the whole option table: the run that wrote a checkpoint recorded its arguments. For
  // each option, a resumed run that gives another value is refused naming the option and both
  // values, unless the option is on the declared list of those that may change; one that does
  // not give it takes the recorded value, with a line saying so. Spellings of one setting are
  // compared by meaning: load_in_4bit with bnb_4bit_quant_type nf4 and double quant is
  // quantization_bit 4's base.
  const std::string dir = test::temp_dir("resume-options");
  const std::vector<std::string> run = {
      "--model_config",     kTinyModel,   "--train_file",      dir + "/train.jsonl",
      "--output_dir",       dir + "/out", "--finetuning_type", "lora",
      "--quantization_bit", "4",          "--stage",           "dpo",
      "--template",         "alpaca"};
  TrainingArguments recorded;
  apply_training_flags(recorded, run);
  const std::string checkpoint = dir + "/out/checkpoint-4";
  fs::create_directories(checkpoint);
  files::write_atomic(
      checkpoint + "/training_args.json",
      fmt::format(R"({{"training_arguments": {}}})", training_arguments_json(recorded)));
  rapidjson::Document doc;
  doc.Parse(training_arguments_json(recorded).c_str());
  const std::vector<std::string>& may_change = train::options_resume_may_change();
  std::set<const void*> seen;
  int refused = 0, allowed = 0;
  for (const config::Option& o : config::options()) {
    const std::string name = o.name;
    if (!doc.HasMember(o.name)) continue;  // an alias: its member is recorded under another name
    const std::string alt = other_value(o, doc[o.name]);
    if (alt.empty()) continue;
    INFO("--" << name << " " << alt);
    TrainingArguments resumed;
    std::vector<std::string> flags = run;
    flags.insert(flags.end(), {"--" + name, alt});
    try {
      apply_training_flags(resumed, flags);
    } catch (const ConfigError&) {
      continue;  // the value contradicts another option: a run could not have been given it
    }
    const bool may = std::find(may_change.begin(), may_change.end(), name) != may_change.end();
    if (name.find("quant") != std::string::npos || name.find("4bit") != std::string::npos ||
        name.find("8bit") != std::string::npos || name.find("pissa") != std::string::npos ||
        name == "init_lora_weights") {
      continue;  // spellings of the base and of the adapter's start: compared by meaning, below
    }
    if (may) {
      CHECK_NOTHROW(train::reconcile_resumed_arguments(resumed, checkpoint,
                                                       train::ResumeDifferences::kTakeRecorded));
      ++allowed;
    } else {
      CHECK_THROWS_AS(train::reconcile_resumed_arguments(resumed, checkpoint,
                                                         train::ResumeDifferences::kTakeRecorded),
                      ConfigError);
      try {
        train::reconcile_resumed_arguments(resumed, checkpoint,
                                           train::ResumeDifferences::kTakeRecorded);
      } catch (const ConfigError& e) {
        CHECK_THAT(e.what(), Contains("training_args.json") && Contains(" is "));
      }
      ++refused;
    }
  }
  CHECK(refused >= 30);  // the table's model and data options, each tried
  CHECK(allowed >= 40);
  // Not given: the recorded value is taken and said — the QLoRA base, the stage, the template.
  TrainingArguments bare;
  apply_training_flags(bare, {"--model_config", kTinyModel, "--train_file", dir + "/train.jsonl",
                              "--output_dir", dir + "/out", "--finetuning_type", "lora"});
  const std::vector<std::string> said =
      train::reconcile_resumed_arguments(bare, checkpoint, train::ResumeDifferences::kTakeRecorded);
  CHECK(bare.quantization_bit == 4);
  CHECK(bare.stage == "dpo");
  CHECK(bare.template_name == "alpaca");
  CHECK(said.size() >= 3);
  // Another spelling of the same 4-bit base is the same; another base type is not.
  TrainingArguments spelled;
  apply_training_flags(
      spelled, {"--model_config", kTinyModel, "--train_file", dir + "/train.jsonl", "--output_dir",
                dir + "/out", "--finetuning_type", "lora", "--stage", "dpo", "--template", "alpaca",
                "--load_in_4bit", "true", "--bnb_4bit_quant_type", "nf4",
                "--bnb_4bit_use_double_quant", "true"});
  CHECK_NOTHROW(train::reconcile_resumed_arguments(spelled, checkpoint,
                                                   train::ResumeDifferences::kTakeRecorded));
  TrainingArguments fp4 = spelled;
  apply_training_flags(fp4, {"--bnb_4bit_quant_type", "fp4"});
  CHECK_THROWS_WITH(
      train::reconcile_resumed_arguments(fp4, checkpoint, train::ResumeDifferences::kTakeRecorded),
      Contains("quantization") && Contains("fp4") && Contains("nf4"));
  TrainingArguments pissa = spelled;
  apply_training_flags(pissa, {"--pissa_init", "true"});
  CHECK_THROWS_WITH(train::reconcile_resumed_arguments(pissa, checkpoint,
                                                       train::ResumeDifferences::kTakeRecorded),
                    Contains("init_lora_weights") && Contains("pissa"));
  // Trainer::load_checkpoint cannot take a value (the model is built): it refuses.
  TrainingArguments later = bare;
  later.quantization_bit = 0;
  CHECK_THROWS_WITH(
      train::reconcile_resumed_arguments(later, checkpoint, train::ResumeDifferences::kRefuse),
      Contains("quantization"));
}

TEST_CASE("a QLoRA run resumed without --quantization_bit trains on over its 4-bit base",
          "[trainer][checkpoint][resume]") {
  // The reported fault: the resumed run trained the full-precision base without a word. Now
  // it takes the recorded base (and says so), records it, and continues the uninterrupted run.
  const std::string whole = test::temp_dir("qlora-whole"), parts = test::temp_dir("qlora-parts");
  for (const std::string& d : {whole, parts}) write_data(d, "train.jsonl", 40, 1);
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::vector<std::string> qlora{
      "--finetuning_type",   "lora",    "--lora_r", "4", "--quantization_bit", "4",
      "--lr_scheduler_type", "constant"};
  auto flags = [&](const std::string& d, std::vector<std::string> extra) {
    TrainingArguments a;
    apply_training_flags(a, run_flags(d, extra));
    return a;
  };
  Trainer(flags(whole, qlora), comm).train();
  {
    std::vector<std::string> first = qlora;
    first.insert(first.end(), {"--max_steps", "4"});
    Trainer(flags(parts, first), comm).train();
  }
  {
    test::LogCapture log;
    Trainer(flags(parts, {"--finetuning_type", "lora", "--lora_r", "4", "--lr_scheduler_type",
                          "constant", "--resume_from_checkpoint", "True"}),
            comm)
        .train();
    CHECK(log.contains("resume: quantization 4-bit nf4"));
  }
  const std::string recorded = files::read_text(parts + "/out/training_args.json");
  CHECK_THAT(recorded, Contains("\"quantization_bit\": 4"));
  const auto want = logged_losses(whole + "/out"), got = logged_losses(parts + "/out");
  for (int64_t step = 5; step <= 8; ++step) {
    INFO("step " << step);
    REQUIRE(got.count(step));
    CHECK(got.at(step) == Approx(want.at(step)).epsilon(1e-6));
  }
  // Given explicitly, another base is refused, naming both.
  CHECK_THROWS_WITH(
      Trainer(flags(parts, {"--finetuning_type", "lora", "--lora_r", "4",
                            "--resume_from_checkpoint", "True", "--quantization_bit", "0"}),
              comm),
      Contains("quantization") && Contains("none") && Contains("nf4"));
}

TEST_CASE("updates inside backward train and resume as updates in step() do",
          "[trainer][checkpoint]") {
  // One rank, no clipping, no accumulation: the engine updates parameters during backward.
  const std::string in_step = test::temp_dir("in_step"), whole = test::temp_dir("in_bwd"),
                    parts = test::temp_dir("in_bwd_parts");
  for (const std::string& d : {in_step, whole, parts}) write_data(d, "train.jsonl", 40, 1);
  const std::vector<std::string> flags{
      "--max_grad_norm", "0", "--gradient_accumulation_steps", "1", "--weight_decay", "0.1"};
  std::vector<std::string> off = flags;
  off.insert(off.end(), {"--update_in_backward", "false"});
  train_ranks(1, in_step, off);
  train_ranks(1, whole, flags);
  train_ranks(1, parts, flags, /*cancel_at=*/5);
  std::vector<std::string> resume = flags;
  resume.insert(resume.end(), {"--resume_from_checkpoint", "True"});
  train_ranks(1, parts, resume);
  const auto want = logged_losses(in_step + "/out"), got = logged_losses(whole + "/out"),
             resumed = logged_losses(parts + "/out");
  REQUIRE(want.size() == 8);
  REQUIRE(got.size() == want.size());
  for (const auto& [step, loss] : want) {
    INFO("step " << step);
    CHECK(got.at(step) == Approx(loss).epsilon(1e-5));
    if (step > 4) {
      REQUIRE(resumed.count(step));
      CHECK(resumed.at(step) == Approx(loss).epsilon(1e-5));
    }
  }
  const auto norms_in_step = test::logged(in_step + "/out", "grad_norm"),
             norms = test::logged(whole + "/out", "grad_norm");
  REQUIRE(norms.size() == norms_in_step.size());
  for (const auto& [step, norm] : norms_in_step)
    CHECK(norms.at(step) == Approx(norm).epsilon(1e-5));
}

namespace {

// A run of `model` (kTinyModel when empty) under ZeRO `stage` at 2 ranks, stopped after step 5
// and resumed at 1 and 4 ranks, logs the uninterrupted run's losses for steps 5 to 8.
void check_resumed_at_other_worlds(int stage, const std::string& model = "",
                                   const std::vector<std::string>& method = {}) {
  const std::string whole = test::temp_dir("whole_w"), saved = test::temp_dir("saved_w");
  for (const std::string& d : {whole, saved}) write_data(d, "train.jsonl", 40, 2);
  std::vector<std::string> base{
      "--gradient_accumulation_steps", "2", "--deepspeed",
      fmt::format(R"({{"zero_optimization": {{"stage": {}}}, "train_batch_size": "auto",
                     "gradient_accumulation_steps": "auto",
                     "train_micro_batch_size_per_gpu": "auto"}})",
                  stage)};
  base.insert(base.end(), method.begin(), method.end());
  train_ranks(2, whole, base, 0, model);
  train_ranks(2, saved, base, /*cancel_at=*/5, model);
  const auto want = logged_losses(whole + "/out");
  for (int world : {1, 4}) {
    INFO("resumed at world " << world);
    const std::string dir = test::temp_dir("resumed_w");
    write_data(dir, "train.jsonl", 40, 2);
    fs::copy(saved + "/out", dir + "/out", fs::copy_options::recursive);
    // micro batch 2 × 2 ranks × accumulation 2 = 8; the resumed run picks its accumulation.
    std::vector<std::string> resume{
        "--resume_from_checkpoint", "True", "--deepspeed",
        fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", stage)};
    resume.insert(resume.end(), method.begin(), method.end());
    train_ranks(world, dir, resume, 0, model);
    const auto got = logged_losses(dir + "/out");
    for (int64_t step = 5; step <= 8; ++step) {
      INFO("step " << step);
      REQUIRE(got.count(step));
      CHECK(got.at(step) == Approx(want.at(step)).epsilon(1e-4));  // reduction order differs
    }
  }
}

}  // namespace

TEST_CASE("a run saved at 2 ranks resumes at 1 and 4 with the global batch kept",
          "[trainer][checkpoint]") {
  if (test::skip_cpu_world(4)) return;
  check_resumed_at_other_worlds(2);
}

TEST_CASE(
    "a mixture-of-experts run with its load-balancing loss saved at 2 ranks under ZeRO-3 "
    "resumes at 1 and 4",
    "[trainer][checkpoint][moe]") {
  if (test::skip_cpu_world(4)) return;
  // The logged losses carry router_aux_loss_coef · aux of every micro-batch (each the same
  // rows whatever the world size), and ZeRO-3 recomputes every layer in backward.
  check_resumed_at_other_worlds(3,
                                R"({"model_type": "qwen3_moe", "vocab_size": 259, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
      "tie_word_embeddings": false, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 16, "mlp_only_layers": [1], "output_router_logits": true,
      "router_aux_loss_coef": 0.3})");
}

TEST_CASE("LoRA on the experts saved at 2 ranks under ZeRO-3 resumes at 1 and 4",
          "[trainer][checkpoint][moe][peft]") {
  if (test::skip_cpu_world(4)) return;
  // The experts' adapters ([r·E, in] and [out, r·E] per fused tensor) sharded by ZeRO-3 like
  // any parameter, beside the attention's LoRA, with the load-balancing loss on (its gradient
  // reaches the frozen routers' inputs through the adapted layers).
  check_resumed_at_other_worlds(
      3,
      R"({"model_type": "qwen3_moe", "vocab_size": 259, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
      "tie_word_embeddings": false, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 16, "mlp_only_layers": [1], "output_router_logits": true,
      "router_aux_loss_coef": 0.3})",
      {"--finetuning_type", "lora", "--lora_r", "4", "--lora_target", "q_proj,v_proj",
       "--lora_target_parameters", "experts.gate_up_proj,experts.down_proj"});
}

TEST_CASE("a run writes logs, checkpoints a user can load, and the final model", "[trainer]") {
  const std::string dir = test::temp_dir("outputs");
  write_data(dir, "train.jsonl", 24, 3);
  write_data(dir, "eval.jsonl", 10, 4);
  auto comm = std::shared_ptr<Communicator>(test::join());
  SECTION("LoRA: adapter files in every checkpoint and in output_dir") {
    TrainingArguments args;
    apply_training_flags(
        args, run_flags(dir, {"--finetuning_type", "lora", "--eval_file", dir + "/eval.jsonl",
                              "--eval_strategy", "steps", "--eval_steps", "4", "--save_total_limit",
                              "1", "--load_best_model_at_end", "True"}));
    Trainer trainer(args, comm);
    TrainResult r = trainer.train();
    const std::string out = dir + "/out";
    // Rotation keeps one checkpoint plus the best.
    auto all = list_checkpoints(out);
    REQUIRE_FALSE(all.empty());
    CHECK(all.size() <= 2);
    for (const std::string& folder : {out, all.back().path}) {
      INFO(folder);
      CHECK(fs::exists(folder + "/adapter_config.json"));
      SafetensorsFile adapter(folder + "/adapter_model.safetensors");
      CHECK_FALSE(adapter.names().empty());
    }
    CHECK(files::read_text(out + "/latest") ==
          fs::path(all.back().path).filename().string() + "\n");
    CHECK(r.best_checkpoint.has_value());
    // Logs: HF's keys in trainer_log.jsonl and trainer_state.json, a loss plot.
    const std::string log = files::read_text(out + "/trainer_log.jsonl");
    for (const char* key : {"\"step\"", "\"epoch\"", "\"loss\"", "\"learning_rate\"",
                            "\"grad_norm\"", "\"tokens_per_second\"", "\"eval_loss\""}) {
      CHECK_THAT(log, Contains(key));
    }
    CHECK_THAT(files::read_text(out + "/trainer_state.json"), Contains("\"log_history\""));
    CHECK_THAT(files::read_text(out + "/loss.svg"), Contains("<svg") && Contains("polyline"));
    // The final adapter loads over the base and gives the trained model's outputs.
    ModelConfig c = parse_model_config(kTinyModel);
    CausalLM base(c, at::TensorOptions(), false);
    load_weights(base, *random_source(c, 5));
    load_adapter(base, out, false);
    at::NoGradGuard no_grad;
    CHECK(base.logits(at::randint(3, 200, {1, 6}, at::kLong)).isfinite().all().item<bool>());
  }
  SECTION("full fine-tuning: HF weights in the checkpoint folder and in output_dir") {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {}));
    Trainer trainer(args, comm);
    trainer.train();
    for (const std::string& folder : {dir + "/out", dir + "/out/checkpoint-8"}) {
      INFO(folder);
      ModelConfig c = load_model_config(folder);
      CausalLM m(c, at::TensorOptions(), false);
      load_weights(m, *checkpoint_source(folder));  // from_pretrained's view of it
    }
    // The checkpoint's weights are the merged masters.
    const std::string merged = test::temp_dir("merged") + "/m";
    merge_checkpoint(dir + "/out/checkpoint-8", merged);
    SafetensorsCheckpoint a(dir + "/out/checkpoint-8"), b(merged);
    for (const std::string& name : a.names()) {
      INFO(name);
      CHECK(at::equal(a.load(name), b.load(name)));
    }
  }
}

TEST_CASE("an output_dir with checkpoints needs resume or overwrite", "[trainer][errors]") {
  const std::string dir = test::temp_dir("policy");
  write_data(dir, "train.jsonl", 16, 5);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--max_steps", "4"}));
    Trainer(args, comm).train();
  }
  const std::string before = files::read_text(dir + "/out/checkpoint-4/trainer_state.json");
  TrainingArguments again;
  apply_training_flags(again, run_flags(dir, {"--max_steps", "4"}));
  CHECK_THROWS_WITH(Trainer(again, comm), Contains("already holds 1 checkpoint") &&
                                              Contains("--resume_from_checkpoint True") &&
                                              Contains("--overwrite_output_dir"));
  CHECK(files::read_text(dir + "/out/checkpoint-4/trainer_state.json") == before);  // untouched
  TrainingArguments overwrite;
  apply_training_flags(overwrite, run_flags(dir, {"--max_steps", "4", "--overwrite_output_dir"}));
  CHECK_NOTHROW(Trainer(overwrite, comm).train());
  TrainingArguments missing;
  apply_training_flags(missing, run_flags(dir, {"--resume_from_checkpoint", dir + "/nowhere"}));
  CHECK_THROWS_WITH(Trainer(missing, comm), Contains("nowhere"));
}

TEST_CASE("a resumed run never removes another run's complete checkpoints without the flag",
          "[trainer][errors][checkpoint]") {
  const std::string dir = test::temp_dir("others");
  write_data(dir, "train.jsonl", 32, 5);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto run = [&](std::vector<std::string> extra) {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, extra));
    Trainer(args, comm).train();
  };
  run({});  // run A: checkpoint-4, checkpoint-8
  // Run B starts anew in the same folder and stops at step 2: `latest` names its checkpoint-2.
  run({"--overwrite_output_dir", "--max_steps", "2", "--save_steps", "2"});
  const std::string a8 = files::read_text(dir + "/out/checkpoint-8/trainer_state.json");
  // A plain resume: A's checkpoints are newer than B's latest and complete — refused, kept.
  CHECK_THROWS_WITH(run({"--resume_from_checkpoint", "True"}),
                    Contains("checkpoint-4, checkpoint-8") && Contains("another run") &&
                        Contains("--overwrite_output_dir"));
  CHECK(files::read_text(dir + "/out/checkpoint-8/trainer_state.json") == a8);
  CHECK(fs::exists(dir + "/out/checkpoint-4/optimizer"));
  // With the flag on this command they are removed, and the run continues B's.
  run({"--resume_from_checkpoint", "True", "--overwrite_output_dir"});
  CHECK(list_checkpoints(dir + "/out").back().step == 8);
  CHECK(train_step_run_id(dir + "/out/checkpoint-8") ==
        train_step_run_id(dir + "/out/checkpoint-2"));
}

TEST_CASE("a save stopped before it updated latest is complete: the resumed run continues from it",
          "[trainer][checkpoint]") {
  const std::string dir = test::temp_dir("behind");
  write_data(dir, "train.jsonl", 32, 5);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--max_steps", "6", "--save_steps", "2"}));
    Trainer(args, comm).train();
  }
  files::write_atomic(dir + "/out/latest", "checkpoint-4\n");  // as a save killed after rename
  const std::string six = files::read_text(dir + "/out/checkpoint-6/trainer_state.json");
  TrainingArguments resume;
  apply_training_flags(resume, run_flags(dir, {"--max_steps", "8", "--save_steps", "2",
                                               "--resume_from_checkpoint", "True"}));
  Trainer t(resume, comm);
  CHECK(t.train().global_step == 8);
  CHECK(files::read_text(dir + "/out/checkpoint-6/trainer_state.json") == six);  // kept, resumed
  // Steps 5 and 6 were logged once, by the first run: the resumed one began at step 7.
  const std::string log = files::read_text(dir + "/out/trainer_log.jsonl");
  auto records_of = [&](int step) {
    const std::string key = fmt::format("{{\"step\":{},", step);
    int n = 0;
    for (size_t at = log.find(key); at != std::string::npos; at = log.find(key, at + 1)) ++n;
    return n;
  };
  CHECK(records_of(5) == 1);
  CHECK(records_of(7) == 1);
}

TEST_CASE("output_dir may not be the model folder, hold another run's model, or links and FIFOs",
          "[trainer][errors]") {
  const std::string dir = test::temp_dir("outdir");
  write_data(dir, "train.jsonl", 16, 5);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto attempt = [&](std::vector<std::string> extra) {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, extra));
    Trainer(args, comm).train();
  };
  // A model folder (the tiny model exported), then output_dir = it, and a folder inside it.
  attempt({"--max_steps", "2", "--save_steps", "100"});
  const std::string model = dir + "/model";
  fs::rename(dir + "/out", model);
  const std::string weights = files::read_text(model + "/model.safetensors", "model", UINT64_MAX);
  for (const std::string& out : std::vector<std::string>{model, model + "/", model + "/sub"}) {
    INFO(out);
    CHECK_THROWS_WITH(
        attempt({"--model_config", "", "--model_name_or_path", model, "--output_dir", out}),
        Contains("model_name_or_path folder") && Contains("choose another output_dir"));
  }
  CHECK(files::read_text(model + "/model.safetensors", "model", UINT64_MAX) == weights);
  // A folder with a previous run's final model and no checkpoint: refused without the flag.
  CHECK_THROWS_WITH(attempt({"--output_dir", model}),
                    Contains("previous run's outputs") && Contains("--overwrite_output_dir"));
  // With it, the log starts afresh: only the new run's records.
  attempt(
      {"--output_dir", model, "--overwrite_output_dir", "--max_steps", "3", "--save_steps", "100"});
  const auto losses = logged_losses(model);
  CHECK(losses.size() == 3);
  // Links and FIFOs where the run writes: refused at once, never written through or waited on.
  const std::string outside = dir + "/outside.txt";
  files::write_atomic(outside, "keep\n");
  for (const std::string kind : {"link", "fifo"}) {
    INFO(kind);
    const std::string out = dir + "/out_" + kind;
    fs::create_directories(out);
    if (kind == "link") {
      fs::create_symlink(outside, out + "/trainer_log.jsonl");
    } else {
      REQUIRE(::mkfifo((out + "/trainer_log.jsonl").c_str(), 0644) == 0);
    }
    CHECK_THROWS_WITH(attempt({"--output_dir", out}),
                      Contains("trainer_log.jsonl") && Contains("remove or rename it"));
  }
  CHECK(files::read_text(outside) == "keep\n");
}

TEST_CASE("bad inputs to a run are errors naming the file, line or key", "[trainer][errors]") {
  const std::string dir = test::temp_dir("bad");
  write_data(dir, "train.jsonl", 16, 6);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto attempt = [&](std::vector<std::string> extra) {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, extra));
    Trainer(args, comm).train();
  };
  CHECK_THROWS_WITH(attempt({"--train_file", dir + "/absent.jsonl"}), Contains("absent.jsonl"));
  files::write_atomic(dir + "/broken.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"no end\n");
  CHECK_THROWS_WITH(attempt({"--train_file", dir + "/broken.jsonl"}), Contains("broken.jsonl:2"));
  CHECK_THROWS_WITH(
      attempt({"--deepspeed", R"({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})"}),
      Contains("train_batch_size"));
  CHECK_THROWS_WITH(attempt({"--model_config", "", "--model_name_or_path", dir + "/no_model"}),
                    Contains("no_model"));
  CHECK_THROWS_WITH(attempt({"--packing", "--finetuning_type", "prefix"}), Contains("packing"));
  CHECK_THROWS_WITH(
      attempt({"--model_config", R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})"}),
      Contains("259"));
}

TEST_CASE("packed training runs and counts every example once per epoch", "[trainer][packing]") {
  const std::string dir = test::temp_dir("packed");
  write_data(dir, "train.jsonl", 32, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args,
                       run_flags(dir, {"--packing", "--max_length", "128", "--max_steps", "-1",
                                       "--num_train_epochs", "1", "--save_steps", "1000"}));
  Trainer trainer(args, comm);
  TrainResult r = trainer.train();
  const auto losses = logged_losses(dir + "/out");
  CHECK(r.global_step >= 1);
  CHECK(losses.rbegin()->second < losses.begin()->second);
}

TEST_CASE("a LoRA checkpoint merges into its base: the merged model gives the adapter's outputs",
          "[trainer][merge]") {
  const std::string dir = test::temp_dir("lora_merge");
  write_data(dir, "train.jsonl", 24, 8);
  // A base model folder, as from_pretrained would read it.
  const ModelConfig c = write_base_model(dir + "/base");
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  std::vector<std::string> flags =
      run_flags(dir, {"--finetuning_type", "lora", "--lora_r", "4", "--lora_target_modules",
                      "q_proj,v_proj,down_proj"});
  flags[0] = "--model_name_or_path";
  flags[1] = dir + "/base";
  apply_training_flags(args, flags);
  Trainer(args, comm).train();
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out/checkpoint-8", dir + "/merged", options);  // base from the adapter
  // The run's final output folder (adapter files only) merges to the same model.
  merge_checkpoint(dir + "/out", dir + "/merged_from_output", options);
  {
    SafetensorsCheckpoint a(dir + "/merged"), b(dir + "/merged_from_output");
    CHECK(a.names() == b.names());
    for (const std::string& name : a.names()) {
      INFO(name);
      CHECK((a.load(name) - b.load(name)).abs().max().item<double>() < 1e-6);
    }
  }
  CausalLM with_adapter(c, at::TensorOptions(), false), merged(c, at::TensorOptions(), false);
  load_weights(with_adapter, *checkpoint_source(dir + "/base"));
  load_adapter(with_adapter, dir + "/out/checkpoint-8", false);
  load_weights(merged, *checkpoint_source(dir + "/merged"));
  at::NoGradGuard no_grad;
  at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
  at::Tensor a = with_adapter.logits(ids), b = merged.logits(ids);
  CHECK((a - b).abs().max().item<double>() < 1e-4);
  // The adapter did change the outputs.
  CausalLM plain(c, at::TensorOptions(), false);
  load_weights(plain, *checkpoint_source(dir + "/base"));
  CHECK((plain.logits(ids) - b).abs().max().item<double>() > 1e-3);
}

TEST_CASE(
    "a QLoRA run (quantization_bit 4) trains and saves a LoRA adapter; 4-bit options "
    "where they cannot apply are errors naming them",
    "[trainer][quant]") {
  const std::string dir = test::temp_dir("qlora_run");
  write_data(dir, "train.jsonl", 24, 8);
  const ModelConfig c = write_base_model(dir + "/base");
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto flags_with = [&](const std::string& out, const std::vector<std::string>& extra) {
    return on_base_model(dir, out, extra);
  };
  Trainer(flags_with("out", {"--finetuning_type", "lora", "--lora_r", "4", "--quantization_bit",
                             "4", "--learning_rate", "1e-2"}),
          comm)
      .train();
  const std::map<int64_t, double> losses = logged_losses(dir + "/out");
  REQUIRE(losses.size() >= 4);
  CHECK(losses.rbegin()->second < losses.begin()->second);
  // The adapter is an ordinary LoRA adapter: only lora_A / lora_B tensors, full shapes.
  SafetensorsFile saved(dir + "/out/adapter_model.safetensors");
  REQUIRE_FALSE(saved.names().empty());
  for (const std::string& key : saved.names()) {
    INFO(key);
    CHECK((key.find("lora_A") != std::string::npos || key.find("lora_B") != std::string::npos));
    CHECK(saved.info(key).dtype != at::kByte);
  }
  // Refused, each naming the option.
  struct Bad {
    std::vector<std::string> flags;
    const char* says;
  };
  const Bad bad[] = {
      {{"--quantization_bit", "4"}, "finetuning_type lora"},
      {{"--quantization_bit", "8", "--finetuning_type", "lora"}, "8-bit"},
      {{"--finetuning_type", "lora", "--bnb_4bit_quant_type", "nf4"}, "bnb_4bit_quant_type"},
      {{"--finetuning_type", "lora", "--load_in_4bit", "true", "--quantization_type", "fp4",
        "--bnb_4bit_quant_type", "nf4"},
       "disagree"},
      {{"--finetuning_type", "lora", "--load_in_4bit", "true", "--bnb_4bit_compute_dtype",
        "bfloat16"},
       "bnb_4bit_compute_dtype"},
  };
  int k = 0;
  for (const Bad& b : bad) {
    INFO(join_flags(b.flags));
    CHECK_THROWS_WITH(Trainer(flags_with("bad" + std::to_string(k++), b.flags), comm).train(),
                      Contains(b.says));
  }
  // Merged, the adapter goes onto the base it was trained over — the dequantized 4-bit one, as
  // PEFT's merge_and_unload on a dequantized base: the merged model gives the QLoRA model's
  // outputs, which the full-precision base with the adapter does not.
  {
    MergeOptions options;
    options.dtype = at::kFloat;
    merge_checkpoint(dir + "/out", dir + "/merged", options);
    merge_checkpoint(dir + "/out/checkpoint-8", dir + "/merged8", options);
    ModelConfig four_bit = parse_model_config(kTinyModel);
    four_bit.quantization = QuantizationConfig{};
    CausalLM qlora(four_bit, at::TensorOptions(), true), merged(c, at::TensorOptions(), true),
        merged8(c, at::TensorOptions(), true), over_full(c, at::TensorOptions(), true);
    load_weights(qlora, *checkpoint_source(dir + "/base"));
    load_adapter(qlora, dir + "/out", false);
    load_weights(merged, *checkpoint_source(dir + "/merged"));
    load_weights(merged8, *checkpoint_source(dir + "/merged8"));
    load_weights(over_full, *checkpoint_source(dir + "/base"));
    load_adapter(over_full, dir + "/out", false);
    at::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
    const at::Tensor want = qlora.logits(ids);
    CHECK((merged.logits(ids) - want).abs().max().item<double>() < 1e-4);
    CHECK((merged8.logits(ids) - want).abs().max().item<double>() < 1e-4);
    CHECK((over_full.logits(ids) - want).abs().max().item<double>() > 1e-3);
  }
  // A folder transformers saved with bitsandbytes' 4-bit weights trains LoRA over them as they
  // are; options that contradict it, or another method, are refused naming them.
  fs::copy(std::string(ZT_FIXTURES) + "/quant/llama_bnb_nf4", dir + "/bnb");
  {
    // Its vocabulary is 128 ids, fewer than the byte-level tokenizer's: token ids as data.
    std::ofstream ids(dir + "/ids.jsonl");
    for (int r = 0; r < 24; ++r) {
      ids << "{\"input_ids\": [";
      for (int t = 0; t < 12; ++t) ids << (t ? ", " : "") << (r * 7 + t * 5) % 120 + 3;
      ids << "]}\n";
    }
  }
  auto on_bnb = [&](const std::string& out, std::vector<std::string> extra) {
    TrainingArguments args = flags_with(out, std::move(extra));
    args.model_name_or_path = dir + "/bnb";
    args.train_file = dir + "/ids.jsonl";
    return args;
  };
  Trainer(on_bnb("out_bnb", {"--finetuning_type", "lora", "--lora_r", "4"}), comm).train();
  CHECK(fs::exists(dir + "/out_bnb/adapter_model.safetensors"));
  {
    // Merged, it is a floating-point model: no quantization_config for transformers to obey.
    MergeOptions options;
    options.dtype = at::kFloat;
    merge_checkpoint(dir + "/out_bnb", dir + "/merged_bnb", options);
    CHECK(files::read_text(dir + "/merged_bnb/config.json").find("quantization_config") ==
          std::string::npos);
    CHECK_FALSE(model::saved_quantization(load_model_config(dir + "/merged_bnb")));
  }
  CHECK_THROWS_WITH(Trainer(on_bnb("bad_bnb1", {"--finetuning_type", "lora", "--quantization_bit",
                                                "4", "--quantization_type", "fp4"}),
                            comm)
                        .train(),
                    Contains("quantization_type fp4"));
  CHECK_THROWS_WITH(Trainer(on_bnb("bad_bnb2", {"--finetuning_type", "full"}), comm).train(),
                    Contains("finetuning_type lora"));
}

TEST_CASE(
    "DoRA and PiSSA runs (LLaMA-Factory's flags) train, write PEFT's files, convert and merge to "
    "the model they trained; contradictions are errors naming the option",
    "[trainer][dora][pissa]") {
  const std::string dir = test::temp_dir("dora_pissa_run");
  write_data(dir, "train.jsonl", 24, 8);
  const ModelConfig c = write_base_model(dir + "/base");
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto flags_with = [&](const std::string& out, const std::vector<std::string>& extra) {
    return on_base_model(dir, out, extra);
  };
  const std::vector<std::string> lora{
      "--finetuning_type", "lora",
      "--lora_r",          "4",
      "--learning_rate",   "1e-2",
      "--max_steps",       "6",
      "--deepspeed",       R"({"zero_optimization": {"stage": 3}})"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = lora;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  struct Run {
    const char* out;
    std::vector<std::string> flags;
    bool four_bit;
  };
  const Run runs[] = {
      {"dora", with({"--use_dora", "true"}), false},
      {"pissa", with({"--pissa_init", "true", "--pissa_iter", "2", "--pissa_convert", "true"}),
       false},
      {"qpissa_dora",
       with({"--pissa_init", "true", "--use_dora", "true", "--quantization_bit", "4"}), true},
  };
  const at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
  for (const Run& run : runs) {
    INFO(run.out);
    Trainer(flags_with(run.out, run.flags), comm).train();
    const std::string out = dir + "/" + run.out;
    const std::map<int64_t, double> losses = logged_losses(out);
    REQUIRE(losses.size() >= 3);
    CHECK(losses.rbegin()->second < losses.begin()->second);
    const PeftConfig saved = load_adapter_config(out);
    const bool pissa = std::string(run.out).find("pissa") != std::string::npos;
    CHECK(saved.lora.use_dora == (std::string(run.out).find("dora") != std::string::npos));
    const PeftConfig asked = peft_config_for(flags_with(run.out, run.flags));
    CHECK(saved.lora.init_lora_weights == asked.lora.init_lora_weights);
    CHECK((saved.lora.init_lora_weights != "true") == pissa);
    CHECK(fs::exists(out + "/pissa_init/adapter_model.safetensors") == pissa);
    // The model the run trained: its base (4-bit when it was), the adapter's start as the run
    // made it, then the trained values from the files.
    ModelConfig trained_config = c;
    if (run.four_bit) trained_config.quantization = QuantizationConfig{};
    CausalLM trained(trained_config, at::TensorOptions(), /*allocate=*/false);
    const int64_t seed = flags_with(run.out, run.flags).seed;
    apply_peft(trained, asked, static_cast<uint64_t>(seed));
    std::shared_ptr<ParameterSource> source = checkpoint_source(dir + "/base");
    source = peft::pissa_source(source, trained, asked.lora, static_cast<uint64_t>(seed), at::kCPU,
                                true);
    if (run.four_bit) {
      source = model::quantizing_source(*source, model::quantized_weights(trained), source);
    }
    source = peft::dora_source(source, trained, asked.lora);
    {
      at::NoGradGuard no_grad;
      for (auto& item : trained.named_parameters(true)) {
        at::Tensor p = item.value();
        if (!p.is_contiguous()) p.set_data(at::empty(p.sizes(), p.options()));
        if (peft::is_adapter_parameter(item.key())) {
          SafetensorsFile st(out + "/adapter_model.safetensors");
          p.copy_(st.load("base_model.model." + item.key()));
        } else {
          source->read(item.key(), p.sizes().vec(), 0, p);
        }
      }
    }
    at::NoGradGuard no_grad;
    const at::Tensor want = trained.logits(ids);
    // Merged: the base the adapter was trained over (PiSSA's residual, quantized when 4-bit).
    MergeOptions options;
    options.dtype = at::kFloat;
    merge_checkpoint(out, out + "_merged", options);
    CausalLM merged(c, at::TensorOptions(), true);
    load_weights(merged, *checkpoint_source(out + "_merged"));
    CHECK((merged.logits(ids) - want).abs().max().item<double>() < 1e-4);
    if (std::string(run.out) == "pissa") {
      // pissa_converted/ is plain LoRA of rank 2r over the original base, the same model.
      const PeftConfig plain = load_adapter_config(out + "/pissa_converted");
      CHECK(plain.lora.r == 8);
      CHECK(plain.lora.init_lora_weights == "true");
      CausalLM converted(c, at::TensorOptions(), true);
      load_weights(converted, *checkpoint_source(dir + "/base"));
      load_adapter(converted, out + "/pissa_converted", false);
      CHECK((converted.logits(ids) - want).abs().max().item<double>() < 1e-4);
    }
  }
  // Refused, each naming the option.
  struct Bad {
    std::vector<std::string> flags;
    const char* says;
  };
  const Bad bad[] = {
      {with({"--pissa_convert", "true"}), "pissa_convert"},
      {with({"--pissa_init", "true", "--pissa_convert", "true", "--use_dora", "true"}),
       "pissa_convert with use_dora"},
      {with({"--init_lora_weights", "olora"}), "init_lora_weights"},
      {with({"--init_lora_weights", "pissa", "--pissa_init", "true"}), "contradicts pissa_init"},
      {with({"--pissa_init", "true", "--adapter_name_or_path", dir + "/dora"}),
       "adapter_name_or_path"},
      {with({"--pissa_iter", "-2"}), "pissa_iter"},
      {with({"--finetuning_type", "full", "--use_dora", "true"}), "use_dora"},
      {with({"--finetuning_type", "freeze", "--pissa_init", "true"}), "pissa_init"},
  };
  int k = 0;
  for (const Bad& b : bad) {
    INFO(join_flags(b.flags));
    CHECK_THROWS_WITH(
        [&] { Trainer(flags_with("bad" + std::to_string(k++), b.flags), comm).train(); }(),
        Contains(b.says));
  }
}

TEST_CASE(
    "over a 4-bit base, QLoRA and DoRA train the same with packing and variable-length attention "
    "whether activations are recomputed or kept",
    "[trainer][quant][dora]") {
  // Checkpointing (with and without a keep budget) recomputes the 4-bit projections, which
  // dequantize again: the losses are those of the run that keeps every activation.
  const std::string dir = test::temp_dir("qlora_packed");
  write_data(dir, "train.jsonl", 32, 4);
  write_base_model(dir + "/base");
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (const char* dora : {"false", "true"}) {
    INFO("use_dora " << dora);
    std::vector<std::map<int64_t, double>> runs;
    int k = 0;
    for (const std::vector<std::string>& memory :
         {std::vector<std::string>{"--gradient_checkpointing", "false"},
          std::vector<std::string>{"--gradient_checkpointing", "true",
                                   "--gradient_checkpointing_keep", "none"},
          std::vector<std::string>{"--gradient_checkpointing", "true",
                                   "--gradient_checkpointing_keep", "1"}}) {
      std::vector<std::string> flags{"--finetuning_type",  "lora", "--lora_r",        "4",
                                     "--quantization_bit", "4",    "--use_dora",      dora,
                                     "--packing",          "true", "--max_length",    "256",
                                     "--max_steps",        "4",    "--learning_rate", "1e-2"};
      flags.insert(flags.end(), memory.begin(), memory.end());
      const std::string out = fmt::format("out_{}_{}", dora, k++);
      Trainer(on_base_model(dir, out, flags), comm).train();
      runs.push_back(logged_losses(dir + "/" + out));
    }
    REQUIRE(runs[0].size() == 4);
    for (size_t r = 1; r < runs.size(); ++r) {
      INFO("run " << r);
      REQUIRE(runs[r].size() == runs[0].size());
      for (const auto& [step, loss] : runs[0])
        CHECK(runs[r].at(step) == Approx(loss).epsilon(1e-6));
    }
  }
}

TEST_CASE("ZeRO-3 saves 16-bit weights only when asked, and its checkpoints merge",
          "[trainer][checkpoint]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (bool gather : {false, true}) {
    INFO("stage3_gather_16bit_weights_on_model_save " << gather);
    const std::string dir = test::temp_dir("z3save");
    write_data(dir, "train.jsonl", 16, 9);
    TrainingArguments args;
    apply_training_flags(args,
                         run_flags(dir, {"--max_steps", "3", "--save_steps", "100", "--deepspeed",
                                         fmt::format(R"({{"zero_optimization": {{"stage": 3,
                                                 "stage3_gather_16bit_weights_on_model_save": {}}}}})",
                                                     gather)}));
    Trainer(args, comm).train();
    const std::string out = dir + "/out";
    CHECK(fs::exists(out + "/config.json"));
    CHECK(fs::exists(out + "/model.safetensors") == gather);
    // Without the gathered weights the sharded state is the final model: a checkpoint to merge.
    CHECK(fs::exists(out + "/checkpoint-3") == !gather);
    if (!gather) {
      merge_checkpoint(out + "/checkpoint-3", dir + "/merged");
      ModelConfig c = load_model_config(dir + "/merged");
      CausalLM m(c, at::TensorOptions(), false);
      load_weights(m, *checkpoint_source(dir + "/merged"));
      // The run's output folder merges too: from its newest checkpoint, the same tensors.
      merge_checkpoint(out, dir + "/merged_out");
      SafetensorsFile a(dir + "/merged/model.safetensors"),
          b(dir + "/merged_out/model.safetensors");
      REQUIRE(a.names() == b.names());
      for (const std::string& name : a.names()) CHECK(at::equal(a.load(name), b.load(name)));
    }
  }
}

// train_step with a host's own batches: rank r of W takes its rows of each global batch of 8.
// Adam's epsilon is 1e-4: the runs' gradients agree to ~4e-7 of each tensor's largest element
// (fp32 summation order), but Adam divides by sqrt(v) + eps, so with the default 1e-8 an element
// whose gradient is near 0 turns that noise into update differences of up to ~lr (1e-4 seen).
TEST_CASE("rank: train_step on a split global batch", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t rows = 8, micro = std::atoi(std::getenv("ZT_MICRO")),
                accum = rows / (micro * world);
  const char* model_config = std::getenv("ZT_MODEL_CONFIG");
  TrainingArguments args;
  apply_training_flags(
      args, {"--model_config",
             model_config != nullptr ? model_config : kTinyModel,
             "--output_dir",
             std::getenv("ZT_DIR"),
             "--max_steps",
             "4",
             "--learning_rate",
             "0.01",
             "--adam_epsilon",
             "1e-4",
             "--seed",
             "3",
             "--per_device_train_batch_size",
             std::to_string(micro),
             "--gradient_accumulation_steps",
             std::to_string(accum),
             "--max_grad_norm",
             "0",
             "--deepspeed",
             fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", std::getenv("ZT_STAGE"))});
  Trainer trainer(args, comm);
  std::vector<double> norms;
  for (int64_t step = 0; step < 4; ++step) {
    at::manual_seed(100 + step);  // the same global batch on every rank and world size
    at::Tensor ids = at::randint(3, 250, {rows, 12}, at::kLong);
    at::Tensor labels = ids.clone();
    for (int64_t r = 0; r < rows; ++r)
      labels[r].narrow(0, 0, 1 + r % 5).fill_(-100);  // uneven counts
    for (int64_t a = 0; a < accum; ++a) {
      const int64_t first = (a * world + rank) * micro;
      StepStats s = trainer.train_step(ids.narrow(0, first, micro), labels.narrow(0, first, micro));
      CHECK(s.stepped == (a == accum - 1));
      if (s.stepped) norms.push_back(s.grad_norm);
    }
  }
  trainer.export_model(std::string(std::getenv("ZT_DIR")) + "/model");
  if (rank == 0) {
    std::ofstream out(std::string(std::getenv("ZT_DIR")) + "/norms.txt");
    for (double n : norms) out << fmt::format("{:.17g}\n", n);
  }
}

namespace {

// The split-batch runs of "rank: train_step on a split global batch" at `world` ranks, ZeRO
// `stage`, `micro` rows a micro-step, of `model` (kTinyModel when empty); returns the run's
// folder.
std::string split_run(int world, int stage, int micro, const std::string& model = "") {
  const std::string dir = test::temp_dir("split");
  test::Env env{
      {"ZT_DIR", dir}, {"ZT_STAGE", std::to_string(stage)}, {"ZT_MICRO", std::to_string(micro)}};
  if (!model.empty()) env.emplace_back("ZT_MODEL_CONFIG", model);
  test::run_ranks(world, "rank: train_step on a split global batch", std::chrono::seconds(240),
                  env);
  return dir;
}

}  // namespace

namespace {

// The gradient norms a split run wrote.
std::vector<double> norms_of(const std::string& dir) {
  std::vector<double> n;
  std::ifstream in(dir + "/norms.txt");
  for (double v; in >> v;) n.push_back(v);
  return n;
}

// The split-batch steps of `model` at one rank under stage 0, then at each (world, stage,
// micro-batch) of `runs`: each must give the reference's gradient norms and trained weights.
// Returns the reference's folder.
std::string check_same_steps(const std::vector<std::tuple<int, int, int>>& runs,
                             const std::string& model = "") {
  const std::string reference = split_run(1, 0, 2, model);
  const std::vector<double> want = norms_of(reference);
  REQUIRE(want.size() == 4);
  SafetensorsCheckpoint want_model(reference + "/model");
  for (auto [world, stage, micro] : runs) {
    INFO("world " << world << " stage " << stage << " micro-batch " << micro);
    const std::string dir = split_run(world, stage, micro, model);
    const std::vector<double> got = norms_of(dir);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(2e-5));
    SafetensorsCheckpoint trained(dir + "/model");
    for (const std::string& name : want_model.names()) {
      INFO(name);
      CHECK((trained.load(name) - want_model.load(name)).abs().max().item<double>() < 2e-6);
    }
  }
  return reference;
}

}  // namespace

TEST_CASE("train_step gives the same steps whatever the world size, split and stage",
          "[trainer][equivalence]") {
  if (test::skip_cpu_world(4)) return;
  // The last run: the whole batch in one micro-step at one rank, where the engine updates
  // inside backward and train_step passes the exact token count instead of correcting later.
  check_same_steps({{2, 3, 2}, {4, 1, 2}, {2, 2, 2}, {1, 2, 8}});
}

TEST_CASE("a mixture-of-experts model trains the same at 1, 2 and 4 ranks under every ZeRO stage",
          "[trainer][equivalence][moe]") {
  if (test::skip_cpu_world(4)) return;
  // Qwen3-MoE's blocks: q/k norms, 6 experts of which each token takes 2, a dense layer
  // between sparse ones (mlp_only_layers).
  const std::string model =
      R"({"model_type": "qwen3_moe", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "norm_topk_prob": true, "mlp_only_layers": [1]})";
  const std::string reference =
      check_same_steps({{2, 3, 2}, {4, 1, 2}, {2, 2, 1}, {1, 3, 8}}, model);
  SafetensorsCheckpoint trained(reference + "/model");
  CHECK(trained.contains("model.layers.0.mlp.experts.gate_up_proj"));
  CHECK(trained.contains("model.layers.1.mlp.gate_proj.weight"));
}

namespace {

// 12 examples, micro-batch 2: 6 steps an epoch at one rank, 3 at two.
std::vector<std::string> epoch_flags(const std::vector<std::string>& extra) {
  std::vector<std::string> f{"--max_steps", "-1", "--num_train_epochs", "3", "--save_steps", "8"};
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

// Each example's (loss sum, target tokens) under the run's initial weights (the tiny model,
// seed 5), for runs at learning rate 0, whose step losses then tell which examples they used.
std::vector<std::pair<double, double>> initial_example_losses(const std::string& train_file) {
  DataOptions options;
  options.template_name = "alpaca";
  const Dataset data = tokenize_jsonl(train_file, *byte_tokenizer(), options);
  const ModelConfig c = parse_model_config(kTinyModel);
  CausalLM model(c, at::TensorOptions(), false);
  load_weights(model, *random_source(c, 5));
  at::NoGradGuard no_grad;
  std::vector<std::pair<double, double>> example;
  for (int64_t i = 0; i < data.size(); ++i) {
    auto as_tensor = [](TokenView v) {
      return at::tensor(std::vector<int64_t>(v.begin(), v.end()), at::kLong).unsqueeze(0);
    };
    LossSum l = model.loss(as_tensor(data.ids(i)), as_tensor(data.labels(i)));
    example.emplace_back(l.sum.item<double>(), static_cast<double>(l.tokens));
  }
  return example;
}

// The loss of every step of a run at learning rate 0 on 12 examples written into `dir`
// (epoch_flags), with `extra` on top.
std::vector<double> frozen_step_losses(const std::string& dir,
                                       const std::vector<std::string>& extra) {
  write_data(dir, "train.jsonl", 12, 11);
  auto comm = std::shared_ptr<Communicator>(test::join());
  std::vector<std::string> flags{"--learning_rate", "0", "--save_steps", "100"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, epoch_flags(flags)));
  std::vector<double> step_losses;
  TrainerCallbacks callbacks;
  callbacks.on_step = [&](const StepStats& s) { step_losses.push_back(s.loss); };
  Trainer(args, comm, callbacks).train();
  return step_losses;
}

// The loss of step `s` of an epoch visiting examples in `order` at micro-batch 2, one rank.
double step_loss(const std::vector<std::pair<double, double>>& example,
                 const std::vector<int64_t>& order, int64_t s) {
  double sum = 0, tokens = 0;
  for (int64_t i : micro_batch_indices(order, GlobalBatch{2, 1, 1}, s, 0, 0)) {
    sum += example[static_cast<size_t>(i)].first;
    tokens += example[static_cast<size_t>(i)].second;
  }
  return sum / tokens;
}

}  // namespace

TEST_CASE("every epoch visits the data in its own order, from the seed and the epoch",
          "[trainer][epochs]") {
  // With learning rate 0 the model never changes, so each step's loss is the token-weighted
  // mean of its examples' losses under the initial weights: the losses tell which examples each
  // step used.
  const std::string dir = test::temp_dir("epochs");
  const std::vector<double> step_losses = frozen_step_losses(dir, {});
  REQUIRE(step_losses.size() == 18);

  const auto example = initial_example_losses(dir + "/train.jsonl");
  std::vector<std::vector<int64_t>> orders;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    orders.push_back(epoch_order(12, 5, epoch, true));
    for (int64_t s = 0; s < 6; ++s) {
      INFO("epoch " << epoch << " step " << s);
      CHECK(step_losses[static_cast<size_t>(epoch * 6 + s)] ==
            Approx(step_loss(example, orders.back(), s)).epsilon(1e-5));
    }
  }
  CHECK(orders[0] != orders[1]);
  CHECK(orders[1] != orders[2]);
  // The logged epoch rises to num_train_epochs; trainer_state.json ends there.
  const auto epochs = test::logged(dir + "/out", "epoch");
  double previous = 0.0;
  for (const auto& [step, epoch] : epochs) {
    INFO("step " << step);
    CHECK(epoch > previous);
    CHECK(epoch == Approx(static_cast<double>(step) / 6.0));
    previous = epoch;
  }
  CHECK(previous == 3.0);
  const std::string state = files::read_text(dir + "/out/trainer_state.json");
  CHECK_THAT(state, Contains("\"epoch\": 3.0") && Contains("\"global_step\": 18"));
}

TEST_CASE("a run stopped in its second epoch resumes to the uninterrupted run's losses",
          "[trainer][epochs][checkpoint]") {
  if (test::skip_cpu_world(2)) return;
  for (int world : {1, 2}) {
    // Checkpoint 8 at one rank is step 2 of epoch 2 (6 steps an epoch); at two, the second
    // checkpoint (4, 8) lies in epoch 2 or 3 (3 steps an epoch), with the stop after step 5.
    const int64_t steps = world == 1 ? 18 : 9, save = world == 1 ? 8 : 4;
    INFO("world " << world);
    const std::string whole = test::temp_dir("ep_whole"), parts = test::temp_dir("ep_parts");
    for (const std::string& d : {whole, parts}) write_data(d, "train.jsonl", 12, 12);
    const std::vector<std::string> flags = epoch_flags({"--save_steps", std::to_string(save)});
    train_ranks(world, whole, flags);
    train_ranks(world, parts, flags, /*cancel_at=*/static_cast<int>(save + 1));
    REQUIRE(list_checkpoints(parts + "/out").back().step == save);
    std::vector<std::string> resume = flags;
    resume.insert(resume.end(), {"--resume_from_checkpoint", "True"});
    train_ranks(world, parts, resume);
    const auto want = logged_losses(whole + "/out"), got = logged_losses(parts + "/out");
    REQUIRE(static_cast<int64_t>(want.size()) == steps);
    for (int64_t step = save + 1; step <= steps; ++step) {
      INFO("step " << step);
      REQUIRE(got.count(step));
      CHECK(got.at(step) == want.at(step));  // bit for bit: same order, same reductions
    }
    if (world == 2) {
      // The checkpoint of 2 ranks resumed at 1 (accumulation 2 keeps the global batch of 4).
      const std::string one = test::temp_dir("ep_one");
      write_data(one, "train.jsonl", 12, 12);
      fs::create_directories(one + "/out");
      fs::copy(parts + "/out/checkpoint-" + std::to_string(save),
               one + "/out/checkpoint-" + std::to_string(save), fs::copy_options::recursive);
      train_ranks(1, one, resume);
      const auto at_one = logged_losses(one + "/out");
      for (int64_t step = save + 1; step <= steps; ++step) {
        INFO("resumed at 1 rank, step " << step);
        REQUIRE(at_one.count(step));
        // fp32 sums of two ranks' gradients in another order: REFERENCE §3 measured ≤ 2e-7
        // relative after 8 AdamW steps for this kind of split.
        CHECK(at_one.at(step) == Approx(want.at(step)).epsilon(2e-6));
      }
    }
  }
}

namespace {

// Every record of out_dir/trainer_log.jsonl as [step, kind] ("loss", "eval_loss" or
// "train_loss": a training, evaluation or summary record), in file order.
std::vector<std::pair<int64_t, std::string>> log_records(const std::string& out_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::istringstream lines(files::read_text(out_dir + "/trainer_log.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    rapidjson::Document r;
    r.Parse(line.c_str());
    REQUIRE(r.IsObject());
    const char* kind = r.HasMember("loss")        ? "loss"
                       : r.HasMember("eval_loss") ? "eval_loss"
                                                  : "train_loss";
    out.emplace_back(r["step"].GetInt64(), kind);
  }
  return out;
}

}  // namespace

TEST_CASE("a resumed run's train_loss covers the whole run, and its log holds each record once",
          "[trainer][checkpoint][counts]") {
  // Logged every 2 steps, saved every 3, stopped after step 5: checkpoint-3 holds step 3 in an
  // open window, and the stopped run had logged step 4 past it.
  const std::string whole = test::temp_dir("loss_whole"), parts = test::temp_dir("loss_parts");
  for (const std::string& d : {whole, parts}) {
    write_data(d, "train.jsonl", 24, 7);
    write_data(d, "eval.jsonl", 6, 8);
  }
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto args_for = [&](const std::string& dir, std::vector<std::string> extra) {
    extra.insert(extra.end(),
                 {"--logging_steps", "2", "--save_steps", "3", "--eval_file", dir + "/eval.jsonl",
                  "--eval_strategy", "steps", "--eval_steps", "3", "--eval_on_start", "true"});
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, extra));
    return args;
  };
  const TrainResult want = Trainer(args_for(whole, {}), comm).train();
  {
    TrainerCallbacks callbacks;
    Trainer* self = nullptr;
    callbacks.on_progress = [&](const Progress& p) {
      if (p.step == 5) self->cancel();
    };
    Trainer stopped(args_for(parts, {}), comm, callbacks);
    self = &stopped;
    CHECK_THROWS_AS(stopped.train(), CancelledError);
  }
  REQUIRE(list_checkpoints(parts + "/out").back().step == 3);
  const TrainResult got =
      Trainer(args_for(parts, {"--resume_from_checkpoint", "True"}), comm).train();
  REQUIRE(got.global_step == 8);
  // The resumed run's steps are the uninterrupted run's (windows 5-6 and 7-8 log the same).
  const auto whole_losses = test::logged_losses(whole + "/out");
  const auto part_losses = test::logged_losses(parts + "/out");
  for (int64_t step : {6, 8}) CHECK(part_losses.at(step) == whole_losses.at(step));
  // train_loss: the mean step loss of all 8 steps, in the result and the summary record. A
  // window sums its steps in fp32 on the device, and the windows group the steps differently:
  // up to 8 roundings of 2^-24 apart.
  CHECK(got.train_loss == Approx(want.train_loss).epsilon(1e-6));
  CHECK(test::logged(parts + "/out", "train_loss").at(8) == Approx(want.train_loss).epsilon(1e-6));
  // Each record once, in step order: the stopped run's records past step 3 are gone, the
  // evaluation at step 3 (in the checkpoint) is not repeated by eval_on_start, and the
  // summary is written once.
  const std::vector<std::pair<int64_t, std::string>> records = log_records(parts + "/out");
  CHECK(records == log_records(whole + "/out"));
  CHECK(records == std::vector<std::pair<int64_t, std::string>>{{0, "eval_loss"},
                                                                {2, "loss"},
                                                                {3, "eval_loss"},
                                                                {4, "loss"},
                                                                {6, "loss"},
                                                                {6, "eval_loss"},
                                                                {8, "loss"},
                                                                {8, "eval_loss"},
                                                                {8, "train_loss"}});
  // trainer_state.json's history is the same records.
  rapidjson::Document state;
  state.Parse(files::read_text(parts + "/out/trainer_state.json").c_str());
  CHECK(state["log_history"].Size() == records.size());
}

TEST_CASE("a checkpoint without the saved run loss resumes with the loss of its log history",
          "[trainer][checkpoint][counts]") {
  const std::string dir = test::temp_dir("loss_legacy");
  write_data(dir, "train.jsonl", 24, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, {"--logging_steps", "3", "--save_steps", "4"}));
  Trainer(args, comm).train();
  const std::string checkpoint = dir + "/out/checkpoint-4";
  const train::TrainerState saved = train::read_trainer_state(checkpoint);
  CHECK(saved.train_loss_steps == 4);  // the steps of the window open at step 4 included
  // As a checkpoint written before the sum was saved: from the records, the window of steps
  // 1-3 (its loss is their mean).
  std::string text = files::read_text(checkpoint + "/zerotrain_state.json");
  for (const char* key : {"\"train_loss_sum\"", "\"train_loss_steps\""}) {
    const size_t at = text.find(key);
    REQUIRE(at != std::string::npos);
    text.erase(at, text.find('\n', at) + 1 - at);
  }
  files::write_atomic(checkpoint + "/zerotrain_state.json", text);
  const train::TrainerState legacy = train::read_trainer_state(checkpoint);
  CHECK(legacy.train_loss_steps == 3);
  CHECK(legacy.train_loss_sum == Approx(3 * test::logged_losses(dir + "/out").at(3)));
}

TEST_CASE("a run's data summary counts each dropped example under its cause", "[trainer][counts]") {
  const std::string dir = test::temp_dir("sft-counts");
  const std::string path = write_data(dir, "train.jsonl", 8, 3);
  std::ofstream(path, std::ios::app) << R"({"input_ids": [5, 6, 7], "labels": [-100, -100, -100]})"
                                        "\n";
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, {}));
  test::LogCapture log;
  Trainer trainer(args, comm);
  CHECK(log.contains(fmt::format("training data '{}': 8 examples, ", path)));
  CHECK(log.contains("; 1 example dropped: 1 without a trained token"));
  CHECK_FALSE(log.contains("dropped by truncation"));
}

TEST_CASE("train_sampling_strategy sequential visits the file's order in every epoch",
          "[trainer][epochs]") {
  const std::string dir = test::temp_dir("sequential");
  const std::vector<double> step_losses = frozen_step_losses(
      dir, {"--num_train_epochs", "2", "--train_sampling_strategy", "sequential"});
  REQUIRE(step_losses.size() == 12);
  const auto example = initial_example_losses(dir + "/train.jsonl");
  std::vector<int64_t> file_order(12);
  for (int64_t i = 0; i < 12; ++i) file_order[static_cast<size_t>(i)] = i;
  for (int64_t step = 0; step < 12; ++step) {
    INFO("step " << step);
    CHECK(step_losses[static_cast<size_t>(step)] ==
          Approx(step_loss(example, file_order, step % 6)).epsilon(1e-5));
  }
}

TEST_CASE("logging, saving and warmup intervals below 1 are fractions of the run, as in HF",
          "[trainer]") {
  const std::string dir = test::temp_dir("fractions");
  write_data(dir, "train.jsonl", 12, 13);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto run = [&](const std::string& out, const std::vector<std::string>& extra) {
    std::vector<std::string> flags = run_flags(dir, extra);
    for (size_t i = 0; i + 1 < flags.size(); ++i) {
      if (flags[i] == "--output_dir") flags[i + 1] = dir + "/" + out;
    }
    TrainingArguments args;
    apply_training_flags(args, flags);
    Trainer(args, comm).train();
    return dir + "/" + out;
  };
  // 8 steps: logging 0.25 → every ceil(2) steps, saving 0.5 → every 4, warmup 0.25 → 2 steps.
  const std::string fractions = run(
      "fractions", {"--logging_steps", "0.25", "--save_steps", "0.5", "--warmup_steps", "0.25"});
  const std::string steps =
      run("steps", {"--logging_steps", "2", "--save_steps", "4", "--warmup_steps", "2"});
  const auto lr = test::logged(fractions, "learning_rate");
  std::vector<int64_t> logged_steps;
  for (const auto& [step, value] : lr) logged_steps.push_back(step);
  CHECK(logged_steps == std::vector<int64_t>{2, 4, 6, 8});
  CHECK(lr == test::logged(steps, "learning_rate"));  // the same warmup
  CHECK(test::logged_losses(fractions) == test::logged_losses(steps));
  for (const char* c : {"checkpoint-4", "checkpoint-8"})
    CHECK(fs::is_directory(fractions + "/" + c));
  CHECK_FALSE(fs::exists(fractions + "/checkpoint-2"));
  rapidjson::Document state;
  state.Parse(files::read_text(fractions + "/trainer_state.json").c_str());
  CHECK(state["logging_steps"].GetInt64() == 2);  // HF's state holds the resolved intervals
  CHECK(state["save_steps"].GetInt64() == 4);
  rapidjson::Document settings;
  settings.Parse(files::read_text(fractions + "/training_args.json").c_str());
  CHECK(settings["training_arguments"]["logging_steps"].GetDouble() == 0.25);
  settings.Parse(files::read_text(steps + "/training_args.json").c_str());
  CHECK(settings["training_arguments"]["logging_steps"]
            .IsInt64());  // whole steps written as integers
}

TEST_CASE("a run writes HF's trainer_state.json and its resolved settings as JSON", "[trainer]") {
  const std::string dir = test::temp_dir("settings");
  write_data(dir, "train.jsonl", 12, 13);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, {"--deepspeed", R"({"zero_optimization": {"stage": 2},
      "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}})"}));
  Trainer(args, comm).train();
  for (const std::string& folder : {dir + "/out", dir + "/out/checkpoint-4"}) {
    INFO(folder);
    // trainer_state.json: exactly TrainerState's fields, so HF's TrainerState.load_from_json
    // (TrainerState(**json)) reads it.
    rapidjson::Document state;
    state.Parse(files::read_text(folder + "/trainer_state.json").c_str());
    REQUIRE(state.IsObject());
    std::set<std::string> keys;
    for (auto it = state.MemberBegin(); it != state.MemberEnd(); ++it)
      keys.insert(it->name.GetString());
    CHECK(keys == std::set<std::string>{"best_global_step",
                                        "best_metric",
                                        "best_model_checkpoint",
                                        "epoch",
                                        "eval_steps",
                                        "global_step",
                                        "is_hyper_param_search",
                                        "is_local_process_zero",
                                        "is_world_process_zero",
                                        "log_history",
                                        "logging_steps",
                                        "max_steps",
                                        "num_input_tokens_seen",
                                        "num_train_epochs",
                                        "save_steps",
                                        "stateful_callbacks",
                                        "total_flos",
                                        "train_batch_size",
                                        "trial_name",
                                        "trial_params"});
    CHECK(state["total_flos"].GetDouble() > 0);
    CHECK(state["num_input_tokens_seen"].GetInt64() > 0);
    // training_args.json: the version, every option and the DeepSpeed config as it ran — which
    // parses back into the same resolved settings.
    rapidjson::Document settings;
    settings.Parse(files::read_text(folder + "/training_args.json").c_str());
    REQUIRE(settings.IsObject());
    CHECK(std::string(settings["zerotrain_version"].GetString()) == ZT_VERSION_STRING);
    CHECK(settings["training_arguments"]["learning_rate"].GetDouble() == 3e-3);
    CHECK(std::string(settings["training_arguments"]["template"].GetString()) == "alpaca");
    CHECK_FALSE(
        settings["training_arguments"].HasMember("evaluation_strategy"));  // aliases left out
    const std::string ds_text = json::dump(settings["deepspeed_config"]);
    DeepSpeedConfig ds = parse_deepspeed_config(ds_text);
    CHECK(unresolved_keys(ds).empty());
    CHECK(ds.zero.stage == 2);
    CHECK(ds.optimizer.lr.value() == 3e-3);
    CHECK(ds.gradient_clipping.value() == 1.0);
    CHECK(ds.train_micro_batch_size_per_gpu.value() == 2);
  }
}

TEST_CASE(
    "resuming from an older checkpoint is refused before any step, or replaces the newer ones",
    "[trainer][checkpoint][errors]") {
  const std::string dir = test::temp_dir("older");
  write_data(dir, "train.jsonl", 16, 14);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {}));
    Trainer(args, comm).train();
  }
  REQUIRE(list_checkpoints(dir + "/out").size() == 2);
  const std::string log_before = files::read_text(dir + "/out/trainer_log.jsonl");
  TrainingArguments older;
  apply_training_flags(older,
                       run_flags(dir, {"--resume_from_checkpoint", dir + "/out/checkpoint-4"}));
  CHECK_THROWS_WITH(Trainer(older, comm), Contains("checkpoint-8") &&
                                              Contains("--overwrite_output_dir") &&
                                              Contains("step 4"));
  CHECK(files::read_text(dir + "/out/trainer_log.jsonl") == log_before);  // nothing ran
  CHECK(list_checkpoints(dir + "/out").size() == 2);
  TrainingArguments replace;
  apply_training_flags(replace,
                       run_flags(dir, {"--resume_from_checkpoint", dir + "/out/checkpoint-4/",
                                       "--overwrite_output_dir"}));
  std::string latest_at_step5;
  bool newer_gone = false;
  TrainerCallbacks callbacks;
  callbacks.on_step = [&](const StepStats& s) {
    if (s.global_step != 5) return;
    latest_at_step5 = files::read_text(dir + "/out/latest");
    newer_gone = !fs::exists(dir + "/out/checkpoint-8");
  };
  Trainer trainer(replace, comm, callbacks);
  CHECK(list_checkpoints(dir + "/out").size() == 2);  // removed when training starts, not before
  TrainResult r = trainer.train();
  CHECK(latest_at_step5 == "checkpoint-4\n");
  CHECK(newer_gone);
  CHECK(r.global_step == 8);
  CHECK(files::read_text(dir + "/out/latest") == "checkpoint-8\n");
  auto all = list_checkpoints(dir + "/out");
  CHECK(all.size() == 2);
}

TEST_CASE("report_to tensorboard writes event files under logging_dir", "[trainer][tensorboard]") {
  const std::string dir = test::temp_dir("tb_run");
  write_data(dir, "train.jsonl", 8, 15);
  write_data(dir, "eval.jsonl", 4, 16);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto event_files = [](const std::string& root) {
    std::vector<std::string> found;
    if (!fs::exists(root)) return found;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
        found.push_back(e.path().string());
    }
    return found;
  };
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--report_to", "tensorboard", "--max_steps", "4",
                                               "--eval_file", dir + "/eval.jsonl",
                                               "--eval_strategy", "steps", "--eval_steps", "2"}));
    Trainer(args, comm).train();
    const auto found =
        event_files(dir + "/out/runs");  // HF's default: output_dir/runs/<date>_<host>
    REQUIRE(found.size() == 1);
    const std::string bytes = files::read_text(found[0]);
    for (const char* tag : {"train/loss", "train/learning_rate", "train/grad_norm",
                            "train/tokens_per_second", "eval/loss"}) {
      CHECK(bytes.find(tag) != std::string::npos);
    }
  }
  TrainingArguments none;
  apply_training_flags(none, run_flags(dir, {"--max_steps", "2", "--output_dir", dir + "/plain",
                                             "--logging_dir", dir + "/tb"}));
  Trainer(none, comm).train();
  CHECK(event_files(dir + "/tb").empty());  // report_to none: nothing
  TrainingArguments all;
  apply_training_flags(all, run_flags(dir, {"--max_steps", "2", "--output_dir", dir + "/all",
                                            "--report_to", "all", "--logging_dir", dir + "/tb"}));
  Trainer(all, comm).train();
  CHECK(event_files(dir + "/tb").size() == 1);
}

// What the GPU session hands to the user's own tools (tests/tools/check_hf_outputs.py, with
// transformers, PEFT, tokenizers and tensorboard): models exported by full fine-tuning from
// each fixture family in either config spelling and from inline configs, with zerotrain's
// logits; a run's trainer_state.json and TensorBoard events; chat-format ids made with real
// tokenizer folders (ZT_REAL_TOKENIZERS, fetched by tests/tools/fetch_real_tokenizers.sh).
TEST_CASE("tool: write run outputs for the transformers checks", "[.tool]") {
  const char* out_env = std::getenv("ZT_OUT");
  REQUIRE(out_env != nullptr);
  const std::string out = out_env;
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string work = test::temp_dir("hf_outputs");
  std::string ids_data;
  for (int i = 0; i < 8; ++i)
    ids_data += fmt::format("{{\"input_ids\": [{}, 9, {}, 7, {}, 3]}}\n", 3 + i, 20 + i, 100 - i);
  files::write_atomic(work + "/ids.jsonl", ids_data);
  auto export_run = [&](const std::string& name, std::vector<std::string> model_flags) {
    std::vector<std::string> flags{"--train_file",
                                   work + "/ids.jsonl",
                                   "--output_dir",
                                   work + "/" + name,
                                   "--max_steps",
                                   "2",
                                   "--learning_rate",
                                   "0.01",
                                   "--per_device_train_batch_size",
                                   "2",
                                   "--bf16",
                                   "false"};
    flags.insert(flags.end(), model_flags.begin(), model_flags.end());
    TrainingArguments args;
    apply_training_flags(args, flags);
    Trainer(args, comm).train();
    const std::string dst = out + "/models/" + name;
    fs::create_directories(dst);
    for (const auto& e : fs::directory_iterator(work + "/" + name)) {
      const std::string f = e.path().filename().string();
      if (f == "config.json" || f.rfind("model", 0) == 0 || f == "generation_config.json")
        fs::copy_file(e.path(), dst + "/" + f);
    }
    ModelConfig c = load_model_config(dst);
    CausalLM m(c, at::TensorOptions(), false);
    load_weights(m, *checkpoint_source(dst));
    at::manual_seed(3);
    at::Tensor ids = at::randint(3, c.vocab_size, {2, 12}, at::kLong);
    at::NoGradGuard no_grad;
    save_safetensors(dst + "/zerotrain_logits.safetensors",
                     {{"input_ids", ids}, {"logits", m.logits(ids)}});
  };
  for (const char* family :
       {"llama", "llama_rope_llama3", "llama_rope_linear", "qwen2", "mistral", "qwen3",
        "mistral_head_dim", "phi3", "gemma2", "gemma3_text", "qwen3_rope_yarn", "llama_rope_yarn",
        "llama_rope_dynamic", "phi3_longrope", "phi3_longrope_long"}) {
    for (const char* config : {"config.json", "config_v4.json"}) {
      const std::string spelling = config == std::string("config.json") ? "v5" : "v4";
      const std::string model = work + "/in_" + family + "_" + spelling;
      fs::create_directories(model);
      fs::copy_file(std::string(ZT_FIXTURES) + "/models/" + family + "/model.safetensors",
                    model + "/model.safetensors");
      fs::copy_file(std::string(ZT_FIXTURES) + "/models/" + family + "/" + config,
                    model + "/config.json");
      export_run(fmt::format("{}_{}", family, spelling), {"--model_name_or_path", model});
    }
  }
  {  // Gemma 3 as published: a full fine-tune's folder, the vision tower carried along
    const std::string model = work + "/in_gemma3";
    fs::create_directories(model);
    for (const char* f : {"model.safetensors", "config.json"})
      fs::copy_file(std::string(ZT_FIXTURES) + "/models/gemma3/" + f, model + "/" + f);
    export_run("gemma3_v5", {"--model_name_or_path", model});
  }
  export_run("inline_qwen2",
             {"--model_config", R"({"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64,
      "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rope_theta": 1000000.0, "tie_word_embeddings": true})"});
  export_run("inline_llama3_rope", {"--model_config", R"({"model_type": "llama", "vocab_size": 128,
      "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
      "rope_theta": 500000.0, "max_position_embeddings": 128, "rope_scaling": {"rope_type": "llama3",
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})"});
  // The families of [1/7] from inline configs: config.json written by the family, not copied.
  const std::string tiny = R"("vocab_size": 128, "hidden_size": 64, "intermediate_size": 160,
      "num_attention_heads": 4, "num_key_value_heads": 2)";
  export_run(
      "inline_qwen3_yarn",
      {"--model_config",
       R"({"model_type": "qwen3", "head_dim": 32, )" + tiny +
           R"(, "num_hidden_layers": 2, "rope_theta": 1000000.0, "max_position_embeddings": 64,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}})"});
  export_run("inline_gemma2",
             {"--model_config", R"({"model_type": "gemma2", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 2, "query_pre_attn_scalar": 24,
      "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.5, "sliding_window": 4})"});
  export_run("inline_gemma3",
             {"--model_config", R"({"model_type": "gemma3_text", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 3,
      "query_pre_attn_scalar": 16, "sliding_window": 4, "sliding_window_pattern": 3,
      "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}})"});
  export_run(
      "inline_phi3_longrope",
      {"--model_config",
       R"({"model_type": "phi3", )" + tiny +
           R"(, "num_hidden_layers": 2, "partial_rotary_factor": 0.75, "max_position_embeddings": 64,
      "original_max_position_embeddings": 8, "rope_scaling": {"type": "longrope",
      "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [1.5, 1.7, 1.9, 2.1, 2.3, 2.5]}})"});
  export_run("inline_qwen3_moe",
             {"--model_config", R"({"model_type": "qwen3_moe", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 3, "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": false,
      "decoder_sparse_step": 1, "mlp_only_layers": [2]})"});
  export_run("inline_mixtral",
             {"--model_config", R"({"model_type": "mixtral", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 2, "num_local_experts": 4,
      "num_experts_per_tok": 2})"});
  export_run("inline_glm4_moe",
             {"--model_config", R"({"model_type": "glm4_moe", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 2, "n_routed_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2,
      "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
      "partial_rotary_factor": 0.5, "attention_bias": true})"});
  export_run("inline_gpt_oss",
             {"--model_config", R"({"model_type": "gpt_oss", "head_dim": 16, )" + tiny +
                                    R"(, "num_hidden_layers": 2, "num_local_experts": 4,
      "num_experts_per_tok": 2, "sliding_window": 4, "rope_theta": 150000.0,
      "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
      "truncate": false, "original_max_position_embeddings": 4096}})"});
  // A run's state and TensorBoard events.
  {
    write_data(work, "train.jsonl", 16, 17);
    write_data(work, "eval.jsonl", 4, 18);
    TrainingArguments args;
    apply_training_flags(
        args, run_flags(work, {"--output_dir", out + "/run", "--report_to", "tensorboard",
                               "--eval_file", work + "/eval.jsonl", "--eval_strategy", "steps",
                               "--eval_steps", "4", "--logging_dir", out + "/run/tb"}));
    Trainer(args, comm).train();
  }
  // Chat formats with real tokenizers: ids and labels for the conversations of the template tests.
  const char* real = std::getenv("ZT_REAL_TOKENIZERS");
  if (real == nullptr) return;
  const struct {
    const char* package;
    const char* templates;  // "auto", or the formats to check with this tokenizer
  } sets[] = {{"qwen3", "auto"},        {"qwen2_5", "auto qwen2"},
              {"llama3", "auto"},       {"llama3_1", "auto"},
              {"llama3_2", "auto"},     {"llama2", "llama2 mistral_v0.1 mistral_v0.2 mistral_v0.3"},
              {"gemma3", "auto"},       {"deepseek_v3", "auto"},
              {"mistral_nemo", "auto"}, {"gptoss", "auto"}};  // Jinja-rendered: their own templates
  const std::string conversations =
      R"({"messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"},)"
      R"( {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "What is 2+2?"},)"
      R"( {"role": "assistant", "content": "2+2 = 4."}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": " 你好，世界 "}, {"role": "assistant", "content": "  Hello, world!\n"}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "code?"}, {"role": "assistant", "content": "def f(x):\n    return x * 2  # ok"},)"
      R"( {"role": "user", "content": "again"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nsure"}]})"
      "\n";
  files::write_atomic(work + "/chat.jsonl", conversations);
  for (const auto& set : sets) {
    const std::string dir = std::string(real) + "/" + set.package;
    if (!fs::exists(dir + "/tokenizer.json")) continue;
    auto tok = load_tokenizer(dir, 1 << 30);
    std::istringstream names(set.templates);
    for (std::string name; names >> name;) {
      std::string source;
      const std::string resolved = resolve_template(name, dir, *tok, &source);
      DataOptions o;
      o.template_name = resolved;
      o.max_length = 4096;
      Dataset d;
      try {
        d = tokenize_jsonl(work + "/chat.jsonl", *tok, o);
      } catch (const ConfigError&) {
        continue;  // a format that refuses these conversations (Mistral v0.1/v0.2 and system
                   // messages)
      }
      std::string json =
          fmt::format(R"({{"package": "{}", "template": "{}", "asked": "{}", "examples": [)",
                      set.package, resolved, name);
      for (int64_t i = 0; i < d.size(); ++i) {
        json += fmt::format("{}{{\"ids\": [{}], \"labels\": [{}]}}", i ? ", " : "",
                            fmt::join(d.ids(i).to_vector(), ", "),
                            fmt::join(d.labels(i).to_vector(), ", "));
      }
      json += fmt::format(R"(], "prompt_ids": [{}]}})",
                          fmt::join(encode_prompt(resolved, *tok, "What is 2+2?"), ", "));
      fs::create_directories(out + "/chat");
      const bool folder = resolved.rfind("jinja:", 0) == 0;
      files::write_atomic(
          fmt::format("{}/chat/{}_{}.json", out, set.package, folder ? "jinja" : resolved), json);
    }
  }
  fs::copy_file(work + "/chat.jsonl", out + "/chat/conversations.jsonl",
                fs::copy_options::overwrite_existing);
}
