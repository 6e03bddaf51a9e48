// The Trainer end to end on real ranks (Gloo): exact resume at the same world size, resume at
// other world sizes with the global batch kept, what a run writes (logs, checkpoints, the final
// model), the output-folder rules, and errors for bad inputs.
#include "support/catch.hpp"

#include <cstdlib>
#include <tuple>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using zt::test::kTinyModel;
using zt::test::logged_losses;
using zt::test::write_data;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

// Flags of a run: the tiny model, the data in `dir`, and `extra` on top.
std::vector<std::string> run_flags(const std::string& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> f{"--model_config", kTinyModel,
                             "--train_file", dir + "/train.jsonl",
                             "--output_dir", dir + "/out",
                             "--template", "alpaca",
                             "--per_device_train_batch_size", "2",
                             "--learning_rate", "3e-3",
                             "--lr_scheduler_type", "linear",
                             "--max_steps", "8",
                             "--logging_steps", "1",
                             "--save_steps", "4",
                             "--seed", "5"};
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

std::string join_flags(const std::vector<std::string>& flags) {
  std::string s;
  for (const std::string& f : flags) s += f + '\x1f';
  return s;
}

std::vector<std::string> split_flags(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == '\x1f') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

void train_ranks(int world, const std::string& dir, const std::vector<std::string>& extra, int cancel_at = 0) {
  test::run_ranks(world, "rank: trainer run", std::chrono::seconds(240),
                  {{"ZT_FLAGS", join_flags(run_flags(dir, extra))}, {"ZT_CANCEL_AT", std::to_string(cancel_at)}});
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
    CHECK(r.global_step == args.max_steps);
  }
}

TEST_CASE("a run stopped and resumed gives the uninterrupted run's losses", "[trainer][checkpoint]") {
  if (test::skip_cpu_world(2)) return;
  const std::string whole = test::temp_dir("whole"), parts = test::temp_dir("parts");
  for (const std::string& d : {whole, parts}) write_data(d, "train.jsonl", 40, 1);
  // LoRA with dropout: the resumed run must also restore the random state.
  const std::vector<std::string> lora{"--finetuning_type", "lora", "--lora_r", "4", "--lora_dropout", "0.1",
                                      "--gradient_accumulation_steps", "2"};
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

TEST_CASE("updates inside backward train and resume as updates in step() do", "[trainer][checkpoint]") {
  // One rank, no clipping, no accumulation: the engine updates parameters during backward.
  const std::string in_step = test::temp_dir("in_step"), whole = test::temp_dir("in_bwd"),
                    parts = test::temp_dir("in_bwd_parts");
  for (const std::string& d : {in_step, whole, parts}) write_data(d, "train.jsonl", 40, 1);
  const std::vector<std::string> flags{"--max_grad_norm", "0", "--gradient_accumulation_steps", "1",
                                       "--weight_decay", "0.1"};
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
  for (const auto& [step, norm] : norms_in_step) CHECK(norms.at(step) == Approx(norm).epsilon(1e-5));
}

TEST_CASE("a run saved at 2 ranks resumes at 1 and 4 with the global batch kept", "[trainer][checkpoint]") {
  if (test::skip_cpu_world(4)) return;
  const std::string whole = test::temp_dir("whole_w"), saved = test::temp_dir("saved_w");
  for (const std::string& d : {whole, saved}) write_data(d, "train.jsonl", 40, 2);
  const std::vector<std::string> base{"--gradient_accumulation_steps", "2", "--deepspeed",
                                      R"({"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
                                         "gradient_accumulation_steps": "auto",
                                         "train_micro_batch_size_per_gpu": "auto"})"};
  train_ranks(2, whole, base);
  train_ranks(2, saved, base, /*cancel_at=*/5);
  const auto want = logged_losses(whole + "/out");
  for (int world : {1, 4}) {
    INFO("resumed at world " << world);
    const std::string dir = test::temp_dir("resumed_w");
    write_data(dir, "train.jsonl", 40, 2);
    fs::copy(saved + "/out", dir + "/out", fs::copy_options::recursive);
    // micro batch 2 × 2 ranks × accumulation 2 = 8; the resumed run picks its accumulation.
    std::vector<std::string> resume{"--resume_from_checkpoint", "True", "--deepspeed",
                                    R"({"zero_optimization": {"stage": 2}})"};
    train_ranks(world, dir, resume);
    const auto got = logged_losses(dir + "/out");
    for (int64_t step = 5; step <= 8; ++step) {
      INFO("step " << step);
      REQUIRE(got.count(step));
      CHECK(got.at(step) == Approx(want.at(step)).epsilon(1e-4));  // reduction order differs
    }
  }
}

