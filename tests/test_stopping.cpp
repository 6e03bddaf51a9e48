// Stopping a run before its first step: a stop asked (StopRequest, Trainer::preempt) while the
// data is tokenized, while the weights load and quantize, or while the reference log-probs are
// precomputed ends that phase within one unit of its work on every rank, with a message that
// says what was stopped and that no checkpoint was saved; the phases report their progress in
// the log and count in the run's train_runtime. World sizes: 1, and 2 (Gloo) for the agreement.
#include "support/catch.hpp"

#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

const char* const kPrecompute = "precomputing the reference";

// DPO with full fine-tuning (its reference precomputed before the first step), one pair per
// scored batch: 24 batches to precompute at one rank.
std::vector<std::string> dpo_flags(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_run_flags(
      dir,
      {"--stage", "dpo", "--finetuning_type", "full", "--per_device_train_batch_size", "2",
       "--per_device_eval_batch_size", "1", "--max_steps", "4", "--logging_steps", "1",
       "--save_steps", "1", "--seed", "5"},
      extra);
}

TrainingArguments arguments(const std::vector<std::string>& flags) {
  TrainingArguments args;
  apply_training_flags(args, flags);
  return args;
}

// The library's info lines while it lives (then the default sink and level again).
class LogCapture {
 public:
  LogCapture() : level_(log_level()) {
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel, const std::string& message) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(message);
    });
  }
  ~LogCapture() {
    set_log_sink(nullptr);
    set_log_level(level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }

 private:
  LogLevel level_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

// The phases a run reported to on_progress, and how far each got.
struct SeenPhases {
  std::vector<std::string> names;
  double last_done = 0.0, last_total = 0.0;
  void add(const Progress& p) {
    if (p.phase.empty()) return;
    if (names.empty() || names.back() != p.phase) names.push_back(p.phase);
    last_done = p.phase_done;
    last_total = p.phase_total;
  }
};

// kTinyModel as an HF folder with seeded random weights.
void write_base_model(const std::string& folder) {
  test::write_model_folder(folder, test::kTinyModel, 11);
}

}  // namespace

TEST_CASE("a stop asked while the reference is precomputed ends it at the next batch, saying so",
          "[trainer][stop][preference]") {
  const std::string dir = test::temp_dir("stop-precompute");
  test::write_pairs(dir, "train.jsonl", 24, 3);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainerCallbacks cb;
  cb.stop = std::make_shared<StopRequest>();
  SeenPhases seen;
  cb.on_progress = [&](const Progress& p) {
    seen.add(p);
    // A scheduler's SIGTERM once the first batch is scored.
    if (p.phase == kPrecompute && p.phase_done >= 1) cb.stop->preempt(SIGTERM);
  };
  Trainer trainer(arguments(dpo_flags(dir, {})), comm, cb);
  CHECK_THROWS_WITH(trainer.train(),
                    Contains("stopped by signal 15 while precomputing the reference (1 of 24 "
                             "batches done), before the first step: no checkpoint was saved; run "
                             "again to start over") &&
                        !Contains("checkpoint-0"));
  CHECK(trainer.preempted_by() == SIGTERM);
  // Stopped at the next batch, not after the other 23; nothing was saved, no checkpoint-0.
  REQUIRE_FALSE(seen.names.empty());
  CHECK(seen.names.back() == kPrecompute);
  CHECK(seen.last_done == 1.0);
  CHECK(seen.last_total == 24.0);
  CHECK_FALSE(fs::exists(dir + "/out/checkpoint-0"));
  CHECK_FALSE(latest_checkpoint(dir + "/out").has_value());
}

