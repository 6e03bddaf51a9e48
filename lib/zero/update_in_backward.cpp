// The optimizer inside backward (see update_in_backward.hpp).
#include "zero/update_in_backward.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "comm/work.hpp"
#include "zerotrain/error.hpp"

namespace zt::zero {

InBackwardUpdate::InBackwardUpdate(EngineImpl& e) : GradientStrategy(e) {
  const size_t n = e.layout.params.size();
  holders_.assign(n, 1);
  shares_.assign(n, 0);
  partial_.resize(n);
  for (size_t i = 0; i < n; ++i) holders_[i] = std::max(1, e.layout.params[i].holders);
  // Each parameter's Σ g² in a slot of its own (on the GPU added by the AdamW kernel's own pass
  // over the gradient, elsewhere by a norm kernel), summed once at the step.
  grad_sq_ = at::zeros({static_cast<int64_t>(e.layout.params.size())},
                       at::TensorOptions().dtype(at::kFloat).device(e.S.device));
  for (const Bucket& b : e.layout.buckets) {
    if (!b.trainable) continue;
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t pi = static_cast<size_t>(b.params[k]);
      const int64_t offset = b.shard.offset + b.offsets[k];  // one rank: the whole bucket
      e.slots[pi].state_run = {
          Segment{offset, e.layout.params[pi].numel, e.layout.params[pi].decay}};
    }
  }
}

void InBackwardUpdate::begin_backward() {
  hyper_ = e_.step_hyper(1.0);
  e_.optimizer->begin_step();
  grad_sq_.zero_();
  std::fill(shares_.begin(), shares_.end(), 0);
}

void InBackwardUpdate::take(int param, bool /*again*/) {
  const size_t i = static_cast<size_t>(param);
  const ParamInfo& p = e_.layout.params[i];
  at::Tensor& grad = p.param.mutable_grad();
  if (!grad.defined()) return;
  at::NoGradGuard no_grad;
  if (holders_[i] > 1) {
    // A share of a weight several units use: summed in fp32 until the last one.
    if (shares_[i]++ == 0) {
      partial_[i] = grad.reshape({-1}).to(e_.master.scalar_type(), /*non_blocking=*/false,
                                          /*copy=*/true);
    } else {
      partial_[i].add_(grad.reshape({-1}));
    }
    grad.reset();
    if (shares_[i] < holders_[i]) return;
    apply(param, partial_[i]);
    partial_[i] = at::Tensor();
    return;
  }
  // Every use of the parameter has contributed (autograd sums them before its accumulator
  // runs), so it is no longer needed by backward and may change in place.
  apply(param, grad.reshape({-1}));
  grad.reset();
}

void InBackwardUpdate::apply(int param, const at::Tensor& grad) {
  const std::vector<Segment>& run = e_.slots[static_cast<size_t>(param)].state_run;
  e_.optimizer->update(grad, hyper_, run, run.front().offset, grad_sq_.select(0, param),
                       compute_copy(param));
}

at::Tensor InBackwardUpdate::compute_copy(int param) const {
  if (e_.S.master_aliases_params) return {};  // the update writes the parameter itself
  return e_.layout.params[static_cast<size_t>(param)].param.detach().reshape({-1});
}

Pending InBackwardUpdate::launch(int bucket) {
  Pending p;
  p.bucket = bucket;
  p.work = std::make_unique<comm::DoneWork>();
  return p;
}

void InBackwardUpdate::finish_step() {
  for (size_t i = 0; i < e_.slots.size(); ++i) {
    const ParamSlot& slot = e_.slots[i];
    if (partial_[i].defined()) {  // a shared weight some of whose units did not run
      at::NoGradGuard no_grad;
      apply(static_cast<int>(i), partial_[i]);
      partial_[i] = at::Tensor();
      continue;
    }
    if (slot.state_run.empty() || slot.fired) continue;
    const at::Tensor zeros = at::zeros({e_.layout.params[i].numel}, e_.master.options());
    e_.optimizer->update(zeros, hyper_, slot.state_run, slot.state_run.front().offset, {},
                         compute_copy(static_cast<int>(i)));
  }
  at::Tensor host = at::stack({grad_sq_.sum(), e_.steps.nonfinite_losses.reshape({})}).to(at::kCPU);
  e_.comm->raise_if_failed();  // after an abort these values are garbage: say why instead
  const double norm = std::sqrt(host[0].item<double>());
  const double bad_losses = host[1].item<double>();
  e_.steps.nonfinite_losses.zero_();
  if (!std::isfinite(norm) || bad_losses > 0) {
    throw NumericError(fmt::format(
        "non-finite {} at optimizer step {} (micro-step {}, {}; its update was already applied "
        "during backward): training diverged or the data has a problem; lower the learning "
        "rate or check the inputs",
        bad_losses > 0 ? "loss" : "gradient norm", e_.steps.global, e_.steps.micro,
        c10::toString(e_.S.compute)));
  }
  ++e_.steps.applied;
  e_.steps.last_lr = hyper_.lr;
  e_.steps.last_norm = norm;
  e_.steps.last_skipped = false;
}

std::unique_ptr<GradientStrategy> make_in_backward_update(EngineImpl& e) {
  auto part = std::make_unique<InBackwardUpdate>(e);
  e.in_backward = part.get();
  return part;
}

}  // namespace zt::zero
