// zerotrain train: the seed's `torchrun ... train.py --deepspeed ds.json ...` command as is.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <mutex>

#include "commands.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/trainer.hpp"

namespace zt::cli {
namespace {

std::atomic<Trainer*> g_trainer{nullptr};

// First SIGINT: stop at the next optimizer step (every rank agrees). SIGTERM / SIGUSR1 (what
// schedulers send before preempting a job): save a checkpoint there first. A second signal ends
// the process at once.
extern "C" void on_signal(int sig) {
  if (Trainer* t = g_trainer.load()) {
    if (sig == SIGINT) {
      t->cancel();
    } else {
      t->preempt(sig);
    }
  }
  std::signal(sig, SIG_DFL);
}

void print_help() {
  std::printf(
      "usage: zerotrain train [--options FILE.json] [--NAME VALUE ...]\n\n"
      "HF TrainingArguments names (the same in FILE.json, whose values the flags override), plus\n"
      "zerotrain's data and fine-tuning options. Under torchrun / mpirun / srun each process is "
      "one\n"
      "rank; `zerotrain launch --nproc_per_node N -- zerotrain train ...` starts N local "
      "ranks.\n\n");
  std::vector<OptionHelp> options = training_option_help();
  size_t width = 0;
  for (const OptionHelp& o : options) width = std::max(width, o.name.size());
  for (const OptionHelp& o : options) {
    std::string def = o.default_value.empty() ? "" : " [default: " + o.default_value + "]";
    std::printf("  --%-*s  %s%s\n", static_cast<int>(width), o.name.c_str(), o.help.c_str(),
                def.c_str());
  }
}

// A live progress line on a terminal; log messages clear it and it is drawn again after them.
class ProgressLine {
 public:
  ProgressLine() {
    set_log_sink([this](LogLevel level, const std::string& message) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!line_.empty()) std::fputs("\r\033[K", stderr);
      std::fprintf(stderr, "[zerotrain %s] %s\n", log_level_name(level), message.c_str());
      if (!line_.empty()) std::fputs(line_.c_str(), stderr);
      std::fflush(stderr);
    });
  }
  ~ProgressLine() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!line_.empty()) std::fputs("\n", stderr);
    set_log_sink(nullptr);
  }
  void show(const Progress& p) {
    const int width = 24;
    const int filled = static_cast<int>(width * p.step / std::max<int64_t>(1, p.total_steps));
    const long eta = static_cast<long>(p.eta_seconds);
    std::lock_guard<std::mutex> lock(mutex_);
    line_ = "\r" + std::string(static_cast<size_t>(filled), '#') +
            std::string(static_cast<size_t>(width - filled), '.') + " " + std::to_string(p.step) +
            "/" + std::to_string(p.total_steps);
    // No loss is shown before the first logged window (0.0000 would read as a perfect fit).
    char loss[32] = " | loss -";
    if (p.loss != 0.0) std::snprintf(loss, sizeof loss, " | loss %.4f", p.loss);
    char tail[160];
    std::snprintf(tail, sizeof tail,
                  " | epoch %.2f%s | lr %.2e | %.0f tokens/s | ETA %ld:%02ld:%02ld", p.epoch, loss,
                  p.learning_rate, p.tokens_per_second, eta / 3600, eta / 60 % 60, eta % 60);
    line_ += tail;
    std::fputs("\r\033[K", stderr);
    std::fputs(line_.c_str(), stderr);
    std::fflush(stderr);
  }

 private:
  std::mutex mutex_;
  std::string line_;
};

std::string fmt_rank(int rank) {
  return "rank " + std::to_string(rank) + ": ";
}

}  // namespace

TrainingArguments parse_training_command(const Args& argv) {
  TrainingArguments args;
  Args flags;
  // --options FILE.json first, wherever it stands; the flags override its values.
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string file;
    if (argv[i] == "--options") {
      if (i + 1 >= argv.size()) throw ConfigError("--options needs a file");
      file = argv[++i];
    } else if (argv[i].rfind("--options=", 0) == 0) {
      file = argv[i].substr(10);
    } else {
      flags.push_back(argv[i]);
      continue;
    }
    apply_training_file(args, file);
  }
  std::vector<std::string> rest = apply_training_flags(args, flags);
  if (!rest.empty())
    throw ConfigError("zerotrain train: unexpected argument '" + rest[0] +
                      "'; options are --NAME VALUE");
  return args;
}

int cmd_train(const Args& argv) {
  if (wants_help(argv)) {
    print_help();
    return 0;
  }
  TrainingArguments args = parse_training_command(argv);
  if (args.train_file.empty()) {
    throw ConfigError(
        "no --train_file given: zerotrain train needs training data (a JSONL file or a JSON array "
        "file; docs/data.md lists the layouts)");
  }
  std::shared_ptr<Communicator> comm = join_training_job(args);
  std::unique_ptr<ProgressLine> progress;
  TrainerCallbacks callbacks;
  if (comm->rank() == 0 && !args.disable_tqdm && ::isatty(STDERR_FILENO)) {
    progress = std::make_unique<ProgressLine>();
    callbacks.on_progress = [p = progress.get()](const Progress& pr) { p->show(pr); };
  }
  Trainer trainer(args, comm, callbacks);
  g_trainer.store(&trainer);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) std::signal(sig, on_signal);
  struct Reset {
    ~Reset() {
      g_trainer.store(nullptr);
      for (int sig : {SIGINT, SIGTERM, SIGUSR1}) std::signal(sig, SIG_DFL);
    }
  } reset;
  TrainResult result;
  try {
    result = trainer.train();
  } catch (const CancelledError& e) {
    if (trainer.preempted_by() == 0) throw;  // cancelled (SIGINT): main's status 130
    // Saved and stopped for a signal: the status a process ended by it has (128 + signal).
    std::fprintf(stderr, "%s%s\n", comm->world_size() > 1 ? fmt_rank(comm->rank()).c_str() : "",
                 e.what());
    return 128 + trainer.preempted_by();
  }
  progress.reset();
  if (comm->rank() == 0) {
    // Where the weights are: the output folder, or (ZeRO-3 without 16-bit gathering) only the
    // sharded checkpoint, which `zerotrain merge` consolidates.
    std::error_code ec;
    const bool whole =
        std::filesystem::exists(result.output_dir + "/model.safetensors", ec) ||
        std::filesystem::exists(result.output_dir + "/model.safetensors.index.json", ec) ||
        std::filesystem::exists(result.output_dir + "/adapter_model.safetensors", ec);
    const std::string where =
        whole ? "model in " + result.output_dir
              : fmt::format(
                    "the weights stay sharded in {}/checkpoint-{}: run `zerotrain merge {} "
                    "OUT` for a model folder",
                    result.output_dir, result.global_step, result.output_dir);
    std::printf(
        "trained %lld steps: train_loss %.4f%s; %s\n", static_cast<long long>(result.global_step),
        result.train_loss,
        result.eval_loss ? (", eval_loss " + std::to_string(*result.eval_loss)).c_str() : "",
        where.c_str());
  }
  return 0;
}

}  // namespace zt::cli