TEST_CASE("a signal's stop at step 0 names no checkpoint that does not exist", "[trainer][stop]") {
  const std::string dir = test::temp_dir("stop-step0");
  test::write_data(dir, "train.jsonl", 16, 2);
  auto comm = std::shared_ptr<Communicator>(test::join());
  Trainer trainer(arguments(test::tiny_run_flags(dir, {"--max_steps", "4", "--save_steps", "1"})),
                  comm);
  trainer.preempt(SIGTERM);  // after the constructor, before train(): nothing to precompute
  CHECK_THROWS_WITH(
      trainer.train(),
      Contains("stopped by signal 15 before the first step: no checkpoint was saved; run again "
               "to start over") &&
          !Contains("checkpoint-0"));
  CHECK(trainer.preempted_by() == SIGTERM);
  CHECK_FALSE(fs::exists(dir + "/out/checkpoint-0"));
}

TEST_CASE("a stop asked while the data is tokenized ends the constructor at the next records",
          "[trainer][stop][data]") {
  const std::string dir = test::temp_dir("stop-tokenize");
  // 30000 records: four batches of records, each reported.
  test::write_data(dir, "train.jsonl", 30000, 4);
  auto comm = std::shared_ptr<Communicator>(test::join());
  const TrainingArguments args = arguments(test::tiny_run_flags(dir, {"--max_steps", "2"}));
  const std::string phase = "tokenizing training data '" + dir + "/train.jsonl'";

  SECTION("asked during the phase") {
    TrainerCallbacks cb;
    cb.stop = std::make_shared<StopRequest>();
    SeenPhases seen;
    cb.on_progress = [&](const Progress& p) {
      seen.add(p);
      if (p.phase == phase) cb.stop->cancel();  // SIGINT, at the first batch of records
    };
    CHECK_THROWS_WITH(Trainer(args, comm, cb),
                      Contains("cancelled while " + phase + " (") &&
                          Contains(" MiB done), before the first step: no checkpoint was "
                                   "saved; run again to start over"));
    REQUIRE(seen.names == std::vector<std::string>{phase});
    CHECK(seen.last_done > 0.0);
    CHECK(seen.last_done < seen.last_total);
  }
  SECTION("asked before the Trainer exists (a signal handler installed first)") {
    TrainerCallbacks cb;
    cb.stop = std::make_shared<StopRequest>();
    cb.stop->preempt(SIGUSR1);
    CHECK_THROWS_WITH(
        Trainer(args, comm, cb),
        Contains("stopped by signal " + std::to_string(SIGUSR1) + " while " + phase + " (0 of ") &&
            Contains(" MiB done), before the first step"));
  }
  // A run that never started leaves nothing: not its folder, not a half-written cache.
  CHECK_FALSE(fs::exists(dir + "/out"));
}

TEST_CASE(
    "a stop asked while the weights load and quantize ends the constructor at the next "
    "weight",
    "[trainer][stop][quant]") {
  const std::string dir = test::temp_dir("stop-load");
  test::write_data(dir, "train.jsonl", 16, 5);
  write_base_model(dir + "/base");
  std::vector<std::string> flags =
      test::tiny_run_flags(dir, {"--max_steps", "2", "--finetuning_type", "lora", "--lora_r", "4",
                                 "--quantization_bit", "4", "--model_name_or_path", dir + "/base"});
  flags.erase(flags.begin(), flags.begin() + 2);  // no --model_config
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainerCallbacks cb;
  cb.stop = std::make_shared<StopRequest>();
  SeenPhases seen;
  cb.on_progress = [&](const Progress& p) {
    seen.add(p);
    if (p.phase == "loading and quantizing the weights" && p.phase_done > 0) cb.stop->cancel();
  };
  CHECK_THROWS_WITH(Trainer(arguments(flags), comm, cb),
                    Contains("cancelled while loading and quantizing the weights (") &&
                        Contains(" M values done), before the first step"));
  REQUIRE_FALSE(seen.names.empty());
  CHECK(seen.names.back() == "loading and quantizing the weights");
  CHECK(seen.last_done < seen.last_total);  // stopped at the next weight, not at the end
  CHECK_FALSE(fs::exists(dir + "/out"));
}

