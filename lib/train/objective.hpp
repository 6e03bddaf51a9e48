// What a training stage trains: the next-token loss (stages sft and pt), preference pairs (dpo
// and its losses), unpaired examples (kto) or GRPO's sampled completions (grpo). Each objective
// owns the terms its losses take from a whole global batch, its micro-batch forward, the
// reference it scores against and its metric window; the loop (loop.cpp), the evaluation, the
// host's own batches (host_batches.cpp) and checkpoints drive any of them through this
// interface. Set-up (trainer.cpp) makes the run's objective from its stage (make_objective)
// once the options are checked, before any data is read.
//
// The objectives: the next-token loss here (objective.cpp); pairs and unpaired examples in
// preference_objective.cpp; GRPO in grpo_loop.cpp. Each runs on the trainer's thread, and every
// method said to be collective is called by every rank in the same order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "train/trainer_impl.hpp"

namespace zt::train {

/// Which data a forward reads: the training data, the evaluation data, or the evaluation data
/// for a forward that only takes part in a collective (a rank with no batch left under
/// ZeRO-3), whose loss and metrics are not counted.
enum class Split { kTrain, kEval, kEvalUncounted };

class Objective {
 public:
  explicit Objective(Trainer::Impl& trainer) : t_(trainer) {}
  virtual ~Objective();
  Objective(const Objective&) = delete;
  Objective& operator=(const Objective&) = delete;

  /// What a sample is, plural, for messages: "examples", "pairs", "KTO examples",
  /// "completions".
  virtual const char* sample_name() const = 0;

  // ---- set-up (trainer.cpp)

  /// The samples of dataset `d` (tokenized from `path`): its sequences, or the pairs (two
  /// sequences each) of preference data. IoError when `d` lacks what the objective reads.
  virtual int64_t samples_of(const Dataset& d, const std::string& path) const;
  /// Reads the run's data itself (GRPO's prompts: Impl::has_train, train_samples) and returns
  /// true; false when the trainer tokenizes train_file and eval_file into datasets.
  virtual bool load_own_data() { return false; }
  /// After the training data are read: the per-sample counts the batches take
  /// (Impl::train_lengths, train_targets), the samples packed into sequences where asked.
  virtual void index_training_data() {}
  /// Once the global batch is known (Impl::batch): ConfigError when the objective cannot
  /// split it (GRPO: steps_per_generation no multiple of the accumulation steps).
  virtual void check_global_batch() const {}
  /// Optimizer steps in an epoch of Impl::train_samples at the global batch (0: fewer samples
  /// than one batch with `drop_last`).
  virtual int64_t steps_per_epoch(bool drop_last) const;
  /// Whether the losses score against a reference: the model as the run starts.
  virtual bool uses_reference() const { return false; }
  /// Whether that reference is a table of log-probs computed before the first step (then the
  /// model itself is the reference while it is computed), given whether the run trains an
  /// adapter method. Decided once, at set-up, before the engine is built.
  virtual bool precomputes_reference(bool adapter_method) {
    (void)adapter_method;
    return false;
  }

  // ---- training (loop.cpp)

  /// When train() or evaluate() starts, before the run touches its output folder: what the
  /// objective must have to run at all (GRPO: reward functions, the same count on every rank).
  /// Collective.
  virtual void check_ready() {}
  /// Before the first step or evaluation, once the output folder is prepared: what must exist
  /// first (the precomputed reference, a phase that stops on request). Collective.
  virtual void prepare() {}
  /// Epoch `epoch`'s order of what steps draw from: the training samples (grouped by length
  /// with group_by_length, in megabatches of `megabatch`), or GRPO's prompts.
  virtual std::vector<int64_t> epoch_order(int64_t epoch, bool shuffle, int64_t megabatch) const;
  /// One optimizer step over the global batch at the epoch's position in `order`: by default
  /// this rank's micro-batches through begin_step and forward, normalized by the global
  /// batch's targets (HF's num_items_in_batch). Collective (the engine's step).
  virtual Trainer::Impl::StepResult step(const std::vector<int64_t>& order);
  /// A micro-batch's summed loss over `samples` of the `split`'s data, its metric sums kept for
  /// the logging window or the evaluation. Collective under ZeRO-3.
  virtual LossSum forward(const std::vector<int64_t>& samples, Split split) = 0;
  /// The logging window's metrics since the last call, which starts the next window (TRL's
  /// names). Collective.
  virtual std::map<std::string, double> take_window_metrics() { return {}; }

  // ---- evaluation (loop.cpp)

