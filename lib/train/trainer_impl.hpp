// The Trainer's state, shared by its parts: set-up (trainer.cpp), checkpoints and the final
// model (checkpointing.cpp), the host's own batches (host_batches.cpp) and the training loop
// with evaluation (loop.cpp) and its log window (log_window.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/agreement.hpp"
#include "train/log_window.hpp"
#include "train/phase_meter.hpp"
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
#include "zerotrain/grpo.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

namespace zt {

namespace train {
class Objective;
}

// The state is grouped by who writes it. What set-up decides (trainer.cpp's start and the
// argument check before it) is fixed afterwards: the other parts read it. The groups below
// the set-up part each name their writer.
struct Trainer::Impl {
  // ---- decided at set-up, read-only afterwards ----
  TrainingArguments args;
  std::shared_ptr<Communicator> comm;
  TrainerCallbacks callbacks;
  int rank = 0, world = 1;
  /// Ulysses sequence parallelism (check_sequence_parallel): groups of `sequence_parallel`
  /// consecutive ranks share each batch, so the data is split over `data_world` groups and this
  /// rank takes group `data_rank`'s (without it: world and rank). Gradients, ZeRO's shards and
  /// the sums over ranks stay the whole job's: each rank's losses cover its own positions.
  int64_t sequence_parallel = 1;
  int data_rank = 0, data_world = 1;
  DeepSpeedConfig ds;
  ModelConfig model_config;
  std::string model_dir;
  std::shared_ptr<Tokenizer> tokenizer;
  std::string template_source;  ///< why args.template_name (resolved from "auto") was chosen
  /// Rows of the training data that the template formatted, of all its rows (DatasetStats).
  int64_t templated_rows = 0, train_rows = 0;
  /// The template the training data went through, as checkpoints record it for `zerotrain
  /// verify`: args.template_name, or "raw" when it formatted no record (plain text, token ids).
  std::string applied_template() const {
    return train_rows > 0 && templated_rows == 0 ? std::string(kRawTemplate) : args.template_name;
  }
  int32_t pad_id = 0;
  Dataset train_data, eval_data;
  bool has_train = false, has_eval = false;
  std::vector<int64_t> train_targets;  ///< per training sample: labels that count (pairs: 1)
  std::vector<int64_t> train_lengths;  ///< per training sample: tokens (pairs: both sequences')
  /// Examples, or with preference data pairs (examples 2i and 2i + 1) or KTO's examples (2i,
  /// with its KL sequence 2i + 1), or GRPO's completions: what batches count.
  int64_t train_samples = 0, eval_samples = 0;
  /// What the run trains (objective.hpp): made from the stage by check_options, before any
  /// data is read; it owns its batch terms, forward, reference and metric window.
  std::unique_ptr<train::Objective> objective;
  /// The objective's name of a sample, plural, for messages ("examples", "pairs"...).
  const char* sample_name() const;
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

  /// The run's progress (trainer_state.json): loop.cpp and host_batches.cpp advance it step by
  /// step, checkpointing.cpp restores it on resume and records the best checkpoint.
  train::TrainerState state;

  /// The output folder as this run found and holds it (output_dir.cpp, at set-up; loop.cpp
  /// removes `superseded` once training starts). `resume`: the checkpoint resumed from;
  /// `superseded`: checkpoints newer than it, removed when the first step starts; `lock`: rank
  /// 0's exclusive lock on output_dir for the whole run, so a second run into the same folder is
  /// refused at once (the kernel drops it with the process, kill -9 included); `created`: this
  /// run made output_dir (abandon_output_dir may then remove it).
  struct RunDir {
    std::optional<std::string> resume;
    std::vector<std::string> superseded;
    std::optional<files::FileLock> lock;
    bool created = false;
  } run_dir;

