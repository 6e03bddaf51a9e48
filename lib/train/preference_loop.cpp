// Preference training's part of the loop: one forward of a batch of pairs (chosen rows, then
// rejected rows) or of KTO's unpaired examples with the KL estimate of their global batch, the
// reference as the same model with its adapters off, and the metrics TRL logs.
#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "train/preference.hpp"
#include "train/trainer_impl.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {

namespace fs = std::filesystem;

namespace {

// A scoring pass's state: dropout off (TRL's disable_dropout) and, for a reference that is the
// model with its adapters off, the adapters off; whatever happens, restored after.
class ScoringMode {
 public:
  ScoringMode(CausalLM& model, bool adapters_off) : model_(model), training_(model.is_training()) {
    model_.eval();
    if (adapters_off) model_.set_adapters_enabled(false);
  }
  ~ScoringMode() {
    model_.set_adapters_enabled(true);
    if (training_) model_.train();
  }
  ScoringMode(const ScoringMode&) = delete;
  ScoringMode& operator=(const ScoringMode&) = delete;

 private:
  CausalLM& model_;
  bool training_;
};

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

}  // namespace

at::Tensor Trainer::Impl::reference_log_probs(const at::Tensor& ids, const at::Tensor& labels) {
  return reference_token_log_probs(ids, labels).sum(1);
}

at::Tensor Trainer::Impl::reference_token_log_probs(const at::Tensor& ids, const at::Tensor& labels,
                                                    double temperature) {
  at::NoGradGuard no_grad;
  ScoringMode scoring(*model, /*adapters_off=*/!reference_weights);
  const auto score = [&] {
    return model->label_log_probs(ids, labels, {}, 1024, {}, nullptr, temperature);
  };
  if (!reference_weights) return score();
  // The frozen reference: the starting trainable weights (with adapters, the adapters' starting
  // values, the adapters on) swapped in for this forward, and out again whatever happens.
  engine->swap_parameters(*reference_weights);
  at::Tensor out;
  try {
    out = score();
  } catch (...) {
    engine->swap_parameters(*reference_weights);
    throw;
  }
  engine->swap_parameters(*reference_weights);
  return out;
}

LossSum Trainer::Impl::preference_forward(const Dataset& data, const std::vector<int64_t>& samples,
                                          const BatchTerms& terms, at::Tensor& metric_sums,
                                          const at::Tensor& reference) {
  if (pref.unpaired()) return unpaired_forward(data, samples, terms, metric_sums, reference);
  const std::vector<int64_t> rows = pair_rows(samples);
  const Batch b = collate(data, rows, pad_id);
  at::Tensor rows_reference;
  if (reference.defined()) rows_reference = reference.index_select(0, at::tensor(rows, at::kLong));
  return preference_rows(b.input_ids, b.labels, terms, metric_sums, rows_reference);
}

LossSum Trainer::Impl::preference_rows(const at::Tensor& input_ids, const at::Tensor& labels,
                                       const BatchTerms& terms, at::Tensor& metric_sums,
                                       const at::Tensor& reference) {
  const int64_t n = input_ids.size(0) / 2;
  const at::Device device = comm->device();
  const at::Tensor ids = input_ids.to(device);
  // Rows are right-padded: causal attention never reaches the padding, so no mask is needed.
  const at::Tensor counts = answer_tokens(labels, device);
  train::PairLogProbs lp;
  if (pref.uses_reference() && reference.defined()) {
    const at::Tensor ref = reference.to(at::kFloat).to(device);
    lp.ref_chosen = ref.narrow(0, 0, n);
    lp.ref_rejected = ref.narrow(0, n, n);
  } else if (pref.uses_reference()) {
    const at::Tensor ref = reference_log_probs(ids, labels);
    lp.ref_chosen = ref.narrow(0, 0, n);
    lp.ref_rejected = ref.narrow(0, n, n);
  }
  at::Tensor mean_logits;
  const at::Tensor logps = model->label_log_probs(ids, labels, {}, 1024, {}, &mean_logits).sum(1);
  const at::Tensor logits = train::answer_logit_sums(mean_logits, labels);
  lp.chosen = logps.narrow(0, 0, n);
  lp.rejected = logps.narrow(0, n, n);
  lp.chosen_tokens = counts.narrow(0, 0, n);
  lp.rejected_tokens = counts.narrow(0, n, n);
  lp.chosen_logits = logits.narrow(0, 0, n);
  lp.rejected_logits = logits.narrow(0, n, n);
  const train::PreferenceLosses losses = train::preference_losses(pref, lp);
  at::Tensor sum = losses.loss.sum();
  if (pref.rpo_alpha > 0) sum = sum - (pref.rpo_alpha * terms.nll_scale) * lp.chosen.sum();
  add_sums(metric_sums, losses.sums);
  return {sum, n};
}

