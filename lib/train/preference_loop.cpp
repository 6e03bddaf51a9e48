// Preference training's part of the loop: one forward of a batch of pairs (chosen rows, then
// rejected rows), the reference as the same model with its adapters off, and the metrics TRL
// logs.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "train/preference.hpp"
#include "train/trainer_impl.hpp"

namespace zt {

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

}  // namespace

LossSum Trainer::Impl::preference_forward(const Dataset& data, const std::vector<int64_t>& pairs,
                                          double rpo_scale, at::Tensor& metric_sums) {
  const int64_t n = static_cast<int64_t>(pairs.size());
  std::vector<int64_t> rows;
  rows.reserve(2 * pairs.size());
  for (int64_t p : pairs) rows.push_back(2 * p);
  for (int64_t p : pairs) rows.push_back(2 * p + 1);
  const Batch b = collate(data, rows, pad_id);
  const at::Device device = comm->device();
  const at::Tensor ids = b.input_ids.to(device);
  // Rows are right-padded: causal attention never reaches the padding, so no mask is needed.
  const at::Tensor counts =
      b.labels.narrow(1, 1, b.labels.size(1) - 1).ne(kIgnoreLabel).sum(1).to(at::kFloat).to(device);
  train::PairLogProbs lp;
  if (pref.uses_reference()) {
    at::NoGradGuard no_grad;
    ReferenceMode reference(*model);
    const at::Tensor ref = model->label_log_probs(ids, b.labels).sum(1);
    lp.ref_chosen = ref.narrow(0, 0, n);
    lp.ref_rejected = ref.narrow(0, n, n);
  }
  const at::Tensor logps = model->label_log_probs(ids, b.labels).sum(1);
  lp.chosen = logps.narrow(0, 0, n);
  lp.rejected = logps.narrow(0, n, n);
  lp.chosen_tokens = counts.narrow(0, 0, n);
  lp.rejected_tokens = counts.narrow(0, n, n);
  const train::PairLosses losses = train::preference_losses(pref, lp);
  at::Tensor sum = losses.loss.sum();
  if (pref.rpo_alpha > 0) sum = sum - (pref.rpo_alpha * rpo_scale) * lp.chosen.sum();
  {
    at::NoGradGuard no_grad;
    const at::Tensor local =
        at::cat({losses.metrics.sum(0).cpu(), at::full({1}, static_cast<double>(n), at::kDouble)});
    if (!metric_sums.defined()) metric_sums = at::zeros({local.numel()}, at::kDouble);
    metric_sums.add_(local);
  }
  return {sum, n};
}

std::map<std::string, double> Trainer::Impl::preference_metrics(const at::Tensor& metric_sums,
                                                                const std::string& prefix) {
  const size_t count = train::kPreferenceMetrics.size();
  std::vector<double> local(count + 1, 0.0);
  if (metric_sums.defined()) {
    for (size_t k = 0; k <= count; ++k) local[k] = metric_sums[static_cast<int64_t>(k)].item<double>();
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
