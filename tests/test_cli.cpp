// The `zerotrain` program as users meet it: --help lists every option with its default, exit
// statuses (0 / 2 configuration / 1 other / 130 cancelled), one `error: ...` line per failing
// process, and `launch` passing on the first failing rank's status.
#include "support/catch.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>

#include "support/faults.hpp"
#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

using Catch::Contains;
using Catch::Matches;
namespace fs = std::filesystem;

namespace {

struct Ran {
  int status = -1;
  std::string output;  ///< stdout and stderr together
};

// Runs a shell command line and collects what it printed.
Ran shell(const std::string& command) {
  Ran r;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf;
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int raw = ::pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

// Runs the CLI through the shell with `args` (already quoted).
Ran cli(const std::string& args) {
  return shell(fmt::format("'{}' {} 2>&1", ZT_CLI, args));
}

int count_lines_starting(const std::string& text, const std::string& prefix) {
  int n = 0;
  size_t at = 0;
  while (at < text.size()) {
    if (text.compare(at, prefix.size(), prefix) == 0) ++n;
    at = text.find('\n', at);
    if (at == std::string::npos) break;
    ++at;
  }
  return n;
}

}  // namespace

TEST_CASE("train --help lists every option with its default", "[cli]") {
  Ran r = cli("train --help");
  CHECK(r.status == 0);
  for (const zt::OptionHelp& o : zt::training_option_help()) {
    INFO(o.name);
    CHECK_THAT(r.output, Contains("--" + o.name));
    if (!o.default_value.empty())
      CHECK_THAT(r.output, Contains("[default: " + o.default_value + "]"));
  }
}

TEST_CASE("exit statuses and one error line", "[cli][errors]") {
  const std::string dir = zt::test::temp_dir("cli");
  SECTION("a configuration error exits 2") {
    Ran r = cli("train --lerning_rate 1e-4");
    CHECK(r.status == 2);
    CHECK_THAT(r.output,
               Contains("error: unknown option --lerning_rate") && Contains("learning_rate"));
    CHECK(count_lines_starting(r.output, "error: ") == 1);
  }
  SECTION("the peers' spellings get the option to use instead") {
    for (const auto& [peer, ours] : {std::pair<const char*, const char*>{"data_path", "train_file"},
                                     {"model_path", "model_name_or_path"},
                                     {"epochs", "num_train_epochs"}}) {
      Ran r = cli(fmt::format("train --{} x", peer));
      CHECK(r.status == 2);
      CHECK_THAT(r.output, Contains(fmt::format("unknown option --{}", peer)) &&
                               Contains(fmt::format("did you mean '{}'", ours)));
    }
  }
  SECTION("a hub id is not a folder: download it first") {
    Ran r =
        cli(fmt::format("train --model_name_or_path Qwen/Qwen2.5-7B --train_file x.jsonl "
                        "--output_dir '{}/o'",
                        dir));
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Contains("'Qwen/Qwen2.5-7B'") && Contains("hub id") &&
                             Contains("huggingface-cli download Qwen/Qwen2.5-7B"));
  }
  SECTION("launch names a program it cannot start") {
    Ran r = cli("launch --nproc_per_node 1 -- zerotrian train");
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Contains("cannot execute 'zerotrian'"));
  }
  SECTION("a missing file exits 1 and names it") {
    Ran r = cli(fmt::format(
        "train --model_name_or_path '{}/no_such_model' --train_file x.jsonl --output_dir '{}/o'",
        dir, dir));
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Contains("no_such_model"));
    CHECK(count_lines_starting(r.output, "error: ") == 1);
  }
  SECTION("merge of something that is not a checkpoint exits 1") {
    Ran r = cli(fmt::format("merge '{}' '{}/out'", dir, dir));
    CHECK(r.status == 1);
    CHECK_THAT(r.output, Contains("error: ") && Contains("layout.json"));
  }
  SECTION("launch exits with the first failing rank's status") {
    if (zt::test::skip_cpu_world(2)) return;
    // Rank 0 fails first (rank 1 waits), so its status is the launcher's whatever the load.
    Ran r =
        cli("launch --nproc_per_node 2 -- sh -c '[ $RANK = 1 ] && sleep 2; exit $((RANK + 3))'");
    CHECK(r.status == 3);
    Ran later =
        cli("launch --nproc_per_node 2 -- sh -c '[ $RANK = 0 ] && sleep 2; exit $((RANK + 3))'");
    CHECK(later.status == 4);
    // deepspeed's launcher flags: --num_gpus, --include (CUDA_VISIBLE_DEVICES set to its GPUs,
    // one rank each), --master_port; refused where they cannot mean what deepspeed does.
    Ran ds =
        cli("launch --master_port 29611 --include localhost:1,3 sh -c 'echo rank=$LOCAL_RANK "
            "of=$WORLD_SIZE dev=$CUDA_VISIBLE_DEVICES port=$MASTER_PORT'");
    CHECK(ds.status == 0);
    CHECK_THAT(ds.output, Contains("rank=0 of=2 dev=1,3 port=29611") &&
                              Contains("rank=1 of=2 dev=1,3 port=29611"));
    Ran gpus = cli("launch --num_gpus 2 -- sh -c 'echo world=$WORLD_SIZE'");
    CHECK(count_lines_starting(gpus.output, "world=2") == 2);
    CHECK_THAT(cli("launch --include other-host:0 -- true").output, Contains("not this machine"));
    CHECK_THAT(cli("launch --include localhost:0@b:1 -- true").output, Contains("one machine"));
    CHECK_THAT(cli("launch --include localhost:0 --num_gpus 2 -- true").output,
               Contains("--include already says"));
    CHECK_THAT(cli("launch --num_nodes 2 -- true").output, Contains("one machine"));
    CHECK(cli("launch --include localhost:0,0 -- true").status == 2);
    Ran bad = cli(fmt::format("launch --nproc_per_node 2 -- '{}' train --bogus 1", ZT_CLI));
    CHECK(bad.status == 2);
    CHECK(count_lines_starting(bad.output, "error: rank 0: ") == 1);
    CHECK(count_lines_starting(bad.output, "error: rank 1: ") == 1);
  }
}

namespace {

// A one-layer random model folder (config.json + safetensors) for verify.
void write_random_model(const std::string& dir) {
  zt::test::write_model_folder(
      dir,
      R"({"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128})",
      1);
}

// `count` preference pairs any model can learn (" good" over " bad") in dir/pairs.jsonl.
void write_rating_pairs(const std::string& dir, int count) {
  std::string pairs;
  for (int i = 0; i < count; ++i) {
    pairs += fmt::format(R"({{"prompt": "Rate answer {}:", "chosen": " good", "rejected": " bad"}})"
                         "\n",
                         i);
  }
  zt::files::write_atomic(dir + "/pairs.jsonl", pairs);
}

}  // namespace

TEST_CASE("verify loads a model folder and answers a prompt in the training template", "[cli]") {
  const std::string dir = zt::test::temp_dir("verify");
  write_random_model(dir);
  Ran r = cli(fmt::format("verify '{}' --prompt 'Is 7 odd?' --max_new_tokens 4", dir));
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("### 指令：Is 7 odd?\n### 回答："));
  Ran raw = cli(fmt::format("verify '{}' --prompt 'plain text' --raw --max_new_tokens 2", dir));
  CHECK(raw.status == 0);
  CHECK_THAT(raw.output, Contains("plain text"));
  CHECK_FALSE(raw.output.find("###") != std::string::npos);
  Ran missing = cli(fmt::format("verify '{}'", dir));
  CHECK(missing.status == 2);
  CHECK_THAT(missing.output, Contains("--prompt"));
}