namespace {

// The rows of unpaired examples `samples`: their sequences (2i), or their KL sequences.
std::vector<int64_t> unpaired_rows(const std::vector<int64_t>& samples, bool kl) {
  std::vector<int64_t> rows;
  rows.reserve(samples.size());
  for (int64_t i : samples) rows.push_back(2 * i + (kl ? 1 : 0));
  return rows;
}

}  // namespace

LossSum Trainer::Impl::unpaired_forward(const Dataset& data, const std::vector<int64_t>& samples,
                                        const BatchTerms& terms, at::Tensor& metric_sums,
                                        const at::Tensor& reference) {
  const std::vector<int64_t> rows = unpaired_rows(samples, false);
  const Batch b = collate(data, rows, pad_id);
  const at::Device device = comm->device();
  const at::Tensor ids = b.input_ids.to(device);
  train::UnpairedLogProbs lp;
  if (reference.defined()) {
    lp.reference = reference.index_select(0, at::tensor(rows, at::kLong)).to(at::kFloat).to(device);
  } else {
    lp.reference = reference_log_probs(ids, b.labels);
  }
  at::Tensor mean_logits;
  lp.policy = model->label_log_probs(ids, b.labels, {}, 1024, {}, &mean_logits).sum(1);
  lp.logits = train::answer_logit_sums(mean_logits, b.labels);
  std::vector<uint8_t> flags;
  for (int64_t r : rows) flags.push_back(data.desirable().at(static_cast<size_t>(r)));
  lp.desirable = at::tensor(std::vector<int64_t>(flags.begin(), flags.end()), at::kLong)
                     .to(at::kBool)
                     .to(device);
  lp.tokens = answer_tokens(b.labels, device);
  lp.kl = terms.kl;
  lp.nll_scale = terms.nll_scale;
  const train::PreferenceLosses losses = train::unpaired_losses(pref, lp);
  add_sums(metric_sums, losses.sums);
  return {losses.loss.sum(), static_cast<int64_t>(samples.size())};
}

double Trainer::Impl::unpaired_kl(const Dataset& data,
                                  const std::vector<std::vector<int64_t>>& batches,
                                  const at::Tensor& reference) {
  if (!pref.uses_kl()) return 0.0;
  at::NoGradGuard no_grad;
  const at::Device device = comm->device();
  at::Tensor local = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  int64_t count = 0;
  for (const std::vector<int64_t>& batch : batches) {
    // A rank with nothing left still runs its forwards (ZeRO-3 forwards are collective).
    const std::vector<int64_t> rows =
        unpaired_rows(batch.empty() ? std::vector<int64_t>{0} : batch, true);
    const Batch b = collate(data, rows, pad_id);
    const at::Tensor ids = b.input_ids.to(device);
    at::Tensor ref;
    if (reference.defined()) {
      ref = reference.index_select(0, at::tensor(rows, at::kLong)).to(device);
    } else {
      ref = reference_log_probs(ids, b.labels);
    }
    at::Tensor policy;
    {
      ScoringMode scoring(*model, /*adapters_off=*/false);
      policy = model->label_log_probs(ids, b.labels).sum(1);
    }
    if (batch.empty()) continue;
    local += (policy.to(at::kDouble) - ref.to(at::kDouble)).sum();
    count += static_cast<int64_t>(batch.size());
  }
  const std::vector<double> global =
      comm::reduce_scalars(*comm, {local.item<double>(), static_cast<double>(count)});
  return global[1] > 0 ? std::max(0.0, global[0] / global[1]) : 0.0;
}

double Trainer::Impl::unpaired_nll_scale(const Dataset& data,
                                         const std::vector<int64_t>& samples) const {
  int64_t desirable = 0;
  for (int64_t i : samples) desirable += data.desirable().at(static_cast<size_t>(2 * i));
  return train::unpaired_nll_scale(static_cast<int64_t>(samples.size()), desirable);
}

void Trainer::Impl::ensure_reference() {
  if (!precomputed_reference || train_reference.defined() || eval_reference.defined()) return;
  if (state.global_step > 0) {
    throw InvalidArgument(fmt::format(
        "the precomputed reference log-probs are missing at step {}: they are computed before the "
        "first step or read from the checkpoint resumed from",
        state.global_step));
  }
  precompute_reference();
}

