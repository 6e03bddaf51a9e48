// Preference training's part of the loop: one forward of a batch of pairs (chosen rows, then
// rejected rows), the reference as the same model with its adapters off, and the metrics TRL
// logs.
#include <ATen/ATen.h>

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

// The reference pass's state: adapters off and dropout off (TRL's disable_dropout), whatever
// happens, restored after.
class ReferenceMode {
 public:
  explicit ReferenceMode(CausalLM& model) : model_(model), training_(model.is_training()) {
    model_.eval();
    model_.set_adapters_enabled(false);
  }
  ~ReferenceMode() {
    model_.set_adapters_enabled(true);
    if (training_) model_.train();
  }
  ReferenceMode(const ReferenceMode&) = delete;
  ReferenceMode& operator=(const ReferenceMode&) = delete;

 private:
  CausalLM& model_;
  bool training_;
};

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

LossSum Trainer::Impl::preference_forward(const Dataset& data, const std::vector<int64_t>& pairs,
                                          double rpo_scale, at::Tensor& metric_sums,
                                          const at::Tensor& reference) {
  const std::vector<int64_t> rows = pair_rows(pairs);
  const Batch b = collate(data, rows, pad_id);
  at::Tensor rows_reference;
  if (reference.defined()) rows_reference = reference.index_select(0, at::tensor(rows, at::kLong));
  return preference_rows(b.input_ids, b.labels, rpo_scale, metric_sums, rows_reference);
}

LossSum Trainer::Impl::preference_rows(const at::Tensor& input_ids, const at::Tensor& labels,
                                       double rpo_scale, at::Tensor& metric_sums,
                                       const at::Tensor& reference) {
  const int64_t n = input_ids.size(0) / 2;
  const at::Device device = comm->device();
  const at::Tensor ids = input_ids.to(device);
  // Rows are right-padded: causal attention never reaches the padding, so no mask is needed.
  const at::Tensor counts =
      labels.narrow(1, 1, labels.size(1) - 1).ne(kIgnoreLabel).sum(1).to(at::kFloat).to(device);
  train::PairLogProbs lp;
  if (pref.uses_reference() && reference.defined()) {
    const at::Tensor ref = reference.to(at::kFloat).to(device);
    lp.ref_chosen = ref.narrow(0, 0, n);
    lp.ref_rejected = ref.narrow(0, n, n);
  } else if (pref.uses_reference()) {
    at::NoGradGuard no_grad;
    ReferenceMode reference_mode(*model);
    const at::Tensor ref = model->label_log_probs(ids, labels).sum(1);
    lp.ref_chosen = ref.narrow(0, 0, n);
    lp.ref_rejected = ref.narrow(0, n, n);
  }
  const at::Tensor logps = model->label_log_probs(ids, labels).sum(1);
  lp.chosen = logps.narrow(0, 0, n);
  lp.rejected = logps.narrow(0, n, n);
  lp.chosen_tokens = counts.narrow(0, 0, n);
  lp.rejected_tokens = counts.narrow(0, n, n);
  const train::PairLosses losses = train::preference_losses(pref, lp);
  at::Tensor sum = losses.loss.sum();
  if (pref.rpo_alpha > 0) sum = sum - (pref.rpo_alpha * rpo_scale) * lp.chosen.sum();
  {
    // Summed where they were computed: the host reads them at logging time only (no sync per
    // micro-batch).
    at::NoGradGuard no_grad;
    const at::Tensor local = at::cat(
        {losses.metrics.sum(0), at::full({1}, static_cast<double>(n), losses.metrics.options())});
    if (!metric_sums.defined()) metric_sums = at::zeros_like(local);
    metric_sums.add_(local);
  }
  return {sum, n};
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
  // The sequences of pairs `indices`, scored by the reference: the model as it starts, with its
  // adapters off. A rank with no pair left still runs a forward (ZeRO-3 forwards are
  // collective), its result discarded.
  const auto score = [&](const Dataset& data, int64_t samples) {
    std::vector<double> local(static_cast<size_t>(2 * samples), 0.0);
    at::NoGradGuard no_grad;
    ReferenceMode reference(*model);
    for (const std::vector<int64_t>& indices :
         eval_batches(samples, world, rank, args.per_device_eval_batch_size)) {
      const std::vector<int64_t> pairs = indices.empty() ? std::vector<int64_t>{0} : indices;
      const std::vector<int64_t> rows = pair_rows(pairs);
      const Batch b = collate(data, rows, pad_id);
      const at::Tensor logps = model->label_log_probs(b.input_ids.to(comm->device()), b.labels)
                                   .sum(1)
                                   .to(at::kDouble)
                                   .cpu();
      if (indices.empty()) continue;
      for (size_t k = 0; k < rows.size(); ++k) {
        local[static_cast<size_t>(rows[k])] = logps[static_cast<int64_t>(k)].item<double>();
      }
    }
    return at::tensor(comm::reduce_scalars(*comm, local), at::kDouble);
  };
  if (has_train) train_reference = score(train_data, train_samples);
  if (has_eval) eval_reference = score(eval_data, eval_samples);
  if (rank == 0) {
    log::info("reference log-probs precomputed for {} training and {} evaluation pairs",
              train_samples, has_eval ? eval_samples : 0);
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
  const size_t count = train::kPreferenceMetrics.size();
  std::vector<double> local(count + 1, 0.0);
  if (metric_sums.defined()) {
    const at::Tensor host = metric_sums.to(at::kDouble).cpu();
    for (size_t k = 0; k <= count; ++k) local[k] = host[static_cast<int64_t>(k)].item<double>();
  }
  const std::vector<double> global = comm::reduce_scalars(*comm, local);
  std::map<std::string, double> out;
  if (global[count] <= 0) return out;
  for (size_t k = 0; k < count; ++k) {
    out[prefix + train::kPreferenceMetrics[k]] = global[k] / global[count];
  }
  return out;
}

}  // namespace zt