TEST_CASE("every subcommand answers --help with its usage and exit 0", "[cli]") {
  for (const char* command : {"train", "merge", "verify", "generate", "launch", "config", "demo"}) {
    INFO(command);
    Ran r = cli(std::string(command) + " --help");
    CHECK(r.status == 0);
    CHECK_THAT(r.output, Contains(std::string("usage: zerotrain ") + command));
    CHECK(count_lines_starting(r.output, "error: ") == 0);
  }
  CHECK(cli("--help").status == 0);
  // A --help after launch's command belongs to that command.
  Ran inner = cli("launch --nproc_per_node 1 -- sh -c 'echo ran: $1' sh --help");
  CHECK(inner.status == 0);
  CHECK_THAT(inner.output, Contains("ran: --help"));
}

TEST_CASE("train without --train_file says so before anything else", "[cli][errors]") {
  Ran r = cli("train --model_name_or_path /nonexistent/model --output_dir /nonexistent/out");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Contains("--train_file"));
  CHECK(r.output.find("/nonexistent/model") == std::string::npos);
}

TEST_CASE("verify asks in the template the run recorded", "[cli]") {
  const std::string dir = zt::test::temp_dir("verify_recorded");
  write_random_model(dir);
  zt::record_template(dir, "alpaca");
  Ran r = cli(fmt::format("verify '{}' --prompt 'Is 7 odd?' --max_new_tokens 2", dir));
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("### Instruction:\nIs 7 odd?\n\n### Response:\n"));
  Ran chosen =
      cli(fmt::format("verify '{}' --prompt 'Is 7 odd?' --template plain --max_new_tokens 2", dir));
  CHECK(chosen.status == 0);
  CHECK(chosen.output.find("###") == std::string::npos);
}

namespace {

// The JSON lines of `path`, parsed.
std::vector<rapidjson::Document> json_lines(const std::string& path) {
  std::vector<rapidjson::Document> rows;
  std::istringstream lines(zt::files::read_text(path));
  for (std::string line; std::getline(lines, line);) {
    rows.emplace_back();
    // Well-formed UTF-8 too: what Python's json.loads or any strict reader needs.
    rows.back().Parse<rapidjson::kParseValidateEncodingFlag>(line.c_str());
    REQUIRE_FALSE(rows.back().HasParseError());
  }
  return rows;
}

}  // namespace

TEST_CASE("generate writes samples of many prompts as JSON lines, the same whatever the batch",
          "[cli][generate]") {
  const std::string dir = zt::test::temp_dir("generate_cli");
  write_random_model(dir);
  zt::files::write_atomic(
      dir + "/prompts.jsonl",
      "{\"prompt\": \"Is 7 odd?\", \"answer\": \"odd\"}\n"
      "{\"prompt\": [{\"role\": \"user\", \"content\": \"Is 8 odd?\"}], \"answer\": \"even\"}\n"
      "\n"
      "{\"prompt\": \"Q: 1 + 2 =\", \"level\": 3}\n");
  const std::string common = fmt::format(
      "generate '{0}' --prompts '{0}/prompts.jsonl' --num_return_sequences 3 --max_new_tokens 6 "
      "--temperature 1.3 --seed 4 --device cpu",
      dir);
  Ran r = cli(fmt::format("{} --output '{}/a.jsonl' --batch_size 2", common, dir));
  REQUIRE(r.status == 0);
  const auto rows = json_lines(dir + "/a.jsonl");
  REQUIRE(rows.size() == 9);
  std::set<std::string> completions;
  for (size_t i = 0; i < rows.size(); ++i) {
    INFO("line " << i);
    CHECK(rows[i]["prompt_index"].GetInt() == static_cast<int>(i / 3));
    CHECK(rows[i]["sample"].GetInt() == static_cast<int>(i % 3));
    const std::string reason = rows[i]["finish_reason"].GetString();
    CHECK((reason == "stop" || reason == "length"));
    CHECK(rows[i]["completion_tokens"].GetInt() <= 6);
    if (reason == "length") CHECK(rows[i]["completion_tokens"].GetInt() == 6);
    completions.insert(rows[i]["completion"].GetString());
  }
  CHECK(completions.size() > 3);  // samples differ
  // Other columns pass through; text prompts as they are, messages through the template.
  CHECK(std::string(rows[0]["answer"].GetString()) == "odd");
  CHECK(std::string(rows[6]["level"].GetString()) == "3");
  CHECK(std::string(rows[0]["prompt"].GetString()) == "Is 7 odd?");
  CHECK_THAT(rows[3]["prompt"].GetString(), Contains("Is 8 odd?") && Contains("###"));
  // One prompt at a time, or all at once: the same file (a completion's draws are its own).
  REQUIRE(cli(fmt::format("{} --output '{}/b.jsonl' --batch_size 1", common, dir)).status == 0);
  CHECK(zt::files::read_text(dir + "/b.jsonl") == zt::files::read_text(dir + "/a.jsonl"));
  // Stop strings (every printable ASCII character but the quotes and '\\'): a completion ends
  // at the token that completes one, kept in the text, with finish_reason stop.
  std::string list = "[", printable;
  for (char ch = 0x20; ch < 0x7f; ++ch) {
    if (ch == '"' || ch == '\\' || ch == '\'') continue;
    list += fmt::format("{}\"{}\"", list.size() > 1 ? ", " : "", ch);
    printable += ch;
  }
  list += "]";
  REQUIRE(
      cli(fmt::format("{} --output '{}/s.jsonl' --stop_strings '{}'", common, dir, list)).status ==
      0);
  int ended_by_string = 0;
  for (const auto& row : json_lines(dir + "/s.jsonl")) {
    const std::string c = row["completion"].GetString();
    const size_t hit = c.find_first_of(printable);
    INFO(c);
    CHECK((hit == std::string::npos ||
           (hit == c.size() - 1 && std::string(row["finish_reason"].GetString()) == "stop")));
    ended_by_string += hit != std::string::npos;
  }
  CHECK(ended_by_string > 0);
  // Another seed, other samples.
  Ran other = cli(fmt::format("{} --seed 5", common));
  REQUIRE(other.status == 0);
  CHECK(other.output != zt::files::read_text(dir + "/a.jsonl"));
  // Greedy: every sample of a prompt alike, and verify's reply to the same prompt.
  Ran greedy = cli(
      fmt::format("generate '{}' --prompt 'Is 7 odd?' --do_sample false --num_return_sequences 2 "
                  "--max_new_tokens 4 --device cpu",
                  dir));
  REQUIRE(greedy.status == 0);
  std::istringstream lines(greedy.output);
  std::vector<rapidjson::Document> answers;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    answers.emplace_back();
    answers.back().Parse(line.c_str());
  }
  REQUIRE(answers.size() == 2);
  const std::string reply = answers[0]["completion"].GetString();
  CHECK(reply == answers[1]["completion"].GetString());
  Ran verify = cli(fmt::format("verify '{}' --prompt 'Is 7 odd?' --max_new_tokens 4", dir));
  REQUIRE(verify.status == 0);
  // verify prints the bytes as decoded; generate writes U+FFFD for ill-formed UTF-8: compare
  // up to the first replacement.
  const std::string well_formed = reply.substr(0, reply.find("\xEF\xBF\xBD"));
  CHECK_THAT(verify.output, Contains(std::string(answers[0]["prompt"].GetString()) + well_formed));
}

