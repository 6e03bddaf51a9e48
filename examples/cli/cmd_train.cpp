// zerotrain train: the seed's `torchrun ... train.py --deepspeed ds.json ...` command as is.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <mutex>

#include "commands.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/trainer.hpp"

namespace zt::cli {
namespace {

std::atomic<StopRequest*> g_stop{nullptr};

// First SIGINT: stop at the next optimizer step (every rank agrees). SIGTERM / SIGUSR1 (what
// schedulers send before preempting a job): save a checkpoint there first. Before the first
// step either ends the phase running (tokenizing, loading the weights, precomputing the
// reference) within seconds. A second signal ends the process at once.
extern "C" void on_signal(int sig) {
  if (StopRequest* stop = g_stop.load()) {
    if (sig == SIGINT) {
      stop->cancel();
    } else {
      stop->preempt(sig);
    }
  }
  std::signal(sig, SIG_DFL);
}

// "12" for whole numbers, "3.1" otherwise.
std::string amount(double v) {
  char text[32];
  std::snprintf(text, sizeof text, v == std::floor(v) ? "%.0f" : "%.1f", v);
  return text;
}

void print_help() {
  std::printf(
      "usage: zerotrain train [CONFIG.yaml] [--options FILE.json] [--NAME VALUE | NAME=VALUE]"
      "...\n\n"
      "HF TrainingArguments names (the same in CONFIG.yaml and FILE.json — LLaMA-Factory's\n"
      "configs as they are — whose values the options on the line override), plus\n"
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
    if (!p.phase.empty()) {
      show_phase(p);
      return;
    }
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
  // A phase before the first step: "precomputing the reference: 12/40 batches | 2.5 batches/s |
  // ETA 0:00:11".
  void show_phase(const Progress& p) {
    const long eta = static_cast<long>(p.eta_seconds);
    std::string text = "\r" + p.phase + ": " + amount(p.phase_done);
    if (p.phase_total > 0) text += "/" + amount(p.phase_total);
    text += " " + p.phase_unit;
    char tail[128];
    std::snprintf(tail, sizeof tail, " | %.3g %s/s", p.phase_rate, p.phase_unit.c_str());
    text += tail;
    if (p.phase_total > 0) {
      std::snprintf(tail, sizeof tail, " | ETA %ld:%02ld:%02ld", eta / 3600, eta / 60 % 60,
                    eta % 60);
      text += tail;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    line_ = text;
    std::fputs("\r\033[K", stderr);
    std::fputs(line_.c_str(), stderr);
    std::fflush(stderr);
  }

  std::mutex mutex_;
  std::string line_;
};

std::string fmt_rank(int rank) {
  return "rank " + std::to_string(rank) + ": ";
}

// An options file named first on the line: a YAML or JSON file, as LLaMA-Factory's CLI takes.
bool is_options_file(const std::string& token) {
  auto ends_with = [&](const char* ext) {
    const std::string e(ext);
    return token.size() > e.size() && token.compare(token.size() - e.size(), e.size(), e) == 0;
  };
  return token.rfind("-", 0) != 0 &&
         (ends_with(".yaml") || ends_with(".yml") || ends_with(".json"));
}

// LLaMA-Factory's (OmegaConf's) override NAME=VALUE: a name of letters, digits and '_', then '='.
bool is_name_value(const std::string& token) {
  const size_t eq = token.find('=');
  if (eq == std::string::npos || eq == 0) return false;
  for (size_t i = 0; i < eq; ++i) {
    const char c = token[i];
    const bool ok = c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

}  // namespace

TrainingArguments parse_training_command(const Args& argv) {
  TrainingArguments args;
  Args flags;
  // LLaMA-Factory's form: `zerotrain train CONFIG.yaml` (or .yml, .json) as the first argument;
  // then --options FILE wherever it stands. The options on the line override the files', given
  // as --NAME VALUE or as LLaMA-Factory's NAME=VALUE.
  size_t first = 0;
  if (!argv.empty() && is_options_file(argv[0])) {
    apply_training_file(args, argv[0]);
    first = 1;
  }
  for (size_t i = first; i < argv.size(); ++i) {
    std::string file;
    if (argv[i] == "--options") {
      if (i + 1 >= argv.size()) throw ConfigError("--options needs a file");
      file = argv[++i];
    } else if (argv[i].rfind("--options=", 0) == 0) {
      file = argv[i].substr(10);
    } else {
      const bool after_flag = !flags.empty() && flags.back().rfind("--", 0) == 0 &&
                              flags.back().find('=') == std::string::npos;
      flags.push_back(!after_flag && is_name_value(argv[i]) ? "--" + argv[i] : argv[i]);
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
  if (args.train_file.empty() && args.dataset.empty()) {
    throw ConfigError(
        "no --train_file given: zerotrain train needs training data (a JSONL file or a JSON array "
        "file; docs/data.md lists the layouts), or --dataset with dataset_info.json's names");
  }
  std::shared_ptr<Communicator> comm = join_training_job(args);
  std::unique_ptr<ProgressLine> progress;
  TrainerCallbacks callbacks;
  if (comm->rank() == 0 && !args.disable_tqdm && ::isatty(STDERR_FILENO)) {
    progress = std::make_unique<ProgressLine>();
    callbacks.on_progress = [p = progress.get()](const Progress& pr) { p->show(pr); };
  }
  // The handlers go in before the Trainer exists: its constructor's phases (tokenizing,
  // loading and quantizing the weights) stop on a signal too.
  callbacks.stop = std::make_shared<StopRequest>();
  g_stop.store(callbacks.stop.get());
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) std::signal(sig, on_signal);
  struct Reset {
    ~Reset() {
      g_stop.store(nullptr);
      for (int sig : {SIGINT, SIGTERM, SIGUSR1}) std::signal(sig, SIG_DFL);
    }
  } reset;
  std::unique_ptr<Trainer> trainer;
  TrainResult result;
  try {
    trainer = std::make_unique<Trainer>(args, comm, callbacks);
    result = trainer->train();
  } catch (const CancelledError& e) {
    // The signal that stopped the run (a stop in the constructor: the one this rank caught).
    const int signal = trainer ? trainer->preempted_by() : callbacks.stop->preempt_signal();
    if (signal == 0) throw;  // cancelled (SIGINT): main's status 130
    // Saved and stopped (or stopped before the first step) for a signal: the status a process
    // ended by it has (128 + signal).
    progress.reset();
    std::fprintf(stderr, "%s%s\n", comm->world_size() > 1 ? fmt_rank(comm->rank()).c_str() : "",
                 e.what());
    return 128 + signal;
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
    // What to do next with it: ask it something, or fold an adapter into its base.
    const bool adapter =
        std::filesystem::exists(result.output_dir + "/adapter_model.safetensors", ec);
    const std::string merged = result.output_dir + "-merged";
    if (!whole) {
      std::printf("next: zerotrain merge '%s' '%s', then zerotrain verify '%s' --prompt \"...\"\n",
                  result.output_dir.c_str(), merged.c_str(), merged.c_str());
    } else if (adapter) {
      std::printf(
          "next: zerotrain verify '%s' --prompt \"...\" (the adapter over its base), or "
          "zerotrain merge '%s' '%s' for one model folder\n",
          result.output_dir.c_str(), result.output_dir.c_str(), merged.c_str());
    } else {
      std::printf("next: zerotrain verify '%s' --prompt \"...\"\n", result.output_dir.c_str());
    }
  }
  return 0;
}

}  // namespace zt::cli
