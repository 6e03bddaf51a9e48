// Gradient reduction: hooks on the gradient accumulators mark parameters ready; buckets launch
// in index order as they complete (during backward when overlapping), and their results are
// accumulated in fp32 into this rank's slices.
//
// Stage 0: each parameter's .grad is a view into its bucket's flat gradient, all-reduced at
//          the accumulation boundary (in place).
// Stage 1: the same flat gradients accumulate over micro-steps and are reduce-scattered at the
//          boundary into the fp32 slice.
// Stage 2 (and stage 3's whole parameters): each gradient is copied into the bucket's staging
//          buffer as soon as it is complete and the parameter's own .grad is dropped, so a rank
//          never holds the full gradient; each micro-step reduce-scatters its buckets.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <fmt/format.h>

#include "comm/work.hpp"
#include "zero/engine_impl.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(zero::EngineImpl* impl, int param) : impl_(impl), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    impl_->on_gradient(param_);
    return outputs;
  }

 private:
  zero::EngineImpl* impl_;
  int param_;
};

// At most this many bucket reductions in flight before the oldest is completed, bounding the
// staging memory of stages 2/3 to a few buckets.
constexpr size_t kMaxInFlight = 2;

}  // namespace

void zero::EngineImpl::install_hooks() {
  for (const zero::Bucket& b : layout.buckets) {
    if (!b.trainable || b.sharded_params) continue;
    for (int p : b.params) {
      const at::Tensor& param = layout.params[static_cast<size_t>(p)].param;
      // The accumulator must be kept alive, or it is recreated and the hook is lost.
      std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(param);
      acc->add_post_hook(std::make_unique<ReadyHook>(this, p));
      accumulators.push_back(std::move(acc));
      buckets[static_cast<size_t>(b.index)].expected += 1;
    }
  }
}

at::Tensor zero::EngineImpl::slice_of(int bucket, const at::Tensor& state) const {
  const zero::Bucket& b = layout.buckets[static_cast<size_t>(bucket)];
  return state.narrow(0, b.shard.offset, b.shard_numel);
}

void zero::EngineImpl::begin_backward() {
  // Stages 0/1 reduce once per accumulation window (at its last micro-step); stages 2/3 every
  // micro-step.
  reducing = !in_backward && (stage >= 2 || (micro_steps + 1) % accumulation == 0);
  if (in_backward) {
    backward_hyper = step_hyper(1.0);
    optimizer->begin_step();
    param_grad_sq.zero_();
  }
  for (BucketState& s : buckets) {
    s.ready = 0;
    s.launched = false;
  }
  std::fill(fired.begin(), fired.end(), 0);
  next_launch = 0;
  record(TraceEvent::Kind::kBackwardBegin, -1);
}

void zero::EngineImpl::update_now(int param_index) {
  const zero::ParamInfo& p = layout.params[static_cast<size_t>(param_index)];
  at::Tensor& grad = p.param.mutable_grad();
  if (!grad.defined()) return;
  at::NoGradGuard no_grad;
  // Every use of the parameter has contributed (autograd sums them before its accumulator
  // runs), so it is no longer needed by backward and may change in place.
  const at::Tensor g = grad.reshape({-1});
  // Σ g² into the parameter's own slot: on the GPU inside the update's pass over g.
  optimizer->update(g, backward_hyper, param_segments[static_cast<size_t>(param_index)],
                    param_state_offset[static_cast<size_t>(param_index)],
                    param_grad_sq.select(0, param_index));
  grad.reset();
}

void zero::EngineImpl::on_gradient(int param_index) {
  if (in_backward) {
    update_now(param_index);
    fired[static_cast<size_t>(param_index)] = 1;
    return;
  }
  const int b = bucket_of_param[static_cast<size_t>(param_index)];
  BucketState& s = buckets[static_cast<size_t>(b)];
  const zero::Bucket& bucket = layout.buckets[static_cast<size_t>(b)];
  const zero::ParamInfo& p = layout.params[static_cast<size_t>(param_index)];
  const bool again = fired[static_cast<size_t>(param_index)] != 0;  // a tied weight's next share
  const int64_t off =
      bucket.offsets[static_cast<size_t>(slot_of_param[static_cast<size_t>(param_index)])];
  if (stage >= 2 && s.launched && !grads_in_acc) {
    throw InvalidArgument(fmt::format(
        "parameter '{}' received a gradient after its bucket was reduced: it is used by two "
        "sharding units without being registered in both (tie it through the units' modules)",
        p.name));
  }
  if (stage >= 2 && !grads_in_acc) {
    at::Tensor& grad = p.param.mutable_grad();
    if (world == 1) {
      // One rank: straight into the fp32 accumulator (the reduction is the identity),
      // overwriting at the start of a window.
      at::Tensor region = grad_acc.narrow(0, bucket.shard.offset + off, p.numel);
      if (s.slice_fresh && !again) {
        region.copy_(grad.reshape({-1}));
      } else {
        region.add_(grad.reshape({-1}));
      }
    } else {
      if (!s.staging.defined()) {
        s.staging = at::zeros({bucket.numel}, at::TensorOptions().dtype(wire).device(device));
      }
      s.staging.narrow(0, off, p.numel).add_(grad.reshape({-1}));
    }
    grad.reset();
  } else {
    // Autograd accumulates into the bucket view in place; if it ever replaced the .grad (it
    // does when the old one is shared elsewhere), fold the new one back into the bucket.
    at::Tensor view = s.flat_grad.narrow(0, off, p.numel);
    at::Tensor& grad = p.param.mutable_grad();
    if (!grad.defined() || grad.data_ptr() != view.data_ptr()) {
      if (grad.defined()) view.copy_(grad.reshape({-1}));
      grad = view.view(p.shape);
    }
  }
  fired[static_cast<size_t>(param_index)] = 1;
  if (!reducing || again) return;
  s.ready += 1;
  if (overlap) try_launch();
}

