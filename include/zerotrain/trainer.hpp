// zt::Trainer — a fine-tuning job end to end, as HF Trainer + DeepSpeed run it: the model (HF
// folder or an inline config), the fine-tuning method, JSONL data, the ZeRO engine, logging,
// evaluation, checkpoints with exact resume (also on another world size) and the final model.
//
// Collective-ness: the constructor, train() and evaluate() are collectives — every rank of the
// communicator calls them. cancel(), preempt() and StopRequest's methods may be called from any
// thread or a signal handler.
// Callbacks run on rank 0 only (on_step: every rank), on the thread that called the constructor
// or train().
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/grpo.hpp"

namespace zt {

/// One entry of the log history (HF's log_history keys, plus zerotrain's throughput and loss
/// scale). Training records have loss/learning_rate/grad_norm; evaluation records eval_loss.
struct LogRecord {
  int64_t step = 0;
  double epoch = 0.0;
  std::optional<double> loss, learning_rate, grad_norm, tokens_per_second, loss_scale;
  /// On CUDA: the most GPU memory LibTorch's allocator had allocated on any rank during the
  /// logging window, in GiB (torch.cuda.max_memory_allocated, reset after each record).
  std::optional<double> peak_memory_gib;
  std::optional<double> eval_loss;
  std::optional<double> train_loss, train_runtime;  ///< the final summary record
  /// Further named metrics, as TRL logs them (preference training: "rewards/chosen",
  /// "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
  /// "logps/rejected"; evaluation records prefix them with "eval_").
  std::map<std::string, double> metrics;
  /// One JSON object (a line of trainer_log.jsonl).
  std::string json() const;
};

/// Where a run stands after each optimizer step (for progress displays).
struct Progress {
  int64_t step = 0, total_steps = 0;
  double epoch = 0.0;
  double loss = 0.0;  ///< of the last logged window (0 before the first)
  double learning_rate = 0.0;
  double tokens_per_second = 0.0;  ///< real (non-padding) tokens of the whole job
  double eta_seconds = 0.0;
  /// Before the first step (the constructor, and train() until its first step), a long phase as
  /// it goes: `phase` names it ("tokenizing training data 'train.jsonl'", "loading the weights",
  /// "loading and quantizing the weights", "precomputing the reference"), `phase_done` of
  /// `phase_total` `phase_unit`s ("MiB", "M values", "batches") are done, at `phase_rate` of
  /// them per second; eta_seconds is the phase's time left, the other fields above are 0.
  /// `phase` is empty after every optimizer step.
  std::string phase, phase_unit;
  double phase_done = 0.0, phase_total = 0.0, phase_rate = 0.0;
};

/// What one step did, the same on every rank (the C API's zt_step_stats).
struct StepStats {
  int64_t global_step = 0;  ///< optimizer steps completed so far
  bool stepped = false;     ///< this call ended an accumulation window and stepped
  bool skipped = false;     ///< that step was skipped (fp16 overflow)
  double loss =
      0.0;  ///< the micro-batch's (train_step) or the step's (train) mean token loss over all ranks
  double grad_norm = 0.0;      ///< global norm before clipping; valid when stepped
  double learning_rate = 0.0;  ///< of the last step
  double loss_scale = 1.0;     ///< 1 unless fp16
};

/// What a GRPO step did (Trainer::train_grpo_step), the same on every rank: StepStats (`loss`
/// the step's GRPO loss, summed over its micro-batches as TRL's) and the step's metrics under
/// TRL's names (reward, reward_std, rewards/<name>/mean and /std, frac_reward_zero_std,
/// completions/mean_length, min_length, max_length, clipped_ratio, mean_terminated_length,
/// min_terminated_length, max_terminated_length, kl with beta, clip_ratio/low_mean,
/// high_mean, region_mean, low_min, high_max or cispo_clip_ratio).
struct GrpoStepStats : StepStats {
  std::map<std::string, double> metrics;
  /// This rank's completions as text, prompt by prompt (prompt i's at i·G ... i·G + G − 1).
  std::vector<std::string> completions;
  /// Their rewards, weighted and summed over the functions (NaN: none scored it).
  std::vector<double> rewards;
};

/// A request to stop a run, shared by the host and its Trainer (TrainerCallbacks::stop). The
/// run polls it between optimizer steps and, in the phases before the first step (tokenizing
/// the data, loading and quantizing the weights, precomputing the reference), after every batch
/// of records, weight read or scored batch, so a stop asked there takes effect within seconds
/// (docs/trainer.md, "Stopping"). A host that makes one before constructing the Trainer — and
/// installs its signal handlers then — can stop the constructor too; Trainer::cancel and
/// Trainer::preempt ask through the same object.
/// Thread-safety: lock-free atomics; every method may be called from any thread or a signal
/// handler. Each rank has its own: the ranks agree on a stop asked on any of them.
class StopRequest {
 public:
  /// Stop without saving (SIGINT): at the next optimizer step boundary; before the first
  /// step, within the phase running.
  void cancel() noexcept { cancel_.store(true); }
  /// Save a checkpoint at the next optimizer step boundary, then stop (a scheduler's SIGTERM /
  /// SIGUSR1 before preemption). Before the first step there is nothing to save: the phase
  /// running stops. `signal` is reported by Trainer::preempted_by(); <= 0 counts as SIGTERM.
  void preempt(int signal) noexcept;
  bool cancelled() const noexcept { return cancel_.load(); }
  /// The signal of the last preempt(), else 0.
  int preempt_signal() const noexcept { return preempt_.load(); }

