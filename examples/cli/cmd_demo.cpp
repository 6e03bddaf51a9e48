// zerotrain demo: the whole path a user takes, on a built-in tiny model and bundled data.
//
// It writes a synthetic instruction task whose answers can be checked (the parity and the last
// digit of a number; held-out numbers never appear in training), a tiny LLaMA config (byte-level
// tokenizer) and a ZeRO-2 DeepSpeed config with "auto" values into ./zerotrain-demo, measures
// the untrained model on the held-out prompts, runs `zerotrain train` as N ranks (one per GPU,
// else 2 CPU ranks) through the launcher, consolidates the last checkpoint with `merge`, and
// asks the merged model the held-out questions again:
//
//     accuracy: before 0.0% after 98.5%
//
// --stage dpo teaches it from preference pairs; --stage grpo from a reward alone: a short
// supervised warm-up teaches the answer's form (as GRPO starts from an instruct model), then
// GRPO with the built-in accuracy reward teaches the last-digit questions, measured before and
// after by that reward.
#include <ATen/Context.h>
#include <ftw.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>

#include "commands.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/grpo.hpp"
#include "zerotrain/launch.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::cli {
namespace fs = std::filesystem;
namespace {

constexpr const char* kMarker = ".zerotrain-demo";

// Removes an earlier demo's folder, depth first, removing links rather than following them
// (std::filesystem::remove_all is avoided: it crashed on the GPU machine's toolchain,
// docs/build.md).
void remove_demo_folder(const fs::path& dir) {
  auto remove_one = [](const char* path, const struct stat*, int, struct FTW*) {
    return std::remove(path) == 0 ? 0 : -1;
  };
  if (::nftw(dir.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    throw IoError("cannot remove the earlier demo folder '" + dir.string() +
                  "'; remove it yourself or pass --output_dir NEW_DIR");
  }
}

const char* kModelConfig = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"],
  "vocab_size": 259, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
  "bos_token_id": 256, "eos_token_id": 257, "initializer_range": 0.02, "torch_dtype": "float32"
})";

// ZeRO-2 with "auto" values, as HF users write their configs.
const char* kDeepSpeedConfig = R"({
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true,
                        "reduce_bucket_size": "auto", "allgather_bucket_size": 200000000}
})";

struct Question {
  std::string instruction, answer;
};

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Numbers ≡ 3 (mod 7) are held out: the model must generalize to them, not remember them.
// `digits_only`: last-digit questions alone (GRPO's accuracy reward compares numbers).
std::vector<Question> make_questions(uint64_t seed, int count, bool held_out,
                                     bool digits_only = false) {
  std::vector<Question> out;
  uint64_t state = seed;
  while (static_cast<int>(out.size()) < count) {
    const uint64_t n = splitmix(state) % 100000;
    if ((n % 7 == 3) != held_out) continue;
    if (splitmix(state) % 2 == 0 && !digits_only) {
      out.push_back({"Is " + std::to_string(n) + " even or odd?", n % 2 == 0 ? "even" : "odd"});
    } else {
      out.push_back(
          {"What is the last digit of " + std::to_string(n) + "?", std::to_string(n % 10)});
    }
  }
  return out;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw IoError("cannot write '" + path.string() + "'");
}

// A JSON-lines file of `row(question)` per question.
template <typename Row>
void write_rows(const fs::path& path, const std::vector<Question>& questions, Row row) {
  std::string text;
  for (const Question& q : questions) text += row(q) + "\n";
  write_file(path, text);
}

void write_jsonl(const fs::path& path, const std::vector<Question>& questions) {
  write_rows(path, questions, [](const Question& q) {
    return "{\"instruction\": " + json_string(q.instruction) +
           ", \"input\": \"\", \"output\": " + json_string(q.answer) + "}";
  });
}

// GRPO's prompts in TRL's conversational form, the answer as a column for the reward.
void write_prompts(const fs::path& path, const std::vector<Question>& questions) {
  write_rows(path, questions, [](const Question& q) {
    return "{\"prompt\": [{\"role\": \"user\", \"content\": " + json_string(q.instruction) +
           "}], \"answer\": " + json_string(q.answer) + "}";
  });
}

