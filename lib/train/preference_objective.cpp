// Preference training's objectives (stages dpo and kto): one forward of a batch of pairs
// (chosen rows, then rejected rows) or of KTO's unpaired examples with the KL estimate of their
// global batch, the reference as the model the run starts from (or its log-probs computed
// before the first step and kept in checkpoints), and the metrics TRL logs.
#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model/blocks.hpp"
#include "train/objective.hpp"
#include "train/preference.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kReferenceFile = "ref_log_probs.safetensors";

// Where each row's answer counts: its labels after the causal shift, per row ([rows] float).
at::Tensor answer_tokens(const at::Tensor& labels, const at::Device& device) {
  return labels.narrow(1, 1, labels.size(1) - 1).ne(kIgnoreLabel).sum(1).to(at::kFloat).to(device);
}

// Adds a batch's metric sums to a running total kept where they were computed: the host reads
// them at logging time only (no sync per micro-batch).
void add_sums(at::Tensor& total, const at::Tensor& sums) {
  if (!total.defined()) total = at::zeros_like(sums);
  total.add_(sums);
}

// The dataset rows of `pairs` as one forward takes them: the chosen sequences (example 2p),
// then the rejected ones (2p + 1).
std::vector<int64_t> pair_rows(const std::vector<int64_t>& pairs) {
  std::vector<int64_t> rows;
  rows.reserve(2 * pairs.size());
  for (int64_t p : pairs) rows.push_back(2 * p);
  for (int64_t p : pairs) rows.push_back(2 * p + 1);
  return rows;
}

// The rows of unpaired examples `samples`: their sequences (2i), or their KL sequences.
std::vector<int64_t> unpaired_rows(const std::vector<int64_t>& samples, bool kl) {
  std::vector<int64_t> rows;
  rows.reserve(samples.size());
  for (int64_t i : samples) rows.push_back(2 * i + (kl ? 1 : 0));
  return rows;
}

// What the precomputed reference belongs to: the sequences' ids, as a 64-bit FNV-1a hash.
std::string data_fingerprint(const Dataset& d) {
  uint64_t h = 14695981039346656037ULL;
  for (int32_t id : d.flat_ids()) {
    h ^= static_cast<uint32_t>(id);
    h *= 1099511628211ULL;
  }
  return fmt::format("{:016x}-{}", h, d.size());
}

// The state both preference objectives share: the loss's options, the reference (online, or
// the table precomputed before the first step and kept in checkpoints), the metric window and
// the last evaluation's metrics.
class PreferenceObjective : public Objective {
 public:
  explicit PreferenceObjective(Trainer::Impl& trainer)
      : Objective(trainer), pref_(preference_options(trainer.args)) {
    const TrainingArguments& args = t_.args;
    if (model::decoder_spec(t_.model_config).router_aux_coef) {
      throw ConfigError(fmt::format(
          "'{}/config.json': output_router_logits: the load-balancing loss is added to the "
          "supervised (sft / pt) loss only so far; train stage {} with output_router_logits false",
          t_.model_dir, args.stage));
    }
    if (args.packing) {
      throw ConfigError(fmt::format(
          "packing: preference data are scored per sequence; train stage {} without packing",
          args.stage));
    }
    if (!pref_.uses_reference() && args.precompute_ref_log_probs.value_or(false) && t_.rank == 0) {
      log::warn(
          "precompute_ref_log_probs: pref_loss {} has no reference model, so there is nothing "
          "to precompute; the option does nothing",
          pref_.loss);
    }
  }

  // A preference dataset is its pairs' two sequences side by side (examples 2i, 2i + 1), or
  // KTO's examples each with its KL sequence, labelled.
  int64_t samples_of(const Dataset& d, const std::string& path) const override {
    if (d.size() % 2 != 0 ||
        (pref_.unpaired() && d.desirable().size() != static_cast<size_t>(d.size()))) {
      throw IoError(fmt::format(
          "the tokenized preference data of '{}' {}; remove its cache and tokenize "
          "again",
          path,
          d.size() % 2 != 0 ? "has an odd number of sequences" : "lack KTO's desirable labels"));
    }
    return d.size() / 2;
  }

