// The bucket scheduler every gradient path shares. Hooks on the gradient accumulators mark
// parameters ready; buckets launch strictly in index order as they complete (during backward
// when overlapping, else after it), at most a strategy's max_in_flight() are outstanding, and
// every bucket not launched by the end of backward goes then, so all ranks issue the same
// collectives in the same order. Where gradients go and how a bucket is reduced is the
// strategy's (gradients_*.cpp, update_in_backward.cpp).
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/engine_impl.hpp"

namespace zt::zero {
namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(EngineImpl* impl, int param) : impl_(impl), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    impl_->on_gradient(param_);
    return outputs;
  }

 private:
  EngineImpl* impl_;
  int param_;
};

}  // namespace

// ---- what every strategy shares ---------------------------------------------------------------

bool GradientStrategy::reduces(int64_t micro) const {
  // Stages 0/1 reduce once per accumulation window (at its last micro-step); stages 2/3 every
  // micro-step.
  return e_.S.stage >= 2 || (micro + 1) % e_.S.accumulation == 0;
}

at::Tensor GradientStrategy::unit_gradients(int bucket) {
  BucketState& s = e_.buckets[static_cast<size_t>(bucket)];
  s.staging = at::zeros({e_.layout.buckets[static_cast<size_t>(bucket)].numel},
                        at::TensorOptions().dtype(e_.S.compute).device(e_.S.device));
  return s.staging;
}

void GradientStrategy::before_step() {
  for (const Bucket& b : e_.layout.buckets) {
    if (b.trainable && e_.buckets[static_cast<size_t>(b.index)].slice_fresh) {
      e_.slice_of(b.index, e_.grad_acc).zero_();
    }
  }
}

void GradientStrategy::clear() {
  for (BucketState& s : e_.buckets) {
    s.slice_fresh = true;
    if (s.flat_grad.defined()) s.flat_grad.zero_();
  }
}

void GradientStrategy::fold_into_slice(int bucket, const at::Tensor& result, double post) {
  BucketState& s = e_.buckets[static_cast<size_t>(bucket)];
  at::Tensor slice = e_.slice_of(bucket, e_.grad_acc);
  // The first reduction of a window overwrites the slice, so it never needs zeroing.
  if (s.slice_fresh) {
    slice.copy_(result);
    if (post != 1.0) slice.mul_(post);
    s.slice_fresh = false;
  } else {
    slice.add_(result, post);
  }
}

void GradientStrategy::keep_in_flat_gradient(int param) {
  const ParamInfo& p = e_.layout.params[static_cast<size_t>(param)];
  const ParamSlot& slot = e_.slots[static_cast<size_t>(param)];
  at::Tensor view =
      e_.buckets[static_cast<size_t>(slot.bucket)].flat_grad.narrow(0, slot.offset, p.numel);
  at::Tensor& grad = p.param.mutable_grad();
  if (!grad.defined() || grad.data_ptr() != view.data_ptr()) {
    if (grad.defined()) view.copy_(grad.reshape({-1}));
    grad = view.view(p.shape);
  }
}

std::unique_ptr<GradientStrategy> make_gradient_strategy(EngineImpl& e) {
  switch (e.S.gradients) {
    case GradientPath::kAllReduce:
      return make_stage0_gradients(e);
    case GradientPath::kFlatScatter:
      return make_stage1_gradients(e);
    case GradientPath::kStaged:
      return make_stage2_gradients(e);
    case GradientPath::kOneRank:
      return make_one_rank_gradients(e);
    case GradientPath::kInAccumulator:
      return make_in_accumulator_gradients(e);
    case GradientPath::kInBackward:
      return make_in_backward_update(e);
  }
  return make_stage0_gradients(e);
}

// ---- the scheduler ----------------------------------------------------------------------------

void EngineImpl::install_hooks() {
  for (const Bucket& b : layout.buckets) {
    if (!b.trainable || b.sharded_params) continue;
    for (int p : b.params) {
      const at::Tensor& param = layout.params[static_cast<size_t>(p)].param;
      // The accumulator must be kept alive, or it is recreated and the hook is lost.
      std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(param);
      acc->add_post_hook(std::make_unique<ReadyHook>(this, p));
      queue.accumulators.push_back(std::move(acc));
      buckets[static_cast<size_t>(b.index)].expected += 1;
    }
  }
}

void EngineImpl::begin_backward() {
  queue.reducing = gradients->reduces(steps.micro);
  gradients->begin_backward();
  for (BucketState& s : buckets) {
    s.ready = 0;
    s.launched = false;
  }
  for (ParamSlot& slot : slots) slot.fired = false;
  queue.next_launch = 0;
  record(TraceEvent::Kind::kBackwardBegin, -1);
}

void EngineImpl::on_gradient(int param_index) {
  ParamSlot& slot = slots[static_cast<size_t>(param_index)];
  const bool again = slot.fired;  // a tied weight's next share
  gradients->take(param_index, again);
  slot.fired = true;
  if (!queue.reducing || again) return;
  buckets[static_cast<size_t>(slot.bucket)].ready += 1;
  if (S.overlap) try_launch();
}

void EngineImpl::try_launch() {
  while (queue.next_launch < static_cast<int>(buckets.size())) {
    const Bucket& b = layout.buckets[static_cast<size_t>(queue.next_launch)];
    if (!b.trainable || b.sharded_params) {  // resident trainable buckets come first
      queue.next_launch = static_cast<int>(buckets.size());
      return;
    }
    const BucketState& s = buckets[static_cast<size_t>(queue.next_launch)];
    if (s.ready < s.expected || b.late) return;  // late: more shares may still come
    launch(queue.next_launch++);
  }
}

void EngineImpl::launch(int bucket) {
  buckets[static_cast<size_t>(bucket)].launched = true;
  record(TraceEvent::Kind::kBucketLaunch, bucket);
  queue.pending.push_back(gradients->launch(bucket));
  if (queue.pending.size() > gradients->max_in_flight()) complete_oldest();
}

void EngineImpl::complete_oldest() {
  Pending p = std::move(queue.pending.front());
  queue.pending.pop_front();
  p.work->wait();
  gradients->complete(p);
}

void EngineImpl::reduce_unit_gradients(int bucket) {
  buckets[static_cast<size_t>(bucket)].launched = false;
  launch(bucket);
}

void EngineImpl::finish_backward() {
  record(TraceEvent::Kind::kBackwardEnd, -1);
  if (queue.reducing) {
    // Buckets not launched yet (no overlap, or parameters that got no gradient) go now, in
    // order, so every rank issues the same collectives.
    for (size_t i = static_cast<size_t>(queue.next_launch); i < buckets.size(); ++i) {
      const Bucket& b = layout.buckets[i];
      if (!b.trainable || b.sharded_params) break;
      launch(static_cast<int>(i));
    }
    queue.next_launch = static_cast<int>(buckets.size());
  }
  while (!queue.pending.empty()) complete_oldest();
}

}  // namespace zt::zero