TEST_CASE("generate refuses bad options, files and outputs, naming them, and leaves no output",
          "[cli][generate][errors]") {
  const std::string dir = zt::test::temp_dir("generate_errors");
  write_random_model(dir);
  zt::files::write_atomic(dir + "/prompts.jsonl", "{\"prompt\": \"hi\"}\n{\"question\": 1}\n");
  zt::files::write_atomic(dir + "/kept.jsonl", "saved\n");
  const auto refused = [&](const std::string& flags, const std::string& what) {
    INFO(flags);
    Ran r = cli(fmt::format("generate '{}' --device cpu {}", dir, flags));
    CHECK(r.status == 2);
    CHECK_THAT(r.output, Contains(what));
  };
  refused("--prompt hi --top_p 1.5", "--top_p");
  refused("--prompt hi --temperature 0", "--temperature");
  for (const char* odd : {"0x0.8p0", "nan", "inf", "1e999", "0.5x"})
    refused(fmt::format("--prompt hi --top_p {}", odd), "--top_p");
  refused("--prompt hi --num_return_sequences 0", "--num_return_sequences");
  refused("--prompt hi --do_sample maybe", "--do_sample");
  refused("--prompt hi --device tpu", "--device");
  refused("--prompt hi --stop_strings '[1]'", "--stop_strings");
  refused("--prompt hi --stop_strings '[\"a\", \"\"]'", "--stop_strings: every item");
  refused("--prompt hi --max_new_tokens 200", "max_position_embeddings");
  refused("", "usage: zerotrain generate");
  refused(fmt::format("--prompts '{0}/prompts.jsonl' --output '{0}/new.jsonl'", dir),
          "prompts.jsonl' line 2");
  CHECK_FALSE(fs::exists(dir + "/new.jsonl"));
  refused(fmt::format("--prompt hi --output '{0}/kept.jsonl'", dir), "--overwrite_output");
  CHECK(zt::files::read_text(dir + "/kept.jsonl") == "saved\n");
  refused(fmt::format("--prompt hi --output '{0}'", dir), "not a regular file");
  // Nothing but the files the test wrote is left in the folder (no temporary outputs).
  for (const auto& entry : fs::directory_iterator(dir))
    CHECK(entry.path().filename().string().find(".tmp-") == std::string::npos);
}

TEST_CASE("a demo that does not learn says why it exits non-zero", "[cli][errors]") {
  const std::string dir = zt::test::temp_dir("demo_short");
  Ran r = cli(fmt::format("demo --nproc_per_node 1 --max_steps 1 --output_dir '{}/d'", dir));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("did not teach the task") && Contains("--max_steps (now 1)"));
}

TEST_CASE("the GRPO demo warms up, trains from the reward and says when it did not learn",
          "[cli][errors][grpo][slow]") {
  // One GRPO step after the warm-up: every stage runs (warm-up, merge, GRPO from the prompt
  // file, merge, the held-out accuracy by the reward), and one step does not teach the task.
  const std::string dir = zt::test::temp_dir("demo_grpo");
  Ran r = cli(
      fmt::format("demo --stage grpo --nproc_per_node 1 --max_steps 1 --output_dir '{}/d'", dir));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("after the 40-step warm-up") && Contains("accuracy: before") &&
                           Contains("GRPO did not teach the task") &&
                           Contains("--max_steps (now 1)"));
  CHECK(std::filesystem::exists(dir + "/d/merged/model.safetensors"));
  CHECK(std::filesystem::exists(dir + "/d/run/trainer_log.jsonl"));
  Ran lora = cli(fmt::format(
      "demo --stage grpo --finetuning_type lora --nproc_per_node 1 --output_dir '{}/e'", dir));
  CHECK(lora.status != 0);
  CHECK_THAT(lora.output, Contains("--stage grpo runs full fine-tuning"));
}

TEST_CASE("a DPO run's adapter: verify --compare scores pairs, and against the base",
          "[cli][slow]") {
  const std::string dir = zt::test::temp_dir("verify_compare");
  std::filesystem::create_directories(dir + "/base");
  write_random_model(dir + "/base");
  write_rating_pairs(dir, 16);
  Ran train = cli(fmt::format(
      "train --model_name_or_path '{0}/base' --train_file '{0}/pairs.jsonl' --output_dir '{0}/out' "
      "--stage dpo --finetuning_type lora --pref_beta 0.5 --learning_rate 1e-2 --max_steps 12 "
      "--per_device_train_batch_size 4 --save_steps 100 --template alpaca",
      dir));
  REQUIRE(train.status == 0);
  Ran r = cli(fmt::format("verify '{0}/out' --compare '{0}/pairs.jsonl'", dir));
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("16 pairs of") && Contains("prefers the chosen answer in"));
  // Trained on these pairs: the adapter's reward ranks most of them right.
  const size_t at = r.output.find("rewards/accuracies ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(r.output.substr(at + 19)) >= 75.0);
  // A model folder (no adapter): the model's own preference, no base to compare with.
  Ran base = cli(fmt::format("verify '{0}/base' --compare '{0}/pairs.jsonl'", dir));
  CHECK(base.status == 0);
  CHECK(base.output.find("rewards/accuracies") == std::string::npos);
  Ran both = cli(fmt::format("verify '{0}/base' --compare '{0}/pairs.jsonl' --prompt hi", dir));
  CHECK(both.status == 2);
  Ran dpo_demo = cli(
      fmt::format("demo --stage dpo --nproc_per_node 1 --max_steps 1 --output_dir '{}/d'", dir));
  CHECK(dpo_demo.status == 1);
  CHECK_THAT(dpo_demo.output,
             Contains("prefers the right answer: before") && Contains("did not teach the task"));
}