  void index_training_data() override {
    // A sample counts once (the loss is a mean over pairs or examples); its length is both
    // sequences'.
    const Dataset& d = t_.train_data;
    const int64_t n = t_.train_samples;
    t_.train_lengths.resize(static_cast<size_t>(n));
    t_.train_targets.assign(static_cast<size_t>(n), 1);
    for (int64_t i = 0; i < n; ++i) {
      t_.train_lengths[static_cast<size_t>(i)] = d.length(2 * i) + d.length(2 * i + 1);
    }
  }

  bool uses_reference() const override { return pref_.uses_reference(); }

  bool precomputes_reference(bool adapter_method) override {
    // The reference: the model as it starts. A new LoRA or DoRA adapter starts as the base (B is
    // zero), so the model with its adapters off is it, at any step. Every other start —
    // PiSSA's factors over the residual, a continued adapter, a prompt encoder's first table,
    // full and freeze fine-tuning without the table — is a frozen copy of the trainable weights
    // as they start, sharded as the policy is and swapped in. The precomputed table is computed
    // from that same reference.
    precomputed_ =
        pref_.uses_reference() && t_.args.precompute_ref_log_probs.value_or(!adapter_method);
    return precomputed_;
  }

  void prepare() override {
    if (!precomputed_ || train_reference_.defined() || eval_reference_.defined()) return;
    if (t_.state.global_step > 0) {
      throw InvalidArgument(fmt::format(
          "the precomputed reference log-probs are missing at step {}: they are computed before "
          "the first step or read from the checkpoint resumed from",
          t_.state.global_step));
    }
    precompute();
  }

  std::map<std::string, double> take_window_metrics() override {
    std::map<std::string, double> out = metrics(window_sums_, "");
    window_sums_ = at::Tensor();
    if (window_kl_steps_ > 0) out["kl"] = window_kl_sum_ / static_cast<double>(window_kl_steps_);
    window_kl_sum_ = 0.0;
    window_kl_steps_ = 0;
    return out;
  }

  void begin_evaluation(const std::vector<std::vector<int64_t>>& batches) override {
    (void)batches;
    eval_sums_ = at::Tensor();
  }
  void end_evaluation() override { eval_metrics_ = metrics(eval_sums_, "eval_"); }
  std::map<std::string, double> evaluation_metrics() const override { return eval_metrics_; }

  void check_token_steps() const override {
    throw InvalidArgument(fmt::format(
        "train_step: a run with stage {} trains a preference loss, not next-token losses{}",
        t_.args.stage,
        pref_.unpaired()
            ? ""
            : ": give its pairs to train_preference_step (zt_trainer_train_pairs_step)"));
  }

  void write_state(const std::string& dir) const override {
    if (!precomputed_ || t_.rank != 0) return;
    std::vector<std::pair<std::string, at::Tensor>> tensors{{"train", train_reference_}};
    if (eval_reference_.defined()) tensors.emplace_back("eval", eval_reference_);
    save_safetensors(dir + "/" + kReferenceFile, tensors,
                     {{"format", "pt"},
                      {"train_data", data_fingerprint(t_.train_data)},
                      {"eval_data", t_.has_eval ? data_fingerprint(t_.eval_data) : ""}});
  }

  void read_state(const std::string& dir) override {
    if (!precomputed_) return;
    const std::string path = dir + "/" + kReferenceFile;
    if (!fs::exists(path)) {
      throw IoError(fmt::format(
          "checkpoint '{}' has no {}: this run scores against the reference log-probs computed "
          "before its first step, and the model has trained since, so they cannot be computed "
          "again; resume from a checkpoint of this run",
          dir, kReferenceFile));
    }
    SafetensorsFile f(path);
    const auto check = [&](const char* name, const Dataset& data, int64_t samples) {
      const auto it = f.metadata().find(std::string(name) + "_data");
      if (!f.contains(name) || it == f.metadata().end() || it->second != data_fingerprint(data)) {
        throw IoError(fmt::format(
            "'{}' holds the reference log-probs of other {} data than this run's; resume with "
            "the data the run started with",
            path, name));
      }
      const at::Tensor t = f.load(name);
      if (t.scalar_type() != at::kDouble || t.dim() != 1 || t.size(0) != 2 * samples ||
          !at::isfinite(t).all().item<bool>()) {
        throw IoError(
            fmt::format("'{}': tensor '{}' is not {} finite fp64 log-probs; the checkpoint "
                        "is damaged",
                        path, name, 2 * samples));
      }
      return t;
    };
    if (t_.has_train) train_reference_ = check("train", t_.train_data, t_.train_samples);
    if (t_.has_eval) eval_reference_ = check("eval", t_.eval_data, t_.eval_samples);
  }