// The preference variant's pairs: the right answer chosen, a wrong one rejected (the other
// parity; another digit).
void write_pairs(const fs::path& path, const std::vector<Question>& questions) {
  std::string text;
  for (size_t i = 0; i < questions.size(); ++i) {
    const Question& q = questions[i];
    std::string wrong;
    if (q.answer == "even" || q.answer == "odd") {
      wrong = q.answer == "even" ? "odd" : "even";
    } else {
      wrong = std::to_string((std::stoi(q.answer) + 1 + static_cast<int>(i % 9)) % 10);
    }
    text += "{\"instruction\": " + json_string(q.instruction) +
            ", \"input\": \"\", \"chosen\": " + json_string(q.answer) +
            ", \"rejected\": " + json_string(wrong) + "}\n";
  }
  write_file(path, text);
}

// The share of held-out pairs whose right answer the model finds more likely than the wrong
// one, the pairs tokenized as training tokenizes them.
double preference_accuracy(CausalLM& model, const Tokenizer& tok, const fs::path& pairs_file,
                           bool show) {
  DataOptions o;
  o.preference = true;
  o.template_name = "alpaca";
  o.max_length = 256;
  const Dataset pairs = tokenize_preference_jsonl(pairs_file.string(), tok, o);
  const std::vector<std::pair<double, double>> scores =
      pair_log_probs(model, pairs, std::max(0, tok.eos_id()));
  int right = 0;
  for (const auto& [chosen, rejected] : scores) right += chosen > rejected;
  if (show) {
    for (size_t i = 0; i < std::min<size_t>(3, scores.size()); ++i) {
      std::printf("  pair %zu: log p(right) %.2f, log p(wrong) %.2f (%s)\n", i, scores[i].first,
                  scores[i].second, scores[i].first > scores[i].second ? "right" : "wrong");
    }
  }
  return 100.0 * right / static_cast<double>(std::max<size_t>(1, scores.size()));
}

// The share of questions the model answers exactly (greedy, up to its end token); with
// `reward`, the share the built-in accuracy reward scores 1 (GRPO's: the last number).
double accuracy(CausalLM& model, const Tokenizer& tok, const std::vector<Question>& questions,
                bool show, bool reward = false) {
  const RewardFunction scorer = builtin_reward("accuracy");
  at::NoGradGuard no_grad;
  model.eval();
  int right = 0, shown = 0;
  for (const Question& q : questions) {
    std::vector<int32_t> ids = tok.encode(render_prompt("alpaca", q.instruction));
    const std::vector<int32_t> prefix = tok.prefix_ids();
    ids.insert(ids.begin(), prefix.begin(), prefix.end());
    GenerationOptions g;
    g.max_new_tokens = 8;
    g.eos_token_ids = {tok.eos_id()};
    at::Tensor input =
        at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::kLong).unsqueeze(0);
    at::Tensor out = model.generate(input, g)[0].contiguous();
    std::string answer = tok.decode(
        std::vector<int32_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel()));
    bool ok = answer == q.answer;
    if (reward) {
      RewardInput r;
      r.completion = answer;
      r.columns["answer"] = q.answer;
      ok = scorer.fn({r}).front().value_or(0.0) == 1.0;
    }
    right += ok;
    if (show && shown < 3) {
      std::printf("  %-40s -> %-8s (%s)\n", q.instruction.c_str(), ("\"" + answer + "\"").c_str(),
                  ok ? "right" : "wrong");
      ++shown;
    }
  }
  return 100.0 * right / static_cast<double>(questions.size());
}

// Runs `zerotrain train ARGS` as `nproc` local ranks, then consolidates its checkpoint-STEPS
// into `merged` (an adapter folded into `base`) and loads it; null (after logging why) when
// training fails.
std::unique_ptr<CausalLM> train_and_merge(const Args& train, int nproc, const fs::path& run,
                                          const std::string& steps, const fs::path& merged,
                                          const std::string& base = "") {
  LocalLaunchOptions launch;
  launch.nproc = nproc;
  launch.env = {{"OMP_NUM_THREADS", "1"}};
  LaunchResult result = launch_local(train, launch);
  if (!result.ok()) {
    log_message(LogLevel::kError, "demo: training failed\n" + result.summary());
    return nullptr;
  }
  const std::string checkpoint = (run / ("checkpoint-" + steps)).string();
  MergeOptions merging;
  merging.base_model = base;  // an adapter folds into it
  merge_checkpoint(checkpoint, merged.string(), merging);
  auto model = std::make_unique<CausalLM>(load_model_config(merged.string()), at::TensorOptions(),
                                          /*allocate=*/false);
  load_weights(*model, *checkpoint_source(merged.string()));
  std::printf("merged %s into %s\n", checkpoint.c_str(), merged.c_str());
  return model;
}