  /// One evaluation over the evaluation data, dropout off and without gradients: its loss, and
  /// its metrics kept for evaluation_metrics(). By default the token-weighted mean loss of this
  /// rank's batches (eval_batches) through begin_evaluation, forward and end_evaluation, every
  /// example once across ranks. Collective.
  virtual double evaluate();
  /// Before an evaluation over this rank's `batches` of the evaluation data: the terms its
  /// losses take from the whole set. Collective.
  virtual void begin_evaluation(const std::vector<std::vector<int64_t>>& batches) { (void)batches; }
  /// After the evaluation's batches: its metrics over every rank, kept for
  /// evaluation_metrics(). Collective.
  virtual void end_evaluation() {}
  /// The last evaluation's metrics ("eval_" names), as end_evaluation kept them.
  virtual std::map<std::string, double> evaluation_metrics() const { return {}; }

  // ---- the host's own batches (host_batches.cpp)

  /// InvalidArgument when the objective does not train from next-token batches (train_step).
  virtual void check_token_steps() const {}
  /// InvalidArgument when it does not train from the host's pairs (train_preference_step).
  virtual void check_pair_steps() const;
  /// The summed loss of the host's pairs: `ids` / `labels` [2 × pairs, seq], the chosen rows
  /// then the rejected ones. Only after check_pair_steps passed. Collective under ZeRO-3.
  virtual LossSum pair_loss(const at::Tensor& ids, const at::Tensor& labels);

  // ---- checkpoints (checkpointing.cpp, trainer.cpp's restore)

  /// Rank 0: what the objective keeps in a checkpoint beside the engine's state (the
  /// precomputed reference) into `dir`.
  virtual void write_state(const std::string& dir) const { (void)dir; }
  /// Reads it back from checkpoint `dir` on resume (IoError when it is missing or damaged).
  virtual void read_state(const std::string& dir) { (void)dir; }

  // ---- the reference model, for the objectives that score against one

  /// Without adapters that start as the base (and no precomputed table for full and freeze
  /// fine-tuning): the trainable parameters as they started, kept as this rank keeps its
  /// compute copy (ZeRO-3 shards it as it shards the policy) and swapped in for each reference
  /// forward. Set by set-up after the engine is built; null otherwise.
  std::unique_ptr<ParameterSnapshot> reference_weights;
  /// The reference's per-token log-probs of rows `ids` / `labels` ([rows, seq] fp32, 0 where
  /// labels are -100), the logits divided by `temperature` (GRPO's): the model with its
  /// adapters off, or with reference_weights swapped in; without dropout or gradients.
  /// Collective under ZeRO-3 (its forward).
  at::Tensor reference_token_log_probs(const at::Tensor& ids, const at::Tensor& labels,
                                       double temperature = 1.0);
  /// Their sums over each row's answer (with sequence parallelism: over this rank's positions).
  at::Tensor reference_log_probs(const at::Tensor& ids, const at::Tensor& labels) {
    return reference_token_log_probs(ids, labels).sum(1);
  }

  // ---- sequence parallelism (docs/long_context.md)

  /// Per-row values `rows` [n] summed over this rank's sequence-parallel group, whose members
  /// each scored their own positions of the same rows: the whole sequences' values. With
  /// autograd: backward sums the gradients over the group too, so a loss that every member
  /// computes alike from the sums and divides by the group's size trains as the whole
  /// sequences' loss once. `rows` itself without sequence parallelism; a collective of the
  /// whole job with it.
  at::Tensor sequence_sum(const at::Tensor& rows) const;
  /// `count` on the first member of this rank's sequence-parallel group, 0 on the others: a
  /// count of whole rows that the sums over ranks must see once.
  int64_t counted_once(int64_t count) const;

 protected:
  /// The default step's hook, before its micro-batches: the terms their losses take from the
  /// whole global batch, `samples` of every rank (the same on every rank), `mine` this rank's
  /// micro-batches, `divisor` the global batch's targets. Collective where the terms are.
  virtual void begin_step(const std::vector<int64_t>& samples,
                          const std::vector<std::vector<int64_t>>& mine, double divisor) {
    (void)samples;
    (void)mine;
    (void)divisor;
  }

  Trainer::Impl& t_;
};

/// A scoring pass's model state: dropout off (TRL's disable_dropout) and, for a reference that
/// is the model with its adapters off, the adapters off; whatever happens, restored after.
class ScoringMode {
 public:
  ScoringMode(CausalLM& model, bool adapters_off);
  ~ScoringMode();
  ScoringMode(const ScoringMode&) = delete;
  ScoringMode& operator=(const ScoringMode&) = delete;

 private:
  CausalLM& model_;
  bool training_;
};

/// The run's objective, by args.stage (sft and pt: the next-token loss). Called by set-up once
/// the options are checked; the objectives check their own options (ConfigError naming one).
std::unique_ptr<Objective> make_objective(Trainer::Impl& trainer);
/// Stages dpo (pairs) and kto (unpaired examples); preference_objective.cpp.
std::unique_ptr<Objective> make_preference_objective(Trainer::Impl& trainer);
/// Stage grpo; grpo_loop.cpp.
std::unique_ptr<Objective> make_grpo_objective(Trainer::Impl& trainer);

}  // namespace zt::train