 protected:
  const Dataset& data(bool eval) const { return eval ? t_.eval_data : t_.train_data; }
  // The precomputed reference of `rows` of the training or evaluation data, or undefined (the
  // reference then runs with each batch).
  at::Tensor table_rows(bool eval, const std::vector<int64_t>& rows) const {
    const at::Tensor& table = eval ? eval_reference_ : train_reference_;
    return table.defined() ? table.index_select(0, at::tensor(rows, at::kLong)) : at::Tensor();
  }
  // Where a forward of `split` adds its metric sums: the window's, the evaluation's, or nowhere.
  at::Tensor& sums(Split split) {
    return split == Split::kTrain ? window_sums_ : split == Split::kEval ? eval_sums_ : uncounted_;
  }

  // The metric sums over ranks as a record's named metrics (`prefix` "" or "eval_").
  // Collective.
  std::map<std::string, double> metrics(const at::Tensor& metric_sums, const std::string& prefix) {
    std::vector<double> local(static_cast<size_t>(metric_sums_size(pref_)), 0.0);
    if (metric_sums.defined()) {
      const at::Tensor host = metric_sums.to(at::kDouble).cpu();
      for (size_t k = 0; k < local.size(); ++k)
        local[k] = host[static_cast<int64_t>(k)].item<double>();
    }
    return preference_metrics(pref_, comm::reduce_scalars(*t_.comm, local), prefix);
  }

  PreferenceOptions pref_;
  /// With precompute_ref_log_probs: the reference's summed answer log-probs of every sequence
  /// of the training and evaluation pairs ([2 × pairs] fp64 on the host, in the datasets'
  /// order), computed once before the first step and kept in every checkpoint
  /// (ref_log_probs.safetensors). Undefined otherwise (the reference runs with each batch).
  bool precomputed_ = false;
  at::Tensor train_reference_, eval_reference_;
  /// This rank's metric sums since the last log (a device vector), and the evaluation's;
  /// KTO's z0 summed over the window's steps.
  at::Tensor window_sums_, eval_sums_, uncounted_;
  double window_kl_sum_ = 0.0;
  int64_t window_kl_steps_ = 0;
  std::map<std::string, double> eval_metrics_;

 private:
  // Scores every sequence of the training and evaluation data with the reference (the model
  // as it starts), a phase before the first step: its progress in batches (the same count on
  // every rank), and a stop asked on any rank ends it on every rank before the next batch (one
  // agreement per batch, as the forwards may be collective). A rank with no pair left still
  // runs a forward (ZeRO-3 forwards are collective), its result discarded.
  void precompute() {
    Trainer::Impl& I = t_;
    const auto batches = [&](int64_t samples) {
      return eval_batches(samples, I.data_world, I.data_rank, I.args.per_device_eval_batch_size);
    };
    const size_t total = (I.has_train ? batches(I.train_samples).size() : 0) +
                         (I.has_eval ? batches(I.eval_samples).size() : 0);
    const std::string phase = "precomputing the reference";
    PhaseMeter meter = I.phase_meter(phase, "batches", static_cast<double>(total), 1);
    int64_t done = 0;
    const auto score = [&](const Dataset& data, int64_t samples) {
      std::vector<double> local(static_cast<size_t>(2 * samples), 0.0);
      for (const std::vector<int64_t>& indices : batches(samples)) {
        I.stop_if_asked(fmt::format(" while {} ({})", phase, meter.position()), /*agree=*/true);
        const std::vector<int64_t> pairs = indices.empty() ? std::vector<int64_t>{0} : indices;
        const std::vector<int64_t> rows = pair_rows(pairs);
        const Batch b = collate(data, rows, I.pad_id);
        const at::Tensor logps =
            reference_log_probs(b.input_ids.to(I.comm->device()), b.labels).to(at::kDouble).cpu();
        meter.update(static_cast<double>(++done));
        if (indices.empty()) continue;
        for (size_t k = 0; k < rows.size(); ++k) {
          local[static_cast<size_t>(rows[k])] = logps[static_cast<int64_t>(k)].item<double>();
        }
      }
      return at::tensor(comm::reduce_scalars(*I.comm, local), at::kDouble);
    };
    if (I.has_train) train_reference_ = score(I.train_data, I.train_samples);
    if (I.has_eval) eval_reference_ = score(I.eval_data, I.eval_samples);
    meter.finish();
    if (I.rank == 0) {
      log::info("reference log-probs precomputed for {} training and {} evaluation {}",
                I.train_samples, I.has_eval ? I.eval_samples : 0, sample_name());
    }
  }
};