void Trainer::Impl::precompute_reference() {
  // The sequences of pairs `indices`, scored by the reference (reference_log_probs: the model
  // as it starts). A rank with no pair left still runs a forward (ZeRO-3 forwards are
  // collective), its result discarded.
  // A phase before the first step: its progress in batches (the same count on every rank), and
  // a stop asked on any rank ends it on every rank before the next batch (one agreement per
  // batch, as the forwards may be collective).
  const auto batches = [&](int64_t samples) {
    return eval_batches(samples, world, rank, args.per_device_eval_batch_size);
  };
  const size_t total = (has_train ? batches(train_samples).size() : 0) +
                       (has_eval ? batches(eval_samples).size() : 0);
  const std::string phase = "precomputing the reference";
  train::PhaseMeter meter = phase_meter(phase, "batches", static_cast<double>(total), 1);
  int64_t done = 0;
  const auto score = [&](const Dataset& data, int64_t samples) {
    std::vector<double> local(static_cast<size_t>(2 * samples), 0.0);
    for (const std::vector<int64_t>& indices : batches(samples)) {
      stop_if_asked(fmt::format(" while {} ({})", phase, meter.position()), /*agree=*/true);
      const std::vector<int64_t> pairs = indices.empty() ? std::vector<int64_t>{0} : indices;
      const std::vector<int64_t> rows = pair_rows(pairs);
      const Batch b = collate(data, rows, pad_id);
      const at::Tensor logps =
          reference_log_probs(b.input_ids.to(comm->device()), b.labels).to(at::kDouble).cpu();
      meter.update(static_cast<double>(++done));
      if (indices.empty()) continue;
      for (size_t k = 0; k < rows.size(); ++k) {
        local[static_cast<size_t>(rows[k])] = logps[static_cast<int64_t>(k)].item<double>();
      }
    }
    return at::tensor(comm::reduce_scalars(*comm, local), at::kDouble);
  };
  if (has_train) train_reference = score(train_data, train_samples);
  if (has_eval) eval_reference = score(eval_data, eval_samples);
  meter.finish();
  if (rank == 0) {
    log::info("reference log-probs precomputed for {} training and {} evaluation {}", train_samples,
              has_eval ? eval_samples : 0, sample_name());
  }
}

namespace {

constexpr const char* kReferenceFile = "ref_log_probs.safetensors";

// What the precomputed reference belongs to: the sequences' ids, as a 64-bit FNV-1a hash.
std::string data_fingerprint(const Dataset& d) {
  uint64_t h = 14695981039346656037ULL;
  for (int32_t id : d.flat_ids()) {
    h ^= static_cast<uint32_t>(id);
    h *= 1099511628211ULL;
  }
  return fmt::format("{:016x}-{}", h, d.size());
}

}  // namespace

void Trainer::Impl::write_reference(const std::string& dir) const {
  if (!precomputed_reference || rank != 0) return;
  std::vector<std::pair<std::string, at::Tensor>> tensors{{"train", train_reference}};
  if (eval_reference.defined()) tensors.emplace_back("eval", eval_reference);
  save_safetensors(dir + "/" + kReferenceFile, tensors,
                   {{"format", "pt"},
                    {"train_data", data_fingerprint(train_data)},
                    {"eval_data", has_eval ? data_fingerprint(eval_data) : ""}});
}

void Trainer::Impl::read_reference(const std::string& dir) {
  if (!precomputed_reference) return;
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
          "'{}' holds the reference log-probs of other {} data than this run's; resume with the "
          "data the run started with",
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
  if (has_train) train_reference = check("train", train_data, train_samples);
  if (has_eval) eval_reference = check("eval", eval_data, eval_samples);
}

std::map<std::string, double> Trainer::Impl::preference_metrics(const at::Tensor& metric_sums,
                                                                const std::string& prefix) {
  std::vector<double> local(static_cast<size_t>(train::metric_sums_size(pref)), 0.0);
  if (metric_sums.defined()) {
    const at::Tensor host = metric_sums.to(at::kDouble).cpu();
    for (size_t k = 0; k < local.size(); ++k)
      local[k] = host[static_cast<int64_t>(k)].item<double>();
  }
  return train::preference_metrics(pref, comm::reduce_scalars(*comm, local), prefix);
}

}  // namespace zt