// --stage grpo: a supervised warm-up on last-digit questions (the answer's form), then GRPO from
// the accuracy reward alone over other last-digit prompts; accuracy by that reward before GRPO
// (after the warm-up) and after.
int demo_grpo(const fs::path& dir, int nproc, const std::string& steps, uint64_t seed) {
  const std::vector<Question> held_out = make_questions(3, 200, true, true);
  write_jsonl(dir / "warmup.jsonl", make_questions(1, 2000, false, true));
  write_prompts(dir / "prompts.jsonl", make_questions(5, 4000, false, true));
  write_file(dir / "model_config.json", kModelConfig);
  write_file(dir / "ds_config.json", kDeepSpeedConfig);
  const std::shared_ptr<Tokenizer> tok = byte_tokenizer();
  std::printf(
      "zerotrain demo: %d %s rank(s), tiny LLaMA (2 layers, byte tokenizer), ZeRO-2, a short "
      "supervised warm-up, then GRPO from the accuracy reward alone, in %s\n",
      nproc, at::getNumGPUs() > 0 ? "GPU" : "CPU", dir.c_str());
  std::fflush(stdout);
  const int per_rank = 32 / std::min(nproc, 4);
  const std::string warm_steps = "40";
  const auto common = [&](const fs::path& out, const std::string& max_steps) {
    return Args{"--deepspeed",
                (dir / "ds_config.json").string(),
                "--output_dir",
                out.string(),
                "--template",
                "alpaca",
                "--max_steps",
                max_steps,
                "--save_steps",
                max_steps,
                "--per_device_train_batch_size",
                std::to_string(per_rank),
                "--gradient_accumulation_steps",
                "1",
                "--logging_steps",
                "10",
                "--seed",
                std::to_string(seed)};
  };
  Args warm{self_path(),           "train",
            "--model_config",      (dir / "model_config.json").string(),
            "--train_file",        (dir / "warmup.jsonl").string(),
            "--learning_rate",     "2e-3",
            "--lr_scheduler_type", "constant"};
  const Args warm_common = common(dir / "warmup", warm_steps);
  warm.insert(warm.end(), warm_common.begin(), warm_common.end());
  std::unique_ptr<CausalLM> start =
      train_and_merge(warm, nproc, dir / "warmup", warm_steps, dir / "start");
  if (!start) return 1;
  const double before = accuracy(*start, *tok, held_out, false, /*reward=*/true);
  std::printf("after the %s-step warm-up: %.1f%% of held-out questions right; GRPO now\n",
              warm_steps.c_str(), before);
  std::fflush(stdout);
  start.reset();

  Args grpo{self_path(),
            "train",
            "--model_name_or_path",
            (dir / "start").string(),
            "--stage",
            "grpo",
            "--train_file",
            (dir / "prompts.jsonl").string(),
            "--reward_funcs",
            "accuracy",
            "--num_generations",
            "8",
            "--max_completion_length",
            "4",
            "--learning_rate",
            "1e-3",
            "--lr_scheduler_type",
            "constant",
            "--max_grad_norm",
            "1.0"};
  const Args grpo_common = common(dir / "run", steps);
  grpo.insert(grpo.end(), grpo_common.begin(), grpo_common.end());
  std::unique_ptr<CausalLM> trained =
      train_and_merge(grpo, nproc, dir / "run", steps, dir / "merged");
  if (!trained) return 1;
  std::printf("held-out questions:\n");
  const double after = accuracy(*trained, *tok, held_out, true, /*reward=*/true);
  std::printf("accuracy: before %.1f%% after %.1f%%\n", before, after);
  if (after > before + 20.0) return 0;
  log_message(LogLevel::kError,
              fmt::format("demo: GRPO did not teach the task ({:.1f}% after, {:.1f}% before; the "
                          "demo expects a gain above 20 points). Train longer with --max_steps "
                          "(now {}), or look at the reward in '{}/trainer_log.jsonl'",
                          after, before, steps, (dir / "run").string()));
  return 1;
}

}  // namespace