// Stage dpo: pairs, scored as a batch of their chosen rows then their rejected rows.
class PairedObjective final : public PreferenceObjective {
 public:
  using PreferenceObjective::PreferenceObjective;
  const char* sample_name() const override { return "pairs"; }

  void index_training_data() override {
    PreferenceObjective::index_training_data();
    // Per pair the chosen answer's scored tokens: rpo_alpha's token mean.
    const Dataset& d = t_.train_data;
    chosen_tokens_.resize(static_cast<size_t>(t_.train_samples));
    for (int64_t i = 0; i < t_.train_samples; ++i) {
      TokenView labels = d.labels(2 * i);
      int64_t n = 0;
      for (int64_t k = 1; k < labels.size; ++k) n += labels[k] != kIgnoreLabel;
      chosen_tokens_[static_cast<size_t>(i)] = n;
    }
  }

  LossSum forward(const std::vector<int64_t>& samples, Split split) override {
    const bool eval = split != Split::kTrain;
    const std::vector<int64_t> rows = pair_rows(samples);
    const Batch b = collate(data(eval), rows, t_.pad_id);
    return rows_loss(b.input_ids, b.labels, table_rows(eval, rows), eval ? 0.0 : nll_scale_,
                     sums(split));
  }

  void check_pair_steps() const override {
    if (precomputed_ || pref_.rpo_alpha > 0) {
      throw InvalidArgument(fmt::format(
          "train_preference_step: {} needs the pairs of train_file (train()); host pairs train "
          "with an adapter method's online reference or a reference-free loss, without "
          "rpo_alpha",
          precomputed_ ? "the precomputed reference" : "rpo_alpha"));
    }
  }

  LossSum pair_loss(const at::Tensor& ids, const at::Tensor& labels) override {
    at::Tensor unlogged;  // host pairs log no preference metrics
    return rows_loss(ids, labels, {}, 0.0, unlogged);
  }

 protected:
  void begin_step(const std::vector<int64_t>& samples,
                  const std::vector<std::vector<int64_t>>& mine, double divisor) override {
    (void)mine;
    // rpo_alpha's token mean over the global batch's chosen answers, scaled to the divisor
    // (its pairs).
    int64_t chosen = 0;
    for (int64_t i : samples) chosen += chosen_tokens_[static_cast<size_t>(i)];
    nll_scale_ = divisor / static_cast<double>(std::max<int64_t>(1, chosen));
  }

 private:
  // Pairs already made: `input_ids` / `labels` [2 × pairs, seq], the chosen rows then the
  // rejected ones; `reference` the precomputed log-probs of those rows (or undefined).
  LossSum rows_loss(const at::Tensor& input_ids, const at::Tensor& labels,
                    const at::Tensor& reference, double nll_scale, at::Tensor& metric_sums) {
    const int64_t n = input_ids.size(0) / 2;
    const at::Device device = t_.comm->device();
    const at::Tensor ids = input_ids.to(device);
    // Rows are right-padded: causal attention never reaches the padding, so no mask is needed.
    const at::Tensor counts = answer_tokens(labels, device);
    // With sequence parallelism each member scores its positions of every row: the rows'
    // sums over the group are the whole rows', and every member computes the same loss from
    // them, counted once over the group (sequence_sum, counted_once).
    at::Tensor ref;
    if (pref_.uses_reference()) {
      ref = reference.defined() ? reference.to(at::kFloat).to(device)
                                : sequence_sum(reference_log_probs(ids, labels));
    }
    at::Tensor mean_logits;
    const at::Tensor logps =
        sequence_sum(t_.model->label_log_probs(ids, labels, {}, 1024, {}, &mean_logits).sum(1));
    const PairLogProbs lp =
        split_pairs(logps, counts, sequence_sum(answer_logit_sums(mean_logits, labels)), ref);
    const PreferenceLosses losses = preference_losses(pref_, lp);
    at::Tensor sum = losses.loss.sum();
    if (pref_.rpo_alpha > 0) sum = sum - (pref_.rpo_alpha * nll_scale) * lp.chosen.sum();
    const double members = static_cast<double>(t_.sequence_parallel);
    add_sums(metric_sums, members == 1 ? losses.sums : losses.sums / members);
    return {members == 1 ? sum : sum / members, counted_once(n)};
  }

