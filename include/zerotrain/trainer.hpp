// zt::Trainer — a fine-tuning job end to end, as HF Trainer + DeepSpeed run it: the model (HF
// folder or an inline config), the fine-tuning method, JSONL data, the ZeRO engine, logging,
// evaluation, checkpoints with exact resume (also on another world size) and the final model.
//
// Collective-ness: the constructor, train() and evaluate() are collectives — every rank of the
// communicator calls them. cancel() may be called from any thread or a signal handler.
// Callbacks run on rank 0 only, on the thread that called train().
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"

namespace zt {

/// One entry of the log history (HF's log_history keys, plus zerotrain's throughput and loss
/// scale). Training records have loss/learning_rate/grad_norm; evaluation records eval_loss.
struct LogRecord {
  int64_t step = 0;
  double epoch = 0.0;
  std::optional<double> loss, learning_rate, grad_norm, tokens_per_second, loss_scale;
  std::optional<double> eval_loss;
  std::optional<double> train_loss, train_runtime;  ///< the final summary record
  /// One JSON object (a line of trainer_log.jsonl).
  std::string json() const;
};

/// Where a run stands after each optimizer step (for progress displays).
struct Progress {
  int64_t step = 0, total_steps = 0;
  double epoch = 0.0;
  double loss = 0.0;               ///< of the last logged window (0 before the first)
  double learning_rate = 0.0;
  double tokens_per_second = 0.0;  ///< real (non-padding) tokens of the whole job
  double eta_seconds = 0.0;
};

struct TrainerCallbacks {
  std::function<void(const LogRecord&)> on_log;        ///< every record, as it is written
  std::function<void(const Progress&)> on_progress;    ///< after every optimizer step
};

struct TrainResult {
  int64_t global_step = 0;
  double train_loss = 0.0;  ///< mean of the step losses of this run
  std::optional<double> eval_loss;
  std::optional<std::string> best_checkpoint;
  std::string output_dir;
};

/// The communicator for a training job launched by torchrun / mpirun / srun (or a single
/// process): `args.device` auto picks cuda:LOCAL_RANK when CUDA is available, else the CPU;
/// the timeouts are ddp_timeout and rendezvous_timeout. Collective.
std::shared_ptr<Communicator> join_training_job(const TrainingArguments& args);

class Trainer {
 public:
  /// Validates the arguments and the output folder, loads the model, tokenizer and data
  /// (rank 0 tokenizes into the cache, the others read it), applies the fine-tuning method,
  /// builds the engine and, with resume_from_checkpoint, restores the checkpoint. Errors are
  /// thrown on every rank: the rank at fault throws its own, the others a DistributedError
  /// naming it. Collective.
  Trainer(TrainingArguments args, std::shared_ptr<Communicator> comm, TrainerCallbacks callbacks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Trains to max_steps / num_train_epochs, logging, evaluating and saving as configured,
  /// then writes the final model into output_dir. Throws CancelledError after cancel().
  /// Collective.
  TrainResult train();
  /// The token-weighted mean loss over eval_file. Collective.
  double evaluate();
  /// Asks the run to stop at the next optimizer step (every rank agrees on which).
  void cancel();

  /// The resolved arguments (batch sizes, precision... after "auto" resolution).
  const TrainingArguments& arguments() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