TEST_CASE("a run writes logs, checkpoints a user can load, and the final model", "[trainer]") {
  const std::string dir = test::temp_dir("outputs");
  write_data(dir, "train.jsonl", 24, 3);
  write_data(dir, "eval.jsonl", 10, 4);
  auto comm = std::shared_ptr<Communicator>(test::join());
  SECTION("LoRA: adapter files in every checkpoint and in output_dir") {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--finetuning_type", "lora", "--eval_file", dir + "/eval.jsonl",
                                               "--eval_strategy", "steps", "--eval_steps", "4",
                                               "--save_total_limit", "1", "--load_best_model_at_end", "True"}));
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
    CHECK(files::read_text(out + "/latest") == fs::path(all.back().path).filename().string() + "\n");
    CHECK(r.best_checkpoint.has_value());
    // Logs: HF's keys in trainer_log.jsonl and trainer_state.json, a loss plot.
    const std::string log = files::read_text(out + "/trainer_log.jsonl");
    for (const char* key : {"\"step\"", "\"epoch\"", "\"loss\"", "\"learning_rate\"", "\"grad_norm\"",
                            "\"tokens_per_second\"", "\"eval_loss\""}) {
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
  CHECK_THROWS_WITH(attempt({"--deepspeed", R"({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})"}),
                    Contains("train_batch_size"));
  CHECK_THROWS_WITH(attempt({"--model_config", "", "--model_name_or_path", dir + "/no_model"}), Contains("no_model"));
  CHECK_THROWS_WITH(attempt({"--packing", "--finetuning_type", "prefix"}), Contains("packing"));
  CHECK_THROWS_WITH(attempt({"--model_config", R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})"}),
                    Contains("259"));
}

TEST_CASE("packed training runs and counts every example once per epoch", "[trainer][packing]") {
  const std::string dir = test::temp_dir("packed");
  write_data(dir, "train.jsonl", 32, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, {"--packing", "--max_length", "128", "--max_steps", "-1",
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
  const ModelConfig c = parse_model_config(kTinyModel);
  {
    CausalLM m(c, at::TensorOptions(), false);
    load_weights(m, *random_source(c, 11));
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : m.named_parameters()) tensors.emplace_back(p.key(), p.value());
    fs::create_directories(dir + "/base");
    save_sharded_safetensors(dir + "/base", tensors);
    files::write_atomic(dir + "/base/config.json", model_config_json(c));
  }
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  std::vector<std::string> flags = run_flags(dir, {"--finetuning_type", "lora", "--lora_r", "4",
                                                   "--lora_target_modules", "q_proj,v_proj,down_proj"});
  flags[0] = "--model_name_or_path";
  flags[1] = dir + "/base";
  apply_training_flags(args, flags);
  Trainer(args, comm).train();
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out/checkpoint-8", dir + "/merged", options);  // base from the adapter
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

TEST_CASE("ZeRO-3 saves 16-bit weights only when asked, and its checkpoints merge", "[trainer][checkpoint]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (bool gather : {false, true}) {
    INFO("stage3_gather_16bit_weights_on_model_save " << gather);
    const std::string dir = test::temp_dir("z3save");
    write_data(dir, "train.jsonl", 16, 9);
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--max_steps", "3", "--save_steps", "100", "--deepspeed",
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
  const int64_t rows = 8, micro = std::atoi(std::getenv("ZT_MICRO")), accum = rows / (micro * world);
  TrainingArguments args;
  apply_training_flags(args, {"--model_config", kTinyModel, "--output_dir", std::getenv("ZT_DIR"),
                              "--max_steps", "4", "--learning_rate", "0.01", "--adam_epsilon", "1e-4", "--seed", "3",
                              "--per_device_train_batch_size", std::to_string(micro),
                              "--gradient_accumulation_steps", std::to_string(accum), "--max_grad_norm", "0",
                              "--deepspeed",
                              fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", std::getenv("ZT_STAGE"))});
  Trainer trainer(args, comm);
  std::vector<double> norms;
  for (int64_t step = 0; step < 4; ++step) {
    at::manual_seed(100 + step);  // the same global batch on every rank and world size
    at::Tensor ids = at::randint(3, 250, {rows, 12}, at::kLong);
    at::Tensor labels = ids.clone();
    for (int64_t r = 0; r < rows; ++r) labels[r].narrow(0, 0, 1 + r % 5).fill_(-100);  // uneven counts
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

TEST_CASE("train_step gives the same steps whatever the world size, split and stage", "[trainer][equivalence]") {
  if (test::skip_cpu_world(4)) return;
  auto run = [](int world, int stage, int micro = 2) {
    const std::string dir = test::temp_dir("split");
    test::run_ranks(world, "rank: train_step on a split global batch", std::chrono::seconds(240),
                    {{"ZT_DIR", dir}, {"ZT_STAGE", std::to_string(stage)}, {"ZT_MICRO", std::to_string(micro)}});
    return dir;
  };
  auto norms_of = [](const std::string& dir) {
    std::vector<double> n;
    std::ifstream in(dir + "/norms.txt");
    for (double v; in >> v;) n.push_back(v);
    return n;
  };
  const std::string reference = run(1, 0);
  const std::vector<double> want = norms_of(reference);
  REQUIRE(want.size() == 4);
  SafetensorsCheckpoint want_model(reference + "/model");
  // The last run: the whole batch in one micro-step at one rank, where the engine updates
  // inside backward and train_step passes the exact token count instead of correcting later.
  for (auto [world, stage, micro] : {std::tuple{2, 3, 2}, std::tuple{4, 1, 2}, std::tuple{2, 2, 2}, std::tuple{1, 2, 8}}) {
    INFO("world " << world << " stage " << stage << " micro-batch " << micro);
    const std::string dir = run(world, stage, micro);
    const std::vector<double> got = norms_of(dir);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(2e-5));
    SafetensorsCheckpoint model(dir + "/model");
    for (const std::string& name : want_model.names()) {
      INFO(name);
      CHECK((model.load(name) - want_model.load(name)).abs().max().item<double>() < 2e-6);
    }
  }
}