TEST_CASE("verify --compare scores the model the run trained, against the model it started from",
          "[cli][verify]") {
  // verify rebuilds the trained model from what the run recorded — its 4-bit base, PiSSA's
  // saved start (a randomized decomposition from seed 7, so seed 0 would give another) — and
  // scores against the model the run started from (for PiSSA, its factors over the residual;
  // for a module to save, the base's). What it prints equals the run's own last evaluation of
  // the same pairs: the log-prob margin is eval_logps/chosen − eval_logps/rejected and the
  // reward margin at beta 1 is eval_rewards/margins / beta. Tolerance: verify prints 3 decimals.
  const std::string dir = zt::test::temp_dir("verify_trained");
  std::filesystem::create_directories(dir + "/base");
  write_random_model(dir + "/base");
  write_rating_pairs(dir, 8);
  struct Case {
    const char* name;
    const char* flags;
  };
  const Case cases[] = {
      {"qlora", "--quantization_bit 4"},
      {"pissa", "--pissa_init true --pissa_iter 2"},
      {"qpissa", "--pissa_init true --pissa_iter 2 --quantization_bit 4"},
      {"saved", "--lora_modules_to_save lm_head"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string out = fmt::format("{}/{}", dir, c.name);
    Ran train = cli(fmt::format(
        "train --model_name_or_path '{0}/base' --train_file '{0}/pairs.jsonl' --eval_file "
        "'{0}/pairs.jsonl' --eval_strategy steps --eval_steps 6 --output_dir '{1}' --stage dpo "
        "--finetuning_type lora --pref_beta 0.5 --learning_rate 1e-2 --max_steps 6 --seed 7 "
        "--per_device_train_batch_size 4 --save_steps 100 --template alpaca {2}",
        dir, out, c.flags));
    REQUIRE(train.status == 0);
    Ran r = cli(fmt::format("verify '{}' --compare '{}/pairs.jsonl'", out, dir));
    REQUIRE(r.status == 0);
    auto number_after = [&](const std::string& text) {
      const size_t at = r.output.find(text);
      REQUIRE(at != std::string::npos);
      return std::stod(r.output.substr(at + text.size()));
    };
    const double margin = number_after("mean log-prob margin ");
    const double reward = number_after("mean reward margin ");
    const double chosen = zt::test::logged(out, "eval_logps/chosen").at(6);
    const double rejected = zt::test::logged(out, "eval_logps/rejected").at(6);
    const double trained_reward = zt::test::logged(out, "eval_rewards/margins").at(6) / 0.5;
    CHECK(margin == Approx(chosen - rejected).margin(1.5e-3));
    CHECK(reward == Approx(trained_reward).margin(1.5e-3));
    CHECK(std::abs(trained_reward) > 0.01);  // the run learnt something to compare
  }
  CHECK_THAT(cli(fmt::format("verify '{0}/pissa' --compare '{0}/pairs.jsonl'", dir)).output,
             Contains("PiSSA's starting factors, as the run saved them"));
}

TEST_CASE("the first hour's messages: the method, the next command, options before data",
          "[cli][messages]") {
  const std::string dir = zt::test::temp_dir("first_hour");
  std::filesystem::create_directories(dir + "/base");
  write_random_model(dir + "/base");
  zt::test::write_data(dir, "train.jsonl", 8, 1);
  // At the info level (the tests' default is warning), as a user sees it.
  auto cli = [](const std::string& args) {
    return shell(fmt::format("ZT_LOG_LEVEL=info '{}' {} 2>&1", ZT_CLI, args));
  };
  const std::string common = fmt::format(
      "train --model_name_or_path '{0}/base' --train_file '{0}/train.jsonl' --max_steps 2 "
      "--per_device_train_batch_size 4 --save_steps 100 --template alpaca --logging_steps 1",
      dir);
  // The start-up line names the method and its base; the last line where the output is and
  // what to run next.
  Ran q =
      cli(fmt::format("{} --output_dir '{}/q' --finetuning_type lora --lora_r 4 "
                      "--quantization_bit 4",
                      common, dir));
  REQUIRE(q.status == 0);
  CHECK_THAT(q.output, Contains("LoRA r4 (alpha 16) over a 4-bit NF4 base (double quantization)"));
  const std::string last = q.output.substr(q.output.rfind('\n', q.output.size() - 2) + 1);
  CHECK_THAT(last, Contains("next: zerotrain verify '" + dir + "/q'") && Contains("merge"));
  Ran d =
      cli(fmt::format("{} --output_dir '{}/d' --finetuning_type lora --use_dora true "
                      "--pissa_init true",
                      common, dir));
  REQUIRE(d.status == 0);
  CHECK_THAT(d.output, Contains("DoRA r8 (alpha 16), started by PiSSA"));
  // verify takes the option its own messages name.
  Ran v = cli(
      fmt::format("verify '{0}/q' --base_model '{0}/base' --prompt hi --max_new_tokens 1", dir));
  CHECK(v.status == 0);
  // Options are checked before the data is read: a bad combination is said even when the
  // data file does not exist.
  Ran early = cli(fmt::format(
      "train --model_name_or_path '{0}/base' --train_file '{0}/missing.jsonl' --output_dir "
      "'{0}/e' --finetuning_type lora --pissa_init true --adapter_name_or_path '{0}/q'",
      dir));
  CHECK(early.status != 0);
  CHECK_THAT(early.output, Contains("pissa_init") && !Contains("missing.jsonl"));
  Ran packing = cli(fmt::format(
      "train --model_name_or_path '{0}/base' --train_file '{0}/missing.jsonl' --output_dir "
      "'{0}/p' --stage dpo --packing true",
      dir));
  CHECK_THAT(packing.output, Contains("packing") && !Contains("missing.jsonl"));
  // Data of another stage says which stage trains it.
  zt::files::write_atomic(dir + "/kto.jsonl",
                          R"({"prompt": "Q", "completion": " a", "label": true})"
                          "\n");
  // Every layout of pairs: TRL's, and LLaMA-Factory's alpaca one.
  for (const char* record : {R"({"prompt": "Q", "chosen": " a", "rejected": " b"})",
                             R"({"instruction": "Q", "chosen": " a", "rejected": " b"})"}) {
    INFO(record);
    zt::files::write_atomic(dir + "/pair.jsonl", std::string(record) + "\n");
    Ran pair_as_sft =
        cli(fmt::format("{} --output_dir '{}/x1' --train_file '{}/pair.jsonl'", common, dir, dir));
    CHECK(pair_as_sft.status != 0);
    CHECK_THAT(pair_as_sft.output,
               Contains("pair.jsonl:1") && Contains("--stage dpo") && !Contains("skip_bad_lines"));
  }
  Ran kto_as_dpo = cli(fmt::format(
      "{} --output_dir '{}/x2' --train_file '{}/kto.jsonl' --stage dpo", common, dir, dir));
  CHECK(kto_as_dpo.status != 0);
  CHECK_THAT(kto_as_dpo.output, Contains("kto.jsonl:1") && Contains("--stage kto"));
  // A reference-free loss says that precomputing its reference does nothing.
  write_rating_pairs(dir, 8);
  Ran simpo = cli(fmt::format(
      "train --model_name_or_path '{0}/base' --train_file '{0}/pairs.jsonl' --output_dir "
      "'{0}/s' --stage dpo --pref_loss simpo --precompute_ref_log_probs true --max_steps 1 "
      "--finetuning_type lora",
      dir));
  CHECK(simpo.status == 0);
  CHECK_THAT(simpo.output, Contains("nothing to precompute"));
}

TEST_CASE("make demo builds the library and the program only, not the tests", "[cli][demo]") {
  // The README's first command shows learning minutes after a clone on 2 cores: it must not
  // build the test suite first (make -n prints what it would run, running nothing).
  const std::string build = zt::test::temp_dir("demo_build");
  Ran plan = shell(fmt::format("make -n -C '{}' demo BUILD='{}' 2>&1", ZT_SOURCE_ROOT, build));
  REQUIRE(plan.status == 0);
  CHECK_THAT(plan.output, Contains("--target zerotrain_cli"));
  std::istringstream lines(plan.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("cmake --build") != std::string::npos) {
      INFO(line);
      CHECK_THAT(line, Contains("--target zerotrain_cli"));
    }
  }
  CHECK_THAT(plan.output, Contains(build + "/bin/zerotrain demo"));
}

TEST_CASE("merge keeps the chat format the run trained with, so verify asks in it", "[cli]") {
  const std::string dir = zt::test::temp_dir("merge_template");
  zt::test::write_data(dir, "train.jsonl", 16, 3);
  std::string flags;
  for (const std::string& f :
       zt::test::tiny_run_flags(dir, {"--max_steps", "2", "--save_steps", "2",
                                      "--per_device_train_batch_size", "2", "--device", "cpu"})) {
    flags += " '" + f + "'";
  }
  REQUIRE(cli("train" + flags).status == 0);
  Ran merged = cli(fmt::format("merge '{}/out/checkpoint-2' '{}/merged'", dir, dir));
  INFO(merged.output);
  REQUIRE(merged.status == 0);
  CHECK(zt::recorded_template(dir + "/merged") == std::optional<std::string>("alpaca"));
  Ran r = cli(fmt::format("verify '{}/merged' --prompt 'Is 7 odd?' --max_new_tokens 2", dir));
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("### Instruction:\nIs 7 odd?\n\n### Response:\n"));
}