  /// Requests from outside the loop: the host (TrainerCallbacks::stop, from any thread or a
  /// signal handler, also before the constructor returns) and Trainer::cancel / preempt write
  /// `asked` (never null); loop.cpp reads it between steps (check_cancel) and the phases before
  /// the first step after each unit of their work (stop_if_asked), agrees on it across ranks
  /// and records the agreed signal in `stop_signal` (Trainer::preempted_by).
  struct Requests {
    std::shared_ptr<StopRequest> asked;
    int stop_signal = 0;  ///< SIGTERM / SIGUSR1 asked to save and stop (preempt)
  } requests;
  /// When the constructor began: the run's runtime (train_runtime) counts its phases too.
  std::chrono::steady_clock::time_point created = std::chrono::steady_clock::now();

  /// The last evaluation (loop.cpp writes; checkpointing.cpp compares it with the best metric
  /// when it saves at that step).
  struct LastEval {
    std::optional<double> loss;
    int64_t step = -1;
  } last_eval;

  void lock_output_dir();
  /// After a failure before training starts: removes the lock file, and output_dir itself when
  /// this run created it (everything in it is then this run's). Never throws.
  void abandon_output_dir() noexcept;
  /// The constructor's work after the argument check: output_dir, model, data, engine, resume.
  void start();
  std::unique_ptr<train::TensorBoardWriter> tensorboard;  ///< rank 0, with report_to tensorboard

  void check_output_dir();
  void load_data();
  void plan_batches();
  void build_model_and_engine();
  /// The checks the options alone decide (method, quantization, stage and loss), before any
  /// data is read; makes `objective`.
  void check_options();
  /// sequence_parallel_size (the arguments', or the DeepSpeed config's) checked against the
  /// world, the model's heads and the run's stage and method; sets the data's ranks.
  void check_sequence_parallel();
  void check_machine_fits() const;
  void restore(const std::string& dir);
  void announce() const;