 private:
  std::atomic<bool> cancel_{false};
  std::atomic<int> preempt_{0};
};

struct TrainerCallbacks {
  std::function<void(const LogRecord&)> on_log;  ///< rank 0: every record, as it is written
  /// Rank 0: after every optimizer step, and during each long phase before the first step
  /// (Progress::phase) at every batch of records, weight read or scored batch.
  std::function<void(const Progress&)> on_progress;
  /// Every rank, after every optimizer step of train(), with the same stats everywhere.
  std::function<void(const StepStats&)> on_step;
  /// The stop request this rank's run polls (every rank). Null: the Trainer makes its own.
  /// Shared: the host keeps its pointer to ask for a stop from a signal handler or another
  /// thread, also before the constructor returns.
  std::shared_ptr<StopRequest> stop;
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
/// The same for a job described explicitly (hosts that do not use a launcher).
std::shared_ptr<Communicator> join_training_job(const TrainingArguments& args,
                                                const LaunchEnv& env);

class Trainer {
 public:
  /// Validates the arguments and the output folder, loads the model, tokenizer and data
  /// (rank 0 tokenizes into the cache, the others read it), applies the fine-tuning method,
  /// builds the engine and, with resume_from_checkpoint, restores the checkpoint. Errors are
  /// thrown on every rank: the rank at fault throws its own, the others a DistributedError
  /// naming it. A stop asked through `callbacks.stop` while it runs is a CancelledError on
  /// every rank, saying which phase it stopped and that nothing was saved. Collective.
  Trainer(TrainingArguments args, std::shared_ptr<Communicator> comm,
          TrainerCallbacks callbacks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Trains to max_steps / num_train_epochs, logging, evaluating and saving as configured,
  /// then writes the final model into output_dir. Throws CancelledError after a stop (cancel(),
  /// preempt(), TrainerCallbacks::stop), also one asked while the reference is precomputed
  /// before the first step. The final record's train_runtime counts from the constructor, its
  /// phases included. Collective.
  TrainResult train();
  /// The token-weighted mean loss over eval_file. Collective.
  double evaluate();
  /// Asks the run to stop at the next optimizer step (every rank agrees on which), or before
  /// the first step within the phase running (StopRequest::cancel on the run's request).
  void cancel();
  /// Asks the run to save a checkpoint at the next optimizer step boundary and then stop, as a
  /// scheduler's SIGTERM / SIGUSR1 before preemption asks; train() then throws CancelledError
  /// naming the checkpoint — before the first step, saying that nothing was saved. `signal` is
  /// kept for preempted_by(). Lock-free: callable from a signal handler or any thread.
  void preempt(int signal);
  /// The signal of the preempt() that stopped train() (the agreed one on every rank), else 0.
  int preempted_by() const;

  /// One micro-batch given by the caller, for hosts that bring their own data: `input_ids`
  /// [batch, seq] int64 on this rank; `labels` the same shape (-100 ignored), or undefined for a
  /// copy of the ids; the causal shift is applied inside, as HF's loss. Steps the optimizer at
  /// the accumulation boundary. Gradients are normalized by the whole window's counted tokens
  /// over all ranks (known only at the boundary, applied there), so equal global batches give
  /// equal results whatever the ZeRO stage, world size or split. Ids outside the vocabulary and
  /// malformed shapes are InvalidArgument (on the rank that gave them; the others fail in the
  /// next collective). With sequence_parallel_size > 1 the ranks of a group give the same
  /// micro-batch (each trains its share of the positions; docs/long_context.md). Collective.
  StepStats train_step(const at::Tensor& input_ids, const at::Tensor& labels = {});
  /// One micro-batch of preference pairs given by the caller, in a run with stage dpo:
  /// `chosen_ids` / `rejected_ids` [pairs, seq] int64, each row the prompt and an answer,
  /// right-padded; `chosen_labels` / `rejected_labels` the same shapes with -100 on the prompt
  /// and the padding (the answer's tokens are scored; the shift is applied inside). The loss is
  /// the run's pref_loss against the reference (the model with its adapters off; a run whose
  /// reference is precomputed, rpo_alpha, and stage kto take train_file's data only:
  /// InvalidArgument).
  /// Steps at the accumulation boundary; normalized by the window's pairs over all ranks, so
  /// equal global batches give equal steps. StepStats::loss is the micro-batch's mean pair loss
  /// over all ranks. Collective.
  StepStats train_preference_step(const at::Tensor& chosen_ids, const at::Tensor& chosen_labels,
                                  const at::Tensor& rejected_ids,
                                  const at::Tensor& rejected_labels);
  /// One GRPO step (stage grpo; docs/grpo.md) over prompts the host gives: this rank's
  /// `prompts` (per_device_train_batch_size × gradient_accumulation_steps / num_generations,
  /// the same count on every rank), each completed num_generations times by the model trained
  /// (the run's temperature, top_p, top_k, min_p, repetition_penalty; up to
  /// max_completion_length tokens, ending at the tokenizer's and config's end tokens), scored by
  /// `rewards` (reward_weights), advantages taken in each prompt's group, one optimizer step on
  /// the run's loss_type over micro-batches of per_device_train_batch_size completions. Samples
  /// depend on the seed, step and index in the global batch (rank-major), not the world size.
  /// Bad prompts (empty, ids outside the vocabulary, too long for the context), a wrong count
  /// and a failing reward function (named) are errors before the update. ZeRO-3 gathers the
  /// units once for the generation (Engine::hold_units). num_iterations μ > 1: every μ-th call
  /// generates, the μ − 1 after it (same prompts) train again on its completions, the ratio to
  /// the sampling policy, their stats without completions, rewards or generation metrics. Not
  /// with expert parallelism yet. Collective.
  GrpoStepStats train_grpo_step(const std::vector<GrpoPrompt>& prompts,
                                const std::vector<RewardFunction>& rewards);
  /// Adds a reward function to those train() scores a grpo run's completions with: after the
  /// options' reward_funcs and reward_command, in the order added (reward_weights, when given,
  /// has one weight per function in that order). `reward.fn` is called on the thread that runs
  /// train(), once per step with this rank's completions; what it throws stops the run, its
  /// class kept (a CancelledError stays one), the message naming the function, and the other
  /// ranks at once with a DistributedError naming this rank (the ranks agree after scoring, so
  /// none waits out a timeout while this rank's process lives on). Every rank adds
  /// the same functions in the same order (train() checks the count). A run of another stage, a
  /// function that is empty, a name already there or not 1 to 64 letters, digits, '_', '-', '.' or
  /// ':' (the metrics' keys): InvalidArgument. Between calls; not
  /// collective.
  void add_reward(RewardFunction reward);
  /// The token-weighted mean loss over batches every rank gives (the same number of batches on
  /// every rank; an empty list on all is an InvalidArgument), without changing the model.
  /// Collective.
  double evaluate_batches(const std::vector<std::pair<at::Tensor, at::Tensor>>& batches);
  /// Writes one complete checkpoint folder at `dir` (atomically; an existing folder is an
  /// IoError), resumable by load_checkpoint or resume_from_checkpoint. Collective.
  void save_checkpoint(const std::string& dir);
  /// Restores a checkpoint (optimizer state, counters, random state, data position), also one
  /// saved at another world size. Collective.
  void load_checkpoint(const std::string& dir);
  /// Writes the model as the end of train() does: PEFT adapter files, or an HF model folder.
  /// Collective (ZeRO-3 gathers).
  void export_model(const std::string& dir);

  int rank() const;
  int world_size() const;

  /// Replaces the callbacks (between calls; not while train() runs). A null `stop` keeps the
  /// run's stop request (what cancel() and preempt() asked stays asked).
  void set_callbacks(TrainerCallbacks callbacks);

  /// The resolved arguments (batch sizes, precision... after "auto" resolution).
  const TrainingArguments& arguments() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