void zero::EngineImpl::try_launch() {
  while (next_launch < static_cast<int>(buckets.size())) {
    const zero::Bucket& b = layout.buckets[static_cast<size_t>(next_launch)];
    if (!b.trainable || b.sharded_params) {  // resident trainable buckets come first
      next_launch = static_cast<int>(buckets.size());
      return;
    }
    BucketState& s = buckets[static_cast<size_t>(next_launch)];
    if (s.ready < s.expected || b.late) return;  // late: more shares may still come
    launch(next_launch++);
  }
}

void zero::EngineImpl::launch(int bucket) {
  const zero::Bucket& b = layout.buckets[static_cast<size_t>(bucket)];
  BucketState& s = buckets[static_cast<size_t>(bucket)];
  s.launched = true;
  record(TraceEvent::Kind::kBucketLaunch, bucket);
  Pending p;
  p.bucket = bucket;
  if (world == 1) {
    // One rank: the reduction is the identity; skip the collective, its copies and scalings.
    p.work = std::make_unique<comm::DoneWork>();
    p.in_place = true;
    if (stage == 1) {
      p.output = s.flat_grad;
    } else if (stage >= 2 && s.staging.defined()) {
      p.output = s.staging;  // a stage-3 unit's gradients
      s.staging = at::Tensor();
    }
    pending.push_back(std::move(p));
    return;
  }
  if (stage == 0) {
    // Stage 0: all-reduce the flat gradient (in place when the wire dtype is the compute one).
    at::Tensor wire_grad = s.flat_grad.scalar_type() == wire ? s.flat_grad : s.flat_grad.to(wire);
    p.in_place = wire_grad.is_same(s.flat_grad);
    if (pre_scale != 1.0) wire_grad.mul_(pre_scale);
    p.work = comm->all_reduce(wire_grad, ReduceOp::kSum);
    p.input = wire_grad;
  } else {
    at::Tensor input;
    if (stage == 1) {
      // The flat gradient is cleared after the step, so it may be scaled and sent in place.
      input = s.flat_grad.scalar_type() == wire ? s.flat_grad : s.flat_grad.to(wire);
    } else {
      if (!s.staging.defined()) {  // no gradient reached this bucket here; peers may have some
        s.staging = at::zeros({b.numel}, at::TensorOptions().dtype(wire).device(device));
      }
      input = s.staging.scalar_type() == wire ? s.staging : s.staging.to(wire);
      s.staging = at::Tensor();
    }
    if (pre_scale != 1.0) input.mul_(pre_scale);
    if (use_reduce_scatter) {
      p.output = at::empty({b.shard_numel}, input.options());
      p.work = comm->reduce_scatter(p.output, input, ReduceOp::kSum);
    } else {
      p.work = comm->all_reduce(input, ReduceOp::kSum);
      p.output = input.narrow(0, rank * b.shard_numel, b.shard_numel);
    }
    p.input = input;
  }
  pending.push_back(std::move(p));
  if (stage >= 1 && pending.size() > kMaxInFlight) complete_oldest();
}

void zero::EngineImpl::complete_oldest() {
  Pending p = std::move(pending.front());
  pending.pop_front();
  p.work->wait();
  const double post = world == 1 ? 1.0 : post_scale;
  BucketState& s = buckets[static_cast<size_t>(p.bucket)];
  if (grads_in_acc) {  // the gradients already live in the accumulator
    s.slice_fresh = false;
    return;
  }
  if (stage >= 2 && world == 1 && !p.output.defined()) {
    // The hooks wrote straight into the accumulator; parameters that got no gradient in the
    // first micro-step of a window still hold the last window's values.
    if (s.slice_fresh) {
      const zero::Bucket& b = layout.buckets[static_cast<size_t>(p.bucket)];
      for (size_t k = 0; k < b.params.size(); ++k) {
        const int pi = b.params[k];
        if (!fired[static_cast<size_t>(pi)]) {
          grad_acc
              .narrow(0, b.shard.offset + b.offsets[k],
                      layout.params[static_cast<size_t>(pi)].numel)
              .zero_();
        }
      }
    }
    s.slice_fresh = false;
    return;
  }
  at::Tensor slice = slice_of(p.bucket, grad_acc);
  at::Tensor result = p.output;
  if (stage == 0) {
    if (!p.in_place) s.flat_grad.copy_(p.input);
    result = s.flat_grad;
  }
  // The first reduction of a window overwrites the slice, so it never needs zeroing.
  if (s.slice_fresh) {
    slice.copy_(result);
    if (post != 1.0) slice.mul_(post);
    s.slice_fresh = false;
  } else {
    slice.add_(result, post);
  }
}

void zero::EngineImpl::reduce_unit_gradients(int bucket) {
  BucketState& s = buckets[static_cast<size_t>(bucket)];
  s.launched = false;
  launch(bucket);
}

void zero::EngineImpl::finish_backward() {
  record(TraceEvent::Kind::kBackwardEnd, -1);
  if (reducing) {
    // Buckets not launched yet (no overlap, or parameters that got no gradient) go now, in
    // order, so every rank issues the same collectives.
    for (size_t i = static_cast<size_t>(next_launch); i < buckets.size(); ++i) {
      const zero::Bucket& b = layout.buckets[i];
      if (!b.trainable || b.sharded_params) break;
      launch(static_cast<int>(i));
    }
    next_launch = static_cast<int>(buckets.size());
  }
  while (!pending.empty()) complete_oldest();
}

}  // namespace zt
