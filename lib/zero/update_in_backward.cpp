// The optimizer inside backward (see update_in_backward.hpp).
#include "zero/update_in_backward.hpp"

#include <cmath>

#include <fmt/format.h>

#include "comm/work.hpp"
#include "zerotrain/error.hpp"

namespace zt::zero {

InBackwardUpdate::InBackwardUpdate(EngineImpl& e) : GradientStrategy(e) {
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
}

void InBackwardUpdate::take(int param, bool /*again*/) {
  const ParamInfo& p = e_.layout.params[static_cast<size_t>(param)];
  at::Tensor& grad = p.param.mutable_grad();
  if (!grad.defined()) return;
  at::NoGradGuard no_grad;
  // Every use of the parameter has contributed (autograd sums them before its accumulator
  // runs), so it is no longer needed by backward and may change in place.
  const std::vector<Segment>& run = e_.slots[static_cast<size_t>(param)].state_run;
  e_.optimizer->update(grad.reshape({-1}), hyper_, run, run.front().offset,
                       grad_sq_.select(0, param));
  grad.reset();
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
    if (slot.state_run.empty() || slot.fired) continue;
    const at::Tensor zeros = at::zeros({e_.layout.params[i].numel}, e_.master.options());
    e_.optimizer->update(zeros, hyper_, slot.state_run, slot.state_run.front().offset);
  }
  at::Tensor host = at::stack({grad_sq_.sum(), e_.nonfinite_losses.reshape({})}).to(at::kCPU);
  const double norm = std::sqrt(host[0].item<double>());
  const double bad_losses = host[1].item<double>();
  e_.nonfinite_losses.zero_();
  if (!std::isfinite(norm) || bad_losses > 0) {
    throw NumericError(fmt::format(
        "non-finite {} at optimizer step {} (micro-step {}, {}; its update was already applied "
        "during backward): training diverged or the data has a problem; lower the learning "
        "rate or check the inputs",
        bad_losses > 0 ? "loss" : "gradient norm", e_.global_steps, e_.micro_steps,
        c10::toString(e_.S.compute)));
  }
  ++e_.applied_steps;
  e_.last_lr = hyper_.lr;
  e_.last_norm = norm;
  e_.last_skipped = false;
}

std::unique_ptr<GradientStrategy> make_in_backward_update(EngineImpl& e) {
  auto part = std::make_unique<InBackwardUpdate>(e);
  e.in_backward = part.get();
  return part;
}

}  // namespace zt::zero