TEST_CASE(
    "a long phase before the first step reports its progress in the log and counts in "
    "train_runtime",
    "[trainer][stop][preference]") {
  const std::string dir = test::temp_dir("phase-progress");
  test::write_pairs(dir, "train.jsonl", 24, 6);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainerCallbacks cb;
  // A slow precompute: 24 batches of 0.25 s at least, past the meter's 5 s between log lines.
  cb.on_progress = [](const Progress& p) {
    if (p.phase == kPrecompute) ::usleep(250000);
  };
  std::optional<double> runtime;
  cb.on_log = [&](const LogRecord& r) {
    if (r.train_runtime) runtime = r.train_runtime;
  };
  LogCapture log;
  Trainer(arguments(dpo_flags(dir, {"--save_steps", "100"})), comm, cb).train();
  bool progress_line = false, closing_line = false;
  for (const std::string& line : log.lines()) {
    // "precomputing the reference: 19 of 24 batches (79%), 3.9 batches/s, 1 s left"
    progress_line = progress_line || (line.rfind("precomputing the reference: ", 0) == 0 &&
                                      line.find(" of 24 batches (") != std::string::npos &&
                                      line.find(" batches/s, ") != std::string::npos &&
                                      line.find(" left") != std::string::npos);
    closing_line =
        closing_line || line.rfind("precomputing the reference: done, 24 batches in ", 0) == 0;
  }
  CHECK(progress_line);
  CHECK(closing_line);
  // The runtime counts the 6 s of the precompute (train_runtime measured from the first step
  // would not).
  REQUIRE(runtime.has_value());
  CHECK(*runtime >= 6.0);
}

// One rank of a 2-rank run under ZeRO-3 whose rank 0 asks for a stop during the phase that
// ZT_STOP_PHASE names ("tokenizing", "precomputing"): every rank must end with CancelledError
// saying so (rank 1 by the agreement), none waiting in a collective.
TEST_CASE("rank: stop before the first step", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string phase = std::getenv("ZT_STOP_PHASE");
  const TrainingArguments args = arguments(test::split_flags(std::getenv("ZT_FLAGS")));
  TrainerCallbacks cb;
  cb.stop = std::make_shared<StopRequest>();
  cb.on_progress = [&](const Progress& p) {  // rank 0 only
    if (p.phase.rfind(phase, 0) == 0 && p.phase_done > 0) cb.stop->preempt(SIGTERM);
  };
  if (phase == "tokenizing") {
    CHECK_THROWS_WITH(Trainer(args, comm, cb),
                      Contains("stopped by signal 15 while tokenizing training data") &&
                          Contains("no checkpoint was saved"));
    return;
  }
  Trainer trainer(args, comm, cb);
  CHECK_THROWS_WITH(trainer.train(), Contains("stopped by signal 15 while precomputing the "
                                              "reference (") &&
                                         Contains("no checkpoint was saved") &&
                                         !Contains("checkpoint-0"));
  CHECK(trainer.preempted_by() == SIGTERM);  // the agreed signal, on rank 1 too
}

TEST_CASE("a stop asked on one rank before the first step stops every rank",
          "[trainer][stop][preference]") {
  if (test::skip_cpu_world(2)) return;
  const std::string dir = test::temp_dir("stop-ranks");
  test::write_pairs(dir, "train.jsonl", 24, 7);
  for (const std::string phase : {"precomputing", "tokenizing"}) {
    INFO(phase);
    const std::string out = dir + "/" + phase;
    const std::vector<std::string> flags =
        dpo_flags(dir, {"--deepspeed", test::stage_json(3), "--output_dir", out});
    test::run_ranks(2, "rank: stop before the first step", std::chrono::seconds(120),
                    {{"ZT_FLAGS", test::join_flags(flags)}, {"ZT_STOP_PHASE", phase}});
    CHECK_FALSE(fs::exists(out + "/checkpoint-0"));
  }
}