int cmd_demo(const Args& in) {
  if (wants_help(in)) {
    std::fputs(
        "usage: zerotrain demo [--nproc_per_node N] [--output_dir DIR] [--max_steps S] [--stage "
        "dpo|grpo]\n"
        "                      [--finetuning_type full|lora] [--quantization_bit 4] [--use_dora "
        "true]\n\n"
        "Fine-tunes a built-in tiny LLaMA on a bundled synthetic instruction task with ZeRO-2 (one "
        "rank per\n"
        "GPU, else 2 CPU ranks), merges the last checkpoint, asks the merged model held-out "
        "questions and\n"
        "prints `accuracy: before X% after Y%`. Everything goes into DIR [default: "
        "./zerotrain-demo].\n"
        "With lora (or --quantization_bit 4: QLoRA over the base quantized to NF4; --use_dora: "
        "DoRA) the\n"
        "random base is written to DIR/base and LoRA r 32 on every projection trains, with the "
        "embeddings and\n"
        "the output layer (lora_modules_to_save).\n"
        "With --stage dpo the task comes as preference pairs (the right answer chosen, a wrong "
        "one rejected)\n"
        "and the demo prints the share of held-out pairs whose right answer the model prefers, "
        "before and\n"
        "after (full fine-tuning: the reference's log-probs computed before training).\n"
        "With --stage grpo a 40-step supervised warm-up on last-digit questions teaches the "
        "answer's form,\n"
        "then GRPO (--max_steps, default 200) learns the task from the built-in accuracy reward "
        "alone;\n"
        "the demo prints the reward's accuracy on held-out questions before GRPO and after.\n",
        stdout);
    return 0;
  }
  Args args = in;
  const int gpus = static_cast<int>(at::getNumGPUs());
  const int nproc = static_cast<int>(parse_integer(
      "nproc_per_node",
      take_option(args, "nproc_per_node").value_or(std::to_string(gpus > 0 ? gpus : 2)), 1, 1024));
  const fs::path dir = fs::absolute(take_option(args, "output_dir").value_or("zerotrain-demo"));
  const std::string stage = take_option(args, "stage").value_or("sft");
  const std::string steps =
      take_option(args, "max_steps").value_or(stage == "grpo" ? "200" : "300");
  parse_integer("max_steps", steps, 1, 1L << 30);
  // The adapter variants: LoRA, QLoRA (4-bit base), DoRA — over a random base written to a folder
  // (an adapter needs a base model folder to merge into).
  const std::string method = take_option(args, "finetuning_type").value_or("full");
  const std::optional<std::string> bits = take_option(args, "quantization_bit");
  const std::optional<std::string> dora = take_option(args, "use_dora");
  if (stage != "sft" && stage != "dpo" && stage != "grpo") {
    throw ConfigError("zerotrain demo: --stage is sft, dpo or grpo, not '" + stage + "'");
  }
  const bool dpo = stage == "dpo";
  if (method != "full" && method != "lora") {
    throw ConfigError("zerotrain demo: --finetuning_type is full or lora, not '" + method + "'");
  }
  if (bits && *bits != "4") throw ConfigError("zerotrain demo: --quantization_bit takes 4");
  if (dora && *dora != "true" && *dora != "false") {
    throw ConfigError("zerotrain demo: --use_dora takes true or false");
  }
  const bool adapter = method == "lora" || bits || (dora && *dora == "true");
  if (stage == "grpo" && adapter) {
    throw ConfigError(
        "zerotrain demo: --stage grpo runs full fine-tuning; drop "
        "--finetuning_type, --quantization_bit and --use_dora");
  }
  if (!args.empty()) throw ConfigError("zerotrain demo: unexpected argument '" + args[0] + "'");
  if (nproc < 1) throw ConfigError("--nproc_per_node must be at least 1");
  // Start clean, but only ever remove a folder an earlier demo made.
  if (fs::exists(dir)) {
    if (!fs::exists(dir / kMarker)) {
      throw ConfigError("'" + dir.string() +
                        "' exists and was not made by the demo; pass --output_dir NEW_DIR");
    }
    remove_demo_folder(dir);
  }
  fs::create_directories(dir);
  write_file(dir / kMarker, "made by `zerotrain demo`; removed by the next one\n");
  if (stage == "grpo") return demo_grpo(dir, nproc, steps, 42);
  const std::vector<Question> held_out = make_questions(3, 200, true);
  if (dpo) {
    write_pairs(dir / "train.jsonl", make_questions(1, 6000, false));
    write_pairs(dir / "eval.jsonl", make_questions(2, 200, true));
    write_pairs(dir / "held_out.jsonl", held_out);
  } else {
    write_jsonl(dir / "train.jsonl", make_questions(1, 6000, false));
    write_jsonl(dir / "eval.jsonl", make_questions(2, 200, true));
  }
  write_file(dir / "model_config.json", kModelConfig);
  write_file(dir / "ds_config.json", kDeepSpeedConfig);

  std::shared_ptr<Tokenizer> tok = byte_tokenizer();
  ModelConfig config = parse_model_config(kModelConfig, "demo model");
  const uint64_t seed = 42;
  double before = 0.0;
  {
    CausalLM untrained(config, at::TensorOptions(), /*allocate=*/false);
    load_weights(untrained, *random_source(config, seed));  // what training starts from
    before = dpo ? preference_accuracy(untrained, *tok, dir / "held_out.jsonl", false)
                 : accuracy(untrained, *tok, held_out, false);
    if (adapter) export_merged(untrained, (dir / "base").string(), at::kFloat);
  }
  std::printf(
      "zerotrain demo: %d %s rank(s), tiny LLaMA (2 layers, byte tokenizer), ZeRO-2, %s%s, in "
      "%s\n",
      nproc, gpus > 0 ? "GPU" : "CPU", dpo ? "DPO, " : "",
      !adapter ? "full fine-tuning"
      : bits   ? (dora && *dora == "true" ? "DoRA over a 4-bit base" : "QLoRA (4-bit base)")
      : dora && *dora == "true" ? "DoRA"
                                : "LoRA",
      dir.c_str());
  std::fflush(stdout);

  const fs::path run = dir / "run";
  Args train{self_path(),
             "train",
             adapter ? "--model_name_or_path" : "--model_config",
             adapter ? (dir / "base").string() : (dir / "model_config.json").string(),
             "--deepspeed",
             (dir / "ds_config.json").string(),
             "--train_file",
             (dir / "train.jsonl").string(),
             "--eval_file",
             (dir / "eval.jsonl").string(),
             "--output_dir",
             run.string(),
             "--template",
             "alpaca",
             "--max_steps",
             steps,
             "--per_device_train_batch_size",
             std::to_string(32 / std::min(nproc, 4)),
             "--gradient_accumulation_steps",
             "1",
             "--learning_rate",
             "2e-3",
             "--lr_scheduler_type",
             "cosine",
             "--warmup_ratio",
             "0.05",
             "--weight_decay",
             "0.01",
             "--logging_steps",
             "50",
             "--eval_strategy",
             "steps",
             "--eval_steps",
             "100",
             "--save_steps",
             steps,
             "--seed",
             std::to_string(seed)};
  if (dpo) train.insert(train.end(), {"--stage", "dpo", "--pref_beta", "0.5"});
  if (adapter) {
    train.insert(train.end(), {"--finetuning_type", "lora", "--lora_r", "32", "--lora_alpha", "64",
                               "--lora_target_modules", "all-linear", "--lora_modules_to_save",
                               "embed_tokens,lm_head"});
    if (bits) train.insert(train.end(), {"--quantization_bit", *bits});
    if (dora) train.insert(train.end(), {"--use_dora", *dora});
  }
  // The checkpoint's shards, consolidated as `zerotrain merge` does, then asked again (an
  // adapter folds into its base).
  std::unique_ptr<CausalLM> trained = train_and_merge(train, nproc, run, steps, dir / "merged",
                                                      adapter ? (dir / "base").string() : "");
  if (!trained) return 1;
  std::printf("held-out questions:\n");
  const double after = dpo ? preference_accuracy(*trained, *tok, dir / "held_out.jsonl", true)
                           : accuracy(*trained, *tok, held_out, true);
  // A preference run starts near chance (50 %): a gain above 30 points is the task learned.
  const double gain = dpo ? 30.0 : 50.0;
  std::printf("%s: before %.1f%% after %.1f%%\n", dpo ? "prefers the right answer" : "accuracy",
              before, after);
  if (after > before + gain) return 0;
  log_message(LogLevel::kError,
              fmt::format("demo: training did not teach the task ({:.1f}% after, {:.1f}% before; "
                          "the demo expects a gain above {:.0f} points). Train longer with "
                          "--max_steps (now {}), or look at the loss in '{}/trainer_log.jsonl'",
                          after, before, gain, steps, run.string()));
  return 1;
}

}  // namespace zt::cli