  std::vector<int64_t> chosen_tokens_;  ///< per training pair
  double nll_scale_ = 0.0;              ///< rpo_alpha's factor for the step: pairs / chosen tokens
};

// Stage kto: unpaired examples, each with its KL sequence (row 2i + 1), and the KL estimate z0
// of their whole global batch.
class UnpairedObjective final : public PreferenceObjective {
 public:
  using PreferenceObjective::PreferenceObjective;
  const char* sample_name() const override { return "KTO examples"; }

  void index_training_data() override {
    PreferenceObjective::index_training_data();
    if (t_.rank == 0) warn_unbalanced();
  }

  LossSum forward(const std::vector<int64_t>& samples, Split split) override {
    const bool eval = split != Split::kTrain;
    const std::vector<int64_t> rows = unpaired_rows(samples, false);
    const Dataset& d = data(eval);
    const Batch b = collate(d, rows, t_.pad_id);
    const at::Device device = t_.comm->device();
    const at::Tensor ids = b.input_ids.to(device);
    // With sequence parallelism the rows' sums over the group, every member's loss alike and
    // counted once (as the paired objective's).
    UnpairedLogProbs lp;
    const at::Tensor table = table_rows(eval, rows);
    lp.reference = table.defined() ? table.to(at::kFloat).to(device)
                                   : sequence_sum(reference_log_probs(ids, b.labels));
    at::Tensor mean_logits;
    lp.policy =
        sequence_sum(t_.model->label_log_probs(ids, b.labels, {}, 1024, {}, &mean_logits).sum(1));
    lp.logits = sequence_sum(answer_logit_sums(mean_logits, b.labels));
    std::vector<int64_t> flags;
    for (int64_t r : rows) flags.push_back(d.desirable().at(static_cast<size_t>(r)));
    lp.desirable = at::tensor(flags, at::kLong).to(at::kBool).to(device);
    lp.tokens = answer_tokens(b.labels, device);
    const Terms& terms = eval ? eval_terms_ : step_terms_;
    lp.kl = terms.kl;
    lp.nll_scale = terms.nll_scale;
    const PreferenceLosses losses = unpaired_losses(pref_, lp);
    const double members = static_cast<double>(t_.sequence_parallel);
    add_sums(sums(split), members == 1 ? losses.sums : losses.sums / members);
    const at::Tensor sum = losses.loss.sum();
    return {members == 1 ? sum : sum / members, counted_once(static_cast<int64_t>(samples.size()))};
  }

  void check_pair_steps() const override {
    throw InvalidArgument(
        "train_preference_step: the run has stage kto, whose examples are unpaired and whose KL "
        "estimate spans the global batch; KTO trains from train_file (train()), host pairs with "
        "stage dpo");
  }

  void begin_evaluation(const std::vector<std::vector<int64_t>>& batches) override {
    PreferenceObjective::begin_evaluation(batches);
    // The KL estimate and pref_ftx's rescaling over the whole evaluation set.
    eval_terms_.kl = kl_estimate(true, batches);
    std::vector<int64_t> all(static_cast<size_t>(t_.eval_samples));
    for (int64_t i = 0; i < t_.eval_samples; ++i) all[static_cast<size_t>(i)] = i;
    eval_terms_.nll_scale = ftx_scale(t_.eval_data, all);
  }

  void end_evaluation() override {
    PreferenceObjective::end_evaluation();
    if (pref_.uses_kl()) eval_metrics_["eval_kl"] = eval_terms_.kl;
  }

 protected:
  void begin_step(const std::vector<int64_t>& samples,
                  const std::vector<std::vector<int64_t>>& mine, double divisor) override {
    (void)divisor;
    // The KL estimate of the whole global batch, before any of its losses.
    step_terms_.kl = kl_estimate(false, mine);
    step_terms_.nll_scale = ftx_scale(t_.train_data, samples);
    window_kl_sum_ += step_terms_.kl;
    window_kl_steps_ += 1;
  }