  // loop.cpp: train()'s phases
  struct StepResult {
    at::Tensor loss;     ///< the step's mean token loss on this rank (a device scalar)
    int64_t tokens = 0;  ///< the global batch's tokens
    bool epoch_end = false;
  };
  /// The steps' clock, for their rate and the time left (train_runtime counts from `created`).
  struct RunClock {
    std::chrono::steady_clock::time_point start;  ///< when the first step of train() began
    int64_t first_step = 0;  ///< the step train() started from (resumed runs: not 0)
  };
  void prepare_output_dir();
  /// One optimizer step over the global batch at the epoch's position in `order` (the
  /// objective's step), and the run's progress after it.
  StepResult run_step(const std::vector<int64_t>& order);
  /// What follows a step: callbacks, logging, progress, evaluation, checkpoints.
  void after_step(const StepResult& done, train::LogWindow& window, const RunClock& clock);
  /// With ZT_COMM_TIMELINE=PREFIX: appends the step's collectives as this rank's GPU timed them
  /// (Communicator::take_timeline) to PREFIX.rank<R>.jsonl. Not a collective.
  void write_comm_timeline(int64_t step);
  void log_window(train::LogWindow& window);  ///< collective
  /// train()'s log window: loop.cpp opens it with the run's loss before it (a resumed run's,
  /// state.train_loss_*); checkpointing.cpp saves the run's loss through the step it saves.
  std::optional<train::LogWindow> open_window;
  /// The run's loss through this step: `window`'s, its open steps summed over ranks (a
  /// collective while it has any).
  train::RunLoss run_loss(const train::LogWindow& window);
  void load_best_at_end();
  /// A PiSSA run's starting adapter into output_dir/pissa_init (collective; at step 0 only).
  void write_pissa_start();
  /// The final evaluation, summary record (train_runtime since `created`) and model.
  TrainResult finish_training(const train::LogWindow& window);
  /// Trainer::train() past its argument check: the epochs, then finish_training.
  TrainResult train();
  bool warned_past_max_steps = false;  ///< train_step past max_steps says so once
  /// Trainer::train_step's work.
  StepStats train_step(const at::Tensor& input_ids, const at::Tensor& labels);
  /// Trainer::train_preference_step's work.
  StepStats train_preference_step(const at::Tensor& chosen_ids, const at::Tensor& chosen_labels,
                                  const at::Tensor& rejected_ids,
                                  const at::Tensor& rejected_labels);
  /// The backward (normalized at the window's end by its count over all ranks), the optimizer
  /// step at the boundary and the step's stats, for a host micro-batch of `count` items
  /// (tokens or pairs) whose summed loss is `loss`.
  StepStats host_step(const LossSum& loss);
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
  /// What was asked, [cancel, preempting signal]: this rank's, or with `agree` the largest of
  /// every rank's (one all-reduce: then a collective).
  std::pair<bool, int> asked_to_stop(bool agree);
  /// A poll in the work of run_phase: CancelledError when a stop was asked on this rank (the
  /// phase's agreement then says what stopped, on every rank). Lock-free.
  void poll_stop() const;
  /// In a phase before this run's first step: throws the CancelledError of a stop asked on this
  /// rank — with `agree`, on any rank (a collective: each rank calls it as often) — `during`
  /// the phase ("while precomputing the reference (12 of 40 batches done)"), recording the
  /// agreed signal for preempted_by().
  void stop_if_asked(const std::string& during, bool agree);
  /// The error a stop before this run's first step ends with: by `signal` (0: cancelled),
  /// `during` what, and that no checkpoint was saved (a resumed run: where it can continue).
  CancelledError stopped_before_first_step(int signal, const std::string& during) const;
  /// A meter for a long phase before the first step (train::PhaseMeter): rank 0 reports it in
  /// the log and to on_progress.
  train::PhaseMeter phase_meter(std::string what, std::string unit, double total,
                                double scale) const;
  /// Runs `fn`, the work of phase `what` before the first step, on this rank, then agrees as
  /// on_every_rank does; its CancelledError (a stop seen at a poll_stop) ends `fn` there,
  /// and a stop asked on any rank ends the phase on every rank with the same error
  /// (stopped_before_first_step, `meter`'s position where given). Collective.
  void run_phase(const std::string& what, const train::PhaseMeter* meter,
                 const std::function<void()>& fn);
  /// The engine over `eo` (its source read and, with `quantizing`, quantized on this rank) as a
  /// stoppable phase with its progress (run_phase). Collective.
  void build_engine(EngineOptions eo, bool quantizing);
  /// The next-token losses of a batch the trainer made (sft, pt; packed rows with their
  /// document spans).
  LossSum forward(const Batch& b);
  double run_evaluation();
  double evaluate();  ///< run_evaluation, logged (Trainer::evaluate)
  void log(const LogRecord& record);
  void report_to_tensorboard(const LogRecord& record);
  void save_checkpoint();
  /// Rank 0, before a save: an IoError when the file system clearly lacks room for it.
  void check_disk_space(const std::string& what) const;
  void write_checkpoint(CheckpointWriter& writer, bool in_run);
  LossSum forward_tokens(const at::Tensor& ids, const at::Tensor& labels);
  /// The weights a user loads directly (adapter tensors or the whole model), gathered where the
  /// stage shards them; empty when none are written (ZeRO-3 without 16-bit gathering).
  /// Collective.
  std::vector<std::pair<std::string, at::Tensor>> user_weights(bool& available);
  void write_user_files(const std::string& dir, bool available,
                        const std::vector<std::pair<std::string, at::Tensor>>& weights);
  void write_rng_state(const std::string& dir) const;
  /// training_args.json: the resolved arguments and DeepSpeed config, and zerotrain's version
  /// (HF's training_args.bin is a pickle; this is its safe equivalent). Rank 0.
  void write_run_settings(const std::string& dir) const;
  void read_rng_state(const std::string& dir) const;
  /// Epochs done, fractional: the epoch index plus the steps taken in the current one.
  double epoch_progress() const;
  /// The largest peak allocation of any rank since the last call, in GiB (none off CUDA).
  /// Collective on CUDA.
  std::optional<double> window_peak_memory_gib();
};

}  // namespace zt