TEST_CASE("the template logged and recorded for verify is the one the data went through",
          "[cli][template]") {
  // Plain text (and TRL's text prompt + completion) goes through no template: the run says so,
  // records "raw", and verify sends prompts as they are — not in a template the model never saw.
  // Mixed data names how much of it the template formatted.
  const std::string dir = zt::test::temp_dir("applied_template");
  std::string plain, mixed;
  for (int i = 0; i < 8; ++i) {
    const std::string record =
        i % 2 ? fmt::format(R"({{"text": "{} is {}."}})", i, i % 2 ? "odd" : "even")
              : fmt::format(R"({{"prompt": "Is {} odd?", "completion": " no"}})", i);
    plain += record + "\n";
    mixed +=
        (i < 2 ? fmt::format(R"({{"instruction": "Is {} odd?", "output": "no"}})", i) : record) +
        "\n";
  }
  zt::files::write_atomic(dir + "/plain.jsonl", plain);
  zt::files::write_atomic(dir + "/mixed.jsonl", mixed);
  const auto train = [&](const std::string& data, const std::string& out) {
    std::string flags;
    for (const std::string& f :
         zt::test::tiny_run_flags(dir, {"--train_file", dir + "/" + data, "--output_dir",
                                        dir + "/" + out, "--max_steps", "1", "--save_steps", "1",
                                        "--per_device_train_batch_size", "2", "--device", "cpu"})) {
      flags += " '" + f + "'";
    }
    return shell(fmt::format("ZT_LOG_LEVEL=info '{}' train {} 2>&1", ZT_CLI, flags));
  };
  Ran raw = train("plain.jsonl", "raw");
  INFO(raw.output);
  REQUIRE(raw.status == 0);
  CHECK_THAT(raw.output, Contains("template: none applied: every training record is plain text"));
  CHECK(zt::recorded_template(dir + "/raw") == std::optional<std::string>(zt::kRawTemplate));
  CHECK(zt::recorded_template(dir + "/raw/checkpoint-1") ==
        std::optional<std::string>(zt::kRawTemplate));
  Ran asked = cli(fmt::format("verify '{}/raw' --prompt 'Is 7 odd?' --max_new_tokens 2", dir));
  CHECK(asked.status == 0);
  CHECK_THAT(asked.output, Contains("Is 7 odd?") && !Contains("###"));
  Ran some = train("mixed.jsonl", "mixed");
  INFO(some.output);
  REQUIRE(some.status == 0);
  CHECK_THAT(some.output, Contains("template: alpaca (--template), applied to 2 of the 8 training "
                                   "sequences; the others are plain text or token ids"));
  CHECK(zt::recorded_template(dir + "/mixed") == std::optional<std::string>("alpaca"));
}

TEST_CASE("merge of a P-Tuning run says to load it with PEFT, from its folder or a checkpoint",
          "[cli][errors]") {
  const std::string dir = zt::test::temp_dir("merge_ptuning");
  zt::test::write_data(dir, "train.jsonl", 8, 5);
  std::string flags;
  for (const std::string& f : zt::test::tiny_run_flags(
           dir, {"--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "2",
                 "--device", "cpu", "--finetuning_type", "ptuning", "--num_virtual_tokens", "4"}))
    flags += " '" + f + "'";
  REQUIRE(cli("train" + flags).status == 0);
  for (const std::string& from : {dir + "/out", dir + "/out/checkpoint-2"}) {
    INFO(from);
    Ran merged = cli(fmt::format("merge '{}' '{}/merged'", from, dir));
    CHECK(merged.status != 0);
    CHECK_THAT(merged.output, Contains("P-Tuning / prefix adapter") && Contains("PEFT"));
  }
}