 private:
  // What a micro-batch's losses take from its whole global batch (the same numbers on every
  // rank, so that any split gives the same step).
  struct Terms {
    double nll_scale = 0.0;  ///< pref_ftx's, (examples / desirable examples)² (LLaMA-Factory's)
    double kl = 0.0;         ///< KTO's KL estimate z0
  };

  // KTO's KL estimate z0 of a global batch: the mean, over all ranks' examples of `batches`
  // (this rank's micro-batches of the training or evaluation data; every rank passes as many),
  // of the policy's log-probability of the example's KL sequence minus the reference's, at
  // least 0; without dropout and without gradients. Collective.
  double kl_estimate(bool eval, const std::vector<std::vector<int64_t>>& batches) {
    if (!pref_.uses_kl()) return 0.0;
    at::NoGradGuard no_grad;
    const at::Device device = t_.comm->device();
    at::Tensor local = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
    int64_t count = 0;
    for (const std::vector<int64_t>& batch : batches) {
      // A rank with nothing left still runs its forwards (ZeRO-3 forwards are collective).
      const std::vector<int64_t> rows =
          unpaired_rows(batch.empty() ? std::vector<int64_t>{0} : batch, true);
      const Batch b = collate(data(eval), rows, t_.pad_id);
      const at::Tensor ids = b.input_ids.to(device);
      const at::Tensor table = table_rows(eval, rows);
      const at::Tensor ref =
          table.defined() ? table.to(device) : reference_log_probs(ids, b.labels);
      at::Tensor policy;
      {
        ScoringMode scoring(*t_.model, /*adapters_off=*/false);
        policy = t_.model->label_log_probs(ids, b.labels).sum(1);
      }
      if (batch.empty()) continue;
      // With sequence parallelism each member adds its positions' part of every row, and the
      // rows are counted on the group's first member only.
      local += (policy.to(at::kDouble) - ref.to(at::kDouble)).sum();
      count += counted_once(static_cast<int64_t>(batch.size()));
    }
    const std::vector<double> global =
        comm::reduce_scalars(*t_.comm, {local.item<double>(), static_cast<double>(count)});
    return global[1] > 0 ? std::max(0.0, global[0] / global[1]) : 0.0;
  }

  // pref_ftx's nll_scale for unpaired examples `samples` of `d` (all ranks').
  static double ftx_scale(const Dataset& d, const std::vector<int64_t>& samples) {
    int64_t desirable = 0;
    for (int64_t i : samples) desirable += d.desirable().at(static_cast<size_t>(2 * i));
    return unpaired_nll_scale(static_cast<int64_t>(samples.size()), desirable);
  }

  // TRL's advice for KTO (the paper's Eq. 8): desirable_weight × desirable examples over
  // undesirable_weight × undesirable ones should lie in [1, 4/3]. Said, not enforced.
  void warn_unbalanced() const {
    const Dataset& d = t_.train_data;
    const TrainingArguments& args = t_.args;
    int64_t desirable = 0;
    for (size_t i = 0; i < d.desirable().size(); i += 2) desirable += d.desirable()[i];
    const int64_t undesirable = d.size() / 2 - desirable;
    if (desirable == 0 || undesirable == 0) {
      log::warn(
          "'{}' has {} desirable and {} undesirable KTO examples: the loss only pushes one way",
          args.train_file, desirable, undesirable);
      return;
    }
    const double ratio = args.kto_chosen_weight * static_cast<double>(desirable) /
                         (args.kto_rejected_weight * static_cast<double>(undesirable));
    if (ratio < 1.0 || ratio > 4.0 / 3.0) {
      log::warn(
          "'{}': {} desirable and {} undesirable KTO examples; kto_chosen_weight × desirable / "
          "(kto_rejected_weight × undesirable) is {:.3g}, outside [1, 4/3], the range the KTO "
          "paper (Eq. 8) and TRL advise; set kto_chosen_weight / kto_rejected_weight to bring it "
          "there",
          args.train_file, desirable, undesirable, ratio);
    }
  }

  Terms step_terms_, eval_terms_;
};

}  // namespace

std::unique_ptr<Objective> make_preference_objective(Trainer::Impl& trainer) {
  if (preference_options(trainer.args).unpaired()) {
    return std::make_unique<UnpairedObjective>(trainer);
  }
  return std::make_unique<PairedObjective>(trainer);
}

}  // namespace zt::train
