// The Trainer's state, shared by its parts: set-up (trainer.cpp), checkpoints and the final
// model (checkpointing.cpp), the host's own batches (host_batches.cpp) and the training loop
// with evaluation (loop.cpp) and its log window (log_window.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/agreement.hpp"
#include "train/log_window.hpp"
#include "train/reporting.hpp"
#include "train/tensorboard.hpp"
#include "util/device_stats.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

namespace zt {

struct Trainer::Impl {
  TrainingArguments args;
  std::shared_ptr<Communicator> comm;
  TrainerCallbacks callbacks;
  int rank = 0, world = 1;
  DeepSpeedConfig ds;
  ModelConfig model_config;
  std::string model_dir;
  std::shared_ptr<Tokenizer> tokenizer;
  std::string template_source;  ///< why args.template_name (resolved from "auto") was chosen
  int32_t pad_id = 0;
  Dataset train_data, eval_data;
  bool has_train = false, has_eval = false;
  std::vector<int64_t> train_targets;  ///< per training example: labels that count
  std::vector<int64_t> train_lengths;
  std::shared_ptr<CausalLM> model;
  PeftConfig peft;
  bool adapter_method = false;
  ParameterCount parameters;
  int64_t non_embedding_parameters = 0;  ///< HF's total_flos counts 6 × these per token
  std::unique_ptr<Engine> engine;
  GlobalBatch batch;
  int64_t steps_per_epoch = 0, total_steps = 0;
  int64_t log_every = 0, eval_every = 0,
          save_every = 0;  ///< logging/eval/save_steps, ratios resolved
  uint64_t data_seed = 0;
  train::TrainerState state;
  std::optional<std::string> resume_dir;
  std::vector<std::string> superseded;  ///< checkpoints newer than resume_dir, removed at start
  /// Rank 0's exclusive lock on output_dir for the whole run: a second run into the same folder
  /// is refused at once (the kernel drops the lock with the process, kill -9 included).
  std::optional<files::FileLock> output_lock;
  bool created_output_dir = false;  ///< by lock_output_dir, for abandon_output_dir
  void lock_output_dir();
  /// After a failure before training starts: removes the lock file, and output_dir itself when
  /// this run created it (everything in it is then this run's). Never throws.
  void abandon_output_dir() noexcept;
  /// The constructor's work after the argument check: output_dir, model, data, engine, resume.
  void start();
  int stop_signal = 0;  ///< SIGTERM / SIGUSR1 asked to save and stop (preempt)
  std::atomic<int> preempt_requested{0};
  std::optional<double> last_eval_loss;
  std::unique_ptr<train::TensorBoardWriter> tensorboard;  ///< rank 0, with report_to tensorboard
  int64_t last_eval_step = -1;
  std::atomic<bool> cancel_requested{false};

  void check_output_dir();
  void load_data();
  void plan_batches();
  void build_model_and_engine();
  void check_machine_fits() const;
  void restore(const std::string& dir);
  void announce() const;

  // loop.cpp: train()'s phases
  struct StepResult {
    at::Tensor loss;     ///< the step's mean token loss on this rank (a device scalar)
    int64_t tokens = 0;  ///< the global batch's tokens
    bool epoch_end = false;
  };
  struct RunClock {
    std::chrono::steady_clock::time_point start;
    int64_t first_step = 0;  ///< the step train() started from (resumed runs: not 0)
  };
  void prepare_output_dir();
  /// One optimizer step over the global batch at the epoch's position in `order`.
  StepResult run_step(const std::vector<int64_t>& order);
  /// What follows a step: callbacks, logging, progress, evaluation, checkpoints.
  void after_step(const StepResult& done, train::LogWindow& window, const RunClock& clock);
  /// With ZT_COMM_TIMELINE=PREFIX: appends the step's collectives as this rank's GPU timed them
  /// (Communicator::take_timeline) to PREFIX.rank<R>.jsonl. Not a collective.
  void write_comm_timeline(int64_t step);
  void log_window(train::LogWindow& window);  ///< collective
  void load_best_at_end();
  TrainResult finish_training(const train::LogWindow& window, const RunClock& clock);
  /// Trainer::train() past its argument check: the epochs, then finish_training.
  TrainResult train();
  bool warned_past_max_steps = false;  ///< train_step past max_steps says so once
  /// Trainer::train_step's work.
  StepStats train_step(const at::Tensor& input_ids, const at::Tensor& labels);
  /// Runs `fn`; an error of this rank's own (not a DistributedError, which another rank's
  /// failure caused, nor an agreed cancel) is posted for the other ranks before it propagates,
  /// so that their errors name this rank (Communicator::post_failure).
  template <typename Fn>
  auto posting_failures(Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const DistributedError&) {
      throw;
    } catch (const CancelledError&) {
      throw;
    } catch (const std::exception& e) {
      comm->post_failure(e.what());
      throw;
    }
  }
  void check_cancel();
  LossSum forward(const Batch& b);
  double run_evaluation();
  double evaluate();  ///< run_evaluation, logged (Trainer::evaluate)
  void log(const LogRecord& record);
  void report_to_tensorboard(const LogRecord& record);
  void save_checkpoint();
  /// Rank 0, before a save: an IoError when the file system clearly lacks room for it.
  void check_disk_space(const std::string& what) const;
  void write_checkpoint(CheckpointWriter& writer, bool in_run);
  LossSum forward_tokens(const at::Tensor& ids, const at::Tensor& labels) {
    return model->loss(ids.to(comm->device()), labels, {}, 1024);
  }
  /// The weights a user loads directly (adapter tensors or the whole model), gathered where the
  /// stage shards them; empty when none are written (ZeRO-3 without 16-bit gathering).
  /// Collective.
  std::vector<std::pair<std::string, at::Tensor>> user_weights(bool& available);
  void write_user_files(const std::string& dir, bool available,
                        const std::vector<std::pair<std::string, at::Tensor>>& weights);
  void write_rng_state(const std::string& dir) const;
  /// training_args.json: the resolved arguments and DeepSpeed config, and zerotrain's version
  /// (HF's training_args.bin is a pickle; this is its safe equivalent). Rank 0.
  void write_run_settings(const std::string& dir) const {
    const std::string text = fmt::format(
        R"({{"zerotrain_version": "{}", "training_arguments": {}, "deepspeed_config": {}}})",
        ZT_VERSION_STRING, training_arguments_json(args), deepspeed_config_json(ds));
    files::write_atomic(dir + "/training_args.json",
                        json::dump(json::parse(text, "training_args.json"), true) + "\n");
  }
  void read_rng_state(const std::string& dir) const;
  double epoch_progress() const {
    return static_cast<double>(state.epoch_index) +
           static_cast<double>(state.steps_in_epoch) /
               static_cast<double>(std::max<int64_t>(1, steps_per_epoch));
  }
  // Collective on CUDA: the largest peak allocation of any rank since the last call, in GiB.
  std::optional<double> window_peak_memory_gib() {
    const at::Device device = comm->device();
    if (!device.is_cuda()) return std::nullopt;
    const int index = device.has_index() ? device.index() : 0;
    const double peak = comm::reduce_scalars(
        *comm, {static_cast<double>(device_stats::peak_allocated(index))}, ReduceOp::kMax)[0];
    device_stats::reset_peak(index);
    return peak / (1024.0 * 1024.0 * 1024.0);
  }
};

}  // namespace zt