namespace {

// Starts `zerotrain ARGS...` as a child process (its output to `log`) and returns its pid.
pid_t start_cli(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::vector<char*> argv{const_cast<char*>(ZT_CLI)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::execv(ZT_CLI, argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_status(pid_t pid) {
  int raw = 0;
  ::waitpid(pid, &raw, 0);
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
}

// Waits until `out`/trainer_log.jsonl has `lines` records (or two minutes pass).
bool wait_for_log_lines(const std::string& out, int lines) {
  for (int i = 0; i < 1200; ++i) {
    std::ifstream in(out + "/trainer_log.jsonl");
    int n = 0;
    for (std::string l; std::getline(in, l);) ++n;
    if (n >= lines) return true;
    ::usleep(100000);
  }
  return false;
}

std::vector<std::string> long_run(const std::string& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> a =
      zt::test::tiny_run_flags(dir,
                               {"--per_device_train_batch_size", "2", "--max_steps", "100000",
                                "--logging_steps", "1", "--disable_tqdm", "--device", "cpu"},
                               extra);
  a.insert(a.begin(), "train");
  return a;
}

}  // namespace

TEST_CASE("SIGTERM and SIGUSR1 save a checkpoint at the next step, then end with 128 + the signal",
          "[cli][signals]") {
  for (int sig : {SIGTERM, SIGUSR1}) {
    INFO("signal " << sig);
    const std::string dir = zt::test::temp_dir("preempt");
    zt::test::write_data(dir, "train.jsonl", 40, 31);
    const pid_t pid = start_cli(long_run(dir, {"--save_steps", "100000"}), dir + "/log.txt");
    REQUIRE(wait_for_log_lines(dir + "/out", 2));
    ::kill(pid, sig);
    CHECK(wait_status(pid) == 128 + sig);
    const auto latest = zt::latest_checkpoint(dir + "/out");
    REQUIRE(latest.has_value());
    CHECK(zt::read_engine_state(*latest).global_steps >= 2);
    CHECK_THAT(zt::files::read_text(dir + "/log.txt"),
               Contains("stopped by signal") && Contains("--resume_from_checkpoint True"));
  }
}

TEST_CASE("SIGTERM before the first step ends the phase running within seconds, saying so",
          "[cli][signals][stop]") {
  // The phase is under way once its mark is there: the output folder's lock (taken before the
  // data is tokenized), or training_args.json (written when train() starts, just before the
  // reference is precomputed). The data makes each phase last well past the signal.
  struct Case {
    const char* mark;
    const char* says;
    std::vector<std::string> extra;
  };
  const std::vector<Case> cases{
      {".zerotrain.lock", "stopped by signal 15 while tokenizing training data '", {}},
      {"training_args.json",
       "stopped by signal 15 while precomputing the reference (",
       {"--stage", "dpo", "--finetuning_type", "full", "--per_device_eval_batch_size", "1"}}};
  for (const Case& c : cases) {
    INFO(c.says);
    const std::string dir = zt::test::temp_dir("stop_early");
    if (c.extra.empty()) {
      zt::test::write_data(dir, "train.jsonl", 600000, 33);
    } else {
      zt::test::write_pairs(dir, "train.jsonl", 20000, 34);
    }
    const pid_t pid = start_cli(long_run(dir, c.extra), dir + "/log.txt");
    bool started = false, ended = false;
    for (int i = 0; i < 3600 && !started && !ended; ++i) {  // up to 3 min (sanitizers)
      started = fs::exists(dir + "/out/" + c.mark);
      ended = !started && ::waitpid(pid, nullptr, WNOHANG) == pid;
      if (!started) ::usleep(50000);
    }
    INFO(zt::files::read_text(dir + "/log.txt"));
    REQUIRE(started);
    const auto signalled = std::chrono::steady_clock::now();
    ::kill(pid, SIGTERM);
    CHECK(wait_status(pid) == 128 + SIGTERM);
    CHECK(std::chrono::steady_clock::now() - signalled < std::chrono::seconds(10));
    const std::string log = zt::files::read_text(dir + "/log.txt");
    CHECK_THAT(log, Contains(c.says) &&
                        Contains("before the first step: no checkpoint was saved") &&
                        !Contains("checkpoint-0"));
    CHECK_FALSE(fs::exists(dir + "/out/checkpoint-0"));
    // Stopped within the phase ("(12.5 of 38.0 MiB done)", "(4412 of 20000 batches done)"),
    // not at its end.
    const size_t at = log.find(" done), before the first step");
    REQUIRE(at != std::string::npos);
    double done = 0, total = 0;
    REQUIRE(std::sscanf(log.c_str() + log.rfind(" (", at), " (%lf of %lf", &done, &total) == 2);
    CHECK(done < total);
  }
}

TEST_CASE("launch passes signals to its own ranks only and ends with their status",
          "[cli][signals]") {
  const std::string dir = zt::test::temp_dir("launch_signals");
  // The caller is a shell that starts the launcher in the background and signals it: with
  // kill(0, ...) the caller itself would die before reporting.
  const std::string script = fmt::format(
      "ZT_LOG_LEVEL=warning '{}' launch --nproc_per_node 2 -- sh -c 'trap \"echo term > "
      "{}/rank$RANK; exit 143\" TERM; "
      "echo up > {}/up$RANK; sleep 60 & wait' & L=$!; "
      "for i in $(seq 100); do [ -f {}/up0 ] && [ -f {}/up1 ] && break; sleep 0.1; done; "
      "kill -TERM $L; wait $L; echo launcher=$?; echo caller alive",
      ZT_CLI, dir, dir, dir, dir);
  zt::files::write_atomic(dir + "/run.sh", script + "\n");
  Ran r;
  {
    FILE* p = ::popen(("sh " + dir + "/run.sh 2>&1").c_str(), "r");
    REQUIRE(p != nullptr);
    std::array<char, 4096> buf;
    size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
    ::pclose(p);
  }
  CHECK_THAT(r.output, Contains("caller alive"));
  CHECK_THAT(r.output, Contains("launcher=143"));
  // The user's signal is reported as such, never as a failed job.
  CHECK_THAT(r.output, Contains("stopped by signal 15"));
  CHECK_THAT(r.output, !Contains("the job failed"));
  CHECK(zt::files::read_text(dir + "/rank0") == "term\n");
  CHECK(zt::files::read_text(dir + "/rank1") == "term\n");
}

TEST_CASE("kill -9 at any moment leaves latest naming a complete checkpoint that resumes",
          "[cli][checkpoint]") {
  const std::string dir = zt::test::temp_dir("kill9");
  zt::test::write_data(dir, "train.jsonl", 40, 32);
  std::mt19937 rng(5);
  for (int round = 0; round < 6; ++round) {
    INFO("round " << round);
    const bool resume = zt::latest_checkpoint(dir + "/out").has_value();
    std::vector<std::string> extra{"--save_steps", "1"};
    if (resume) extra.insert(extra.end(), {"--resume_from_checkpoint", "True"});
    if (!resume && round > 0) extra.push_back("--overwrite_output_dir");
    const pid_t pid = start_cli(long_run(dir, extra), dir + "/log.txt");
    REQUIRE(wait_for_log_lines(dir + "/out", 1));
    ::usleep(static_cast<useconds_t>(rng() % 1500000));  // somewhere in the saves that follow
    ::kill(pid, SIGKILL);
    wait_status(pid);
    const auto latest = zt::latest_checkpoint(dir + "/out");
    if (!latest) continue;
    // Complete: its layout, every shard and every tensor (their checksums) read back.
    const zt::EngineState s = zt::read_engine_state(*latest);
    CHECK(s.global_steps >= 1);
    for (const auto& e : fs::directory_iterator(*latest + "/optimizer")) {
      zt::SafetensorsFile f(e.path().string());
      for (const std::string& name : f.names()) CHECK(f.load(name).numel() >= 0);
    }
  }
  // The window between renaming a checkpoint into place and updating `latest`: the newer folder
  // never committed; resuming from `latest` replaces it.
  const auto all = zt::list_checkpoints(dir + "/out");
  REQUIRE(all.size() >= 1);
  if (all.size() >= 2)
    zt::files::write_atomic(dir + "/out/latest",
                            fs::path(all[all.size() - 2].path).filename().string() + "\n");
  const int64_t from = zt::read_engine_state(*zt::latest_checkpoint(dir + "/out")).global_steps;
  std::vector<std::string> finish =
      long_run(dir, {"--save_steps", "1", "--resume_from_checkpoint", "True"});
  for (size_t i = 0; i < finish.size(); ++i) {
    if (finish[i] == "--max_steps") finish[i + 1] = std::to_string(from + 3);
  }
  const pid_t pid = start_cli(finish, dir + "/log.txt");
  CHECK(wait_status(pid) == 0);
  CHECK(zt::read_engine_state(*zt::latest_checkpoint(dir + "/out")).global_steps == from + 3);
}

namespace {

// A ChatGLM3-6B-shaped folder small enough for the CPU: 28 layers as the real model (the
// README's freeze line names layers 24-27), tiny widths, random weights, the fixture's
// SentencePiece tokenizer.
std::string write_chatglm_folder(const std::string& dir) {
  zt::ModelConfig c = zt::parse_model_config(R"({"model_type": "chatglm",
      "padded_vocab_size": 416, "hidden_size": 32, "ffn_hidden_size": 48, "num_layers": 28,
      "num_attention_heads": 2, "kv_channels": 16, "multi_query_attention": true,
      "multi_query_group_num": 1, "add_qkv_bias": true, "seq_length": 2048,
      "eos_token_id": 2, "pad_token_id": 0})");
  zt::CausalLM model(c, at::TensorOptions().dtype(at::kFloat));
  model.initialize_random(1);
  zt::export_merged(model, dir, at::kHalf);
  for (const char* f : {"tokenizer.model", "tokenizer_config.json"}) {
    fs::copy_file(std::string(ZT_FIXTURES) + "/models/chatglm/" + f, dir + "/" + f);
  }
  return dir;
}

}  // namespace

TEST_CASE("ChatGLM-Finetuning's README command lines run as they are", "[cli][chatglm]") {
  // Its commands with `deepspeed ... train.py` as `zerotrain launch ... train`; paths are the
  // README's, relative to a folder holding the model, its data and its DeepSpeed config.
  const std::string work = zt::test::temp_dir("chatglm_finetuning");
  write_chatglm_folder(work + "/ChatGLM3-6B");
  fs::create_directories(work + "/data");
  fs::copy_file(std::string(ZT_FIXTURES) + "/chatglm/seed_records.jsonl",
                work + "/data/spo_0.json");
  for (const char* ds : {"ds_zero2_no_offload.json", "ds_zero3_offload.json"}) {
    fs::copy_file(std::string(ZT_FIXTURES) + "/chatglm/" + ds, work + "/" + ds);
  }
  // Port 520 as in the README where this process may bind it (root), else a free one.
  const std::string port = ::geteuid() == 0 ? "520" : "0";
  const std::string launch = fmt::format(
      "cd '{}' && CUDA_VISIBLE_DEVICES=0 '{}' launch --master_port {} train", work, ZT_CLI, port);
  auto run = [&](const std::string& flags) { return shell(launch + " " + flags + " 2>&1"); };
  const std::string common =
      "--train_path data/spo_0.json --model_name_or_path ChatGLM3-6B/ "
      "--per_device_train_batch_size 1 --max_len 1560 --max_src_len 1024 --learning_rate 1e-4 "
      "--weight_decay 0.1 --num_train_epochs 2 --gradient_accumulation_steps 4 "
      "--warmup_ratio 0.1 --mode glm3 ";
  SECTION("Freeze") {
    Ran r = run(common +
                "--train_type freeze --freeze_module_name \"layers.27.,layers.26.,layers.25.,"
                "layers.24.\" --seed 1234 --ds_file ds_zero2_no_offload.json "
                "--gradient_checkpointing --show_loss_step 10 --output_dir ./output-glm3");
    INFO(r.output);
    REQUIRE(r.status == 0);
    zt::SafetensorsCheckpoint out(work + "/output-glm3");
    CHECK(out.contains("transformer.encoder.layers.27.mlp.dense_h_to_4h.weight"));
    // Only layers 24-27 trained: layer 0 is the base model's, bit for bit.
    zt::SafetensorsCheckpoint base(work + "/ChatGLM3-6B");
    const std::string frozen = "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight",
                      trained = "transformer.encoder.layers.27.mlp.dense_h_to_4h.weight";
    auto load = [](zt::SafetensorsCheckpoint& c, const std::string& name) {
      at::Tensor t = at::empty(c.info(name).shape, at::kFloat);
      c.read_range(name, 0, t);
      return t;
    };
    CHECK(at::equal(load(out, frozen), load(base, frozen)));
    CHECK_FALSE(at::equal(load(out, trained), load(base, trained)));
    // verify asks in the layout's own prompt.
    CHECK(zt::recorded_template(work + "/output-glm3") == std::optional<std::string>("chatglm3"));
  }
  SECTION("P-Tuning v2") {
    Ran r = run(common +
                "--train_type ptuning --seed 1234 --ds_file ds_zero2_no_offload.json "
                "--gradient_checkpointing --show_loss_step 10 --pre_seq_len 16 "
                "--prefix_projection True --output_dir ./output-glm3");
    INFO(r.output);
    REQUIRE(r.status == 0);
    zt::SafetensorsFile prefix(work + "/output-glm3/prefix_encoder.safetensors");
    CHECK(prefix.load("transformer.prefix_encoder.embedding.weight").size(0) == 16);
    CHECK(fs::exists(work + "/output-glm3/adapter_config.json"));
  }
  SECTION("full fine-tuning, ZeRO-3 with parameters and optimizer offloaded") {
    Ran r = run(common +
                "--train_type all --seed 1234 --ds_file ds_zero3_offload.json "
                "--gradient_checkpointing --show_loss_step 10 --output_dir ./output-all");
    INFO(r.output);
    REQUIRE(r.status == 0);
    zt::SafetensorsCheckpoint out(work + "/output-all");
    CHECK(out.contains("transformer.encoder.layers.0.self_attention.query_key_value.weight"));
    CHECK(out.contains("transformer.output_layer.weight"));
  }
  SECTION("run.sh: ChatGLM2 P-Tuning v2, micro-batch 8, 10 epochs") {
    // run.sh as the seed's history has it (its model path aside), on a ChatGLM2 folder: one
    // whose tokenization_chatglm.py has no role tokens.
    write_chatglm_folder(work + "/chatglm2-6b");
    zt::files::write_atomic(work + "/chatglm2-6b/tokenization_chatglm.py",
                            "# ChatGLM2's tokenizer: [MASK] [gMASK] [sMASK] sop eop\n");
    // Short records: micro-batch 8 for 10 epochs on Debian's reference BLAS is otherwise minutes.
    zt::files::write_atomic(work + "/data/spo_0.json",
                            R"({"instruction": "你好", "input": "", "output": "你好，我是模型。"})"
                            "\n"
                            R"({"instruction": "Translate: ", "input": "fox", "output": "狐狸"})"
                            "\n");
    Ran r = run(
        "--train_path data/spo_0.json --model_name_or_path chatglm2-6b "
        "--per_device_train_batch_size 8 --max_len 1560 --max_src_len 1024 --learning_rate 1e-4 "
        "--weight_decay 0.1 --num_train_epochs 10 --gradient_accumulation_steps 4 "
        "--warmup_ratio 0.1 --mode glm2 --train_type ptuning --seed 1234 "
        "--ds_file ds_zero2_no_offload.json --show_loss_step 10 --pre_seq_len 16 "
        "--prefix_projection True --output_dir ./output-glm2");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(fs::exists(work + "/output-glm2/prefix_encoder.safetensors"));
    CHECK(zt::recorded_template(work + "/output-glm2") == std::optional<std::string>("chatglm2"));
  }
  SECTION("LoRA, train.py's defaults") {
    Ran r =
        run("--train_path data/spo_0.json --model_name_or_path ChatGLM3-6B/ "
            "--per_device_train_batch_size 1 --mode glm3 --ds_file ds_zero2_no_offload.json "
            "--output_dir ./output-lora");
    INFO(r.output);
    REQUIRE(r.status == 0);
    const std::string config = zt::files::read_text(work + "/output-lora/adapter_config.json");
    CHECK_THAT(config, Contains("\"query_key_value\""));
    CHECK_THAT(config, Contains("\"lora_alpha\": 30"));
  }
}

TEST_CASE(
    "a hung rank under the trainer is named by the others' last error line, and the run "
    "resumes",
    "[cli][faults]") {
  if (!zt::backend_available(zt::Backend::kGloo)) return;
  for (int world : {2, 4}) {
    const std::string dir = zt::test::temp_dir("cli_hung");
    zt::test::write_data(dir, "train.jsonl", 64, 3);
    zt::test::check_stopped_trainer(ZT_CLI, dir, world, world == 2 ? 1 : 2, "cpu", 5);
  }
}

TEST_CASE("what loading the tokenizer warns about is said once per job, not once per rank",
          "[cli][launch]") {
  if (!zt::backend_available(zt::Backend::kGloo)) return;  // two CPU ranks need Gloo
  // A model folder without tokenizer files: every rank loads it and falls back to bytes.
  const std::string dir = zt::test::temp_dir("tokenizer_warn_once");
  std::filesystem::create_directories(dir + "/model");
  write_random_model(dir + "/model");
  zt::test::write_data(dir, "train.jsonl", 16, 5);
  Ran r = shell(fmt::format(
      "ZT_LOG_LEVEL=info '{0}' launch --nproc_per_node 2 -- '{0}' train --model_name_or_path "
      "'{1}/model' --train_file '{1}/train.jsonl' --output_dir '{1}/out' --template alpaca "
      "--max_steps 1 --per_device_train_batch_size 2 --save_strategy no --device cpu 2>&1",
      ZT_CLI, dir));
  INFO(r.output);
  REQUIRE(r.status == 0);
  int warned = 0;
  for (size_t at = r.output.find("has no tokenizer files"); at != std::string::npos;
       at = r.output.find("has no tokenizer files", at + 1)) {
    ++warned;
  }
  CHECK(warned == 1);
}

namespace {

// LLaMA-Factory's working folder as its examples expect it: the configs (the keys of its
// example YAML files), data/ with dataset_info.json and the data files, examples/deepspeed/,
// and a tiny local model in `model/` for the hub model the configs name: one layer, with the
// fixtures' small LLaMA-3-pipeline tokenizer (900 ids; <|im_start|> and <|im_end|> are among
// its special tokens, so ChatML — qwen3_nothink — encodes).
std::string llamafactory_folder(const std::string& tag) {
  const std::string dir = zt::test::temp_dir(tag);
  fs::copy(std::string(ZT_FIXTURES) + "/llamafactory", dir, fs::copy_options::recursive);
  const std::string model = dir + "/model";
  zt::test::write_model_folder(
      model,
      R"({"model_type": "llama", "vocab_size": 904, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096})",
      1);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(std::string(ZT_FIXTURES) + "/tokenizers/llama3/" + f, model + "/" + f);
  }
  return dir;
}

// `zerotrain ARGS` run in `dir`, as LLaMA-Factory's commands run in its repository.
Ran cli_in(const std::string& dir, const std::string& args) {
  return shell(fmt::format("cd '{}' && ZT_LOG_LEVEL=info '{}' {} 2>&1", dir, ZT_CLI, args));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("LLaMA-Factory's example configs run as they are, the model a local folder",
          "[cli][llamafactory]") {
  // Each config names a hub model; the line replaces it with the local one, the way
  // LLaMA-Factory's own overrides are written (NAME=VALUE) — nothing else is changed.
  const std::string dir = llamafactory_folder("llamafactory_configs");
  SECTION("LoRA SFT over two datasets of dataset_info.json") {
    Ran r = cli_in(dir, "train qwen3_lora_sft.yaml model_name_or_path=model");
    INFO(r.output);
    REQUIRE(r.status == 0);
    // 8 records (identity and alpaca_en_demo, 4 each), a global batch of 1 × 8: one step per
    // epoch, three epochs.
    CHECK_THAT(r.output, Contains("trained 3 steps"));
    CHECK_THAT(r.output, Contains("dataset 'identity' (data/identity.json, alpaca): 4 records"));
    for (const char* ignored : {"trust_remote_code", "preprocessing_num_workers", "plot_loss",
                                "dataloader_num_workers"}) {
      CHECK_THAT(r.output, Contains(std::string(ignored) + " has no effect in zerotrain"));
    }
    const std::string out = dir + "/saves/qwen3-4b/lora/sft";
    CHECK(fs::exists(out + "/adapter_model.safetensors"));
    CHECK(fs::exists(out + "/loss.svg"));
    const std::string args = read_file(out + "/training_args.json");
    CHECK_THAT(args, Contains(R"("max_length": 2048)") && Contains(R"("template": "chatml")") &&
                         Contains(R"("lora_target_modules": "all")") &&
                         Contains(R"("dataset": "identity,alpaca_en_demo")") &&
                         Contains("/.cache/datasets/identity+alpaca_en_demo.train-"));
  }
  SECTION("the line overrides the file, in either spelling; val_size holds records out") {
    Ran r = cli_in(dir,
                   "train llama3_lora_sft.yaml model_name_or_path=model template=chatml "
                   "--learning_rate 2e-4 val_size=0.25 gradient_accumulation_steps=2 "
                   "eval_strategy=steps eval_steps=1 num_train_epochs=1");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK_THAT(r.output, Contains("overwrite_cache has no effect in zerotrain"));
    CHECK_THAT(r.output, Contains("val_size 0.25: 2 records held out for evaluation"));
    CHECK_THAT(r.output, Contains("trained 3 steps") && Contains("eval_loss"));
    const std::string args = read_file(dir + "/saves/llama3-8b/lora/sft/training_args.json");
    CHECK_THAT(args, Contains(R"("learning_rate": 0.0002)") && Contains(R"("template": "chatml")"));
  }
  SECTION("QLoRA over a 4-bit base, full fine-tuning with their ZeRO-3 config, DPO, KTO") {
    for (const auto& [config, out, file] :
         {std::tuple<const char*, const char*, const char*>{"qwen3_lora_sft_otfq.yaml", "lora/sft",
                                                            "adapter_model.safetensors"},
          {"qwen3_full_sft.yaml", "full/sft", "model.safetensors"},
          {"qwen3_lora_dpo.yaml", "lora/dpo", "adapter_model.safetensors"},
          {"qwen3_lora_kto.yaml", "lora/kto", "adapter_model.safetensors"}}) {
      Ran r = cli_in(dir, fmt::format("train {} model_name_or_path=model", config));
      INFO(config << "\n" << r.output);
      CHECK(r.status == 0);
      CHECK(fs::exists(fmt::format("{}/saves/qwen3-4b/{}/{}", dir, out, file)));
    }
  }
  SECTION("a run resumes: the same datasets are the same data file, whatever dataset_dir's path") {
    Ran first =
        cli_in(dir, "train qwen3_lora_sft.yaml model_name_or_path=model save_steps=1 max_steps=2");
    INFO(first.output);
    REQUIRE(first.status == 0);
    Ran resumed =
        cli_in(dir, fmt::format("train qwen3_lora_sft.yaml model_name_or_path=model "
                                "resume_from_checkpoint=True max_steps=3 dataset_dir={}/data",
                                dir));
    INFO(resumed.output);
    CHECK(resumed.status == 0);
    CHECK_THAT(resumed.output, Contains("trained 3 steps"));
    Ran other = cli_in(dir,
                       "train qwen3_lora_sft.yaml model_name_or_path=model "
                       "resume_from_checkpoint=True max_steps=4 dataset=identity");
    CHECK(other.status == 2);
    CHECK_THAT(other.output, Contains("dataset"));
  }
  SECTION("on two ranks: rank 0 writes the converted data, both read it") {
    if (!zt::backend_available(zt::Backend::kGloo)) return;
    Ran r = cli_in(dir, fmt::format("launch --nproc_per_node 2 -- '{}' train qwen3_lora_sft.yaml "
                                    "model_name_or_path=model gradient_accumulation_steps=4",
                                    ZT_CLI));
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK_THAT(r.output, Contains("trained 3 steps"));
  }
  SECTION("hub models and hub datasets say to download them") {
    Ran model = cli_in(dir, "train qwen3_lora_sft.yaml");
    CHECK(model.status != 0);
    CHECK_THAT(model.output, Contains("huggingface-cli download Qwen/Qwen3-4B-Instruct-2507"));
    Ran data = cli_in(dir, "train qwen3_lora_sft.yaml model_name_or_path=model dataset=alpaca_en");
    CHECK(data.status == 2);
    CHECK_THAT(data.output,
               Contains("huggingface-cli download --repo-type dataset llamafactory/alpaca_en"));
    Ran bad = cli_in(dir, "train qwen3_lora_sft.yaml model_name_or_path=model lora_rank=x");
    CHECK(bad.status == 2);
    CHECK_THAT(bad.output, Contains("--lora_rank: expected an integer"));
  }
}
