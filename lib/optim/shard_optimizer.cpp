// ShardOptimizer: state allocation and the per-device update paths.
#include "optim/shard_optimizer.hpp"

#include <cmath>

#include "kernels/adam_cpu.hpp"
#include "kernels/fused.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/error.hpp"

namespace zt {

ShardOptimizer::ShardOptimizer(OptimizerType type, at::Tensor master, std::vector<Segment> segments,
                               double momentum, at::ScalarType state_dtype,
                               const std::vector<std::vector<Segment>>& update_groups)
    : type_(type), master_(std::move(master)), segments_(std::move(segments)) {
  TORCH_CHECK(
      at::isFloatingType(master_.scalar_type()) && master_.is_contiguous() && master_.dim() == 1,
      "ShardOptimizer: the master shard must be a flat contiguous floating tensor");
  const auto options = master_.options().dtype(state_dtype);
  if (type_ == OptimizerType::kSgd) {
    if (momentum != 0.0) state0_ = at::zeros(master_.sizes(), options);  // the momentum buffer
  } else if (master_.is_cpu() && master_.scalar_type() == at::kFloat && state_dtype == at::kFloat) {
    // The CPU kernel's moments: zeroed by the threads that will update them.
    state0_ = at::empty(master_.sizes(), options);
    state1_ = at::empty(master_.sizes(), options);
    kernels::adam_cpu_first_touch(
        {state0_.data_ptr<float>(), state1_.data_ptr<float>()}, master_.numel(),
        update_groups.empty() ? std::vector<std::vector<Segment>>{segments_} : update_groups);
  } else {
    state0_ = at::zeros(master_.sizes(), options);
    state1_ = at::zeros(master_.sizes(), options);
  }
}

void ShardOptimizer::set_state(int64_t steps, const at::Tensor& s0, const at::Tensor& s1) {
  steps_ = steps;
  if (s0.defined()) state0_.copy_(s0);
  if (s1.defined() && state1_.defined()) state1_.copy_(s1);
}

int64_t ShardOptimizer::state_bytes(bool with_master) const {
  int64_t bytes = with_master ? static_cast<int64_t>(master_.nbytes()) : 0;
  if (state0_.defined()) bytes += static_cast<int64_t>(state0_.nbytes());
  if (state1_.defined()) bytes += static_cast<int64_t>(state1_.nbytes());
  return bytes;
}

void ShardOptimizer::update(const at::Tensor& grad, const UpdateHyper& hyper,
                            const std::vector<Segment>& segments, int64_t grad_offset,
                            const at::Tensor& grad_sq, const at::Tensor& compute_copy) {
  TORCH_CHECK(grad.dim() == 1 && grad_offset >= 0 && grad_offset + grad.numel() <= master_.numel(),
              "ShardOptimizer::update: gradient shape mismatch");
  TORCH_CHECK(!compute_copy.defined() || compute_copy.sizes() == grad.sizes(),
              "ShardOptimizer::update: the compute copy must have the gradient's shape");
  for (const Segment& s : segments) {
    TORCH_CHECK(s.offset >= grad_offset && s.offset + s.length <= grad_offset + grad.numel(),
                "ShardOptimizer::update: a segment lies outside the given gradients");
  }
  if (step_mixed(grad, hyper, segments, grad_offset, grad_sq, compute_copy)) return;
  at::Tensor g = grad.device() == master_.device() ? grad : grad.to(master_.device());
  const bool fp32_state = master_.scalar_type() == at::kFloat && state0_.defined() &&
                          state0_.scalar_type() == at::kFloat;
  // A lower-precision gradient for fp32 masters is widened first (exactly), so every path
  // computes what it computes on an fp32 gradient.
  if (fp32_state && g.scalar_type() != at::kFloat) g = g.to(at::kFloat);
  const bool all_fp32 = fp32_state && g.scalar_type() == at::kFloat;
  bool squared = false;
  if (type_ == OptimizerType::kSgd) {
    step_sgd(g, hyper, segments, grad_offset);
  } else if (master_.is_cpu() && all_fp32) {
    step_cpu(g.contiguous(), hyper, segments, grad_offset);
  } else {
    squared = step_generic(g, hyper, segments, grad_offset, grad_sq);
  }
  if (grad_sq.defined() && !squared) {
    for (const Segment& s : segments) {
      at::Tensor norm = at::linalg_vector_norm(g.narrow(0, s.offset - grad_offset, s.length), 2,
                                               c10::nullopt, false, at::kFloat);
      grad_sq.add_(norm.square().to(grad_sq.device()));
    }
  }
  if (compute_copy.defined()) {
    for (const Segment& s : segments) {
      compute_copy.narrow(0, s.offset - grad_offset, s.length)
          .copy_(master_.narrow(0, s.offset, s.length));
    }
  }
}

bool ShardOptimizer::step_mixed(const at::Tensor& grad, const UpdateHyper& h,
                                const std::vector<Segment>& segs, int64_t grad_offset,
                                const at::Tensor& grad_sq, const at::Tensor& compute_copy) {
  if (type_ != OptimizerType::kAdamW || !h.bias_correction ||
      !kernels::fused_adamw_mixed_applies(master_, grad, state0_, state1_, compute_copy)) {
    return false;
  }
  UpdateHyper k = h;
  k.step = steps_;
  for (const Segment& s : segs) {
    k.weight_decay = s.decay ? h.weight_decay : 0.0;
    const int64_t at = s.offset - grad_offset;
    kernels::fused_adamw_mixed(
        master_.narrow(0, s.offset, s.length), grad.narrow(0, at, s.length),
        state0_.narrow(0, s.offset, s.length), state1_.narrow(0, s.offset, s.length), k, grad_sq,
        compute_copy.defined() ? compute_copy.narrow(0, at, s.length) : at::Tensor());
  }
  return true;
}

void ShardOptimizer::step_sgd(const at::Tensor& grad_in, const UpdateHyper& h,
                              const std::vector<Segment>& segs, int64_t grad_offset) {
  const at::Tensor grad = h.grad_scale == 1.0 ? grad_in : grad_in * h.grad_scale;
  // torch.optim.SGD without dampening or Nesterov: d = g + wd·p; buf = d on the first step,
  // else μ·buf + d; p -= lr·buf (lr·d without momentum).
  for (const Segment& s : segs) {
    const double wd = s.decay ? h.weight_decay : 0.0;
    at::Tensor p = master_.narrow(0, s.offset, s.length);
    at::Tensor g = grad.narrow(0, s.offset - grad_offset, s.length);
    at::Tensor d = wd != 0.0 ? g.add(p, wd) : g;
    if (h.momentum == 0.0) {
      p.add_(d, -h.lr);
      continue;
    }
    at::Tensor buf = state0_.narrow(0, s.offset, s.length);
    if (steps_ == 1) {
      buf.copy_(d);
    } else {
      buf.mul_(h.momentum).add_(d);
    }
    p.add_(buf, -h.lr);
  }
}

void ShardOptimizer::step_cpu(const at::Tensor& grad, const UpdateHyper& h,
                              const std::vector<Segment>& segs, int64_t grad_offset) {
  UpdateHyper a = h;
  a.decoupled = type_ == OptimizerType::kAdamW;
  a.step = steps_;
  kernels::adam_cpu_segments(master_.data_ptr<float>(), grad.data_ptr<float>(),
                             state0_.data_ptr<float>(), state1_.data_ptr<float>(), segs, a,
                             grad_offset);
}

bool ShardOptimizer::step_generic(const at::Tensor& grad, const UpdateHyper& h,
                                  const std::vector<Segment>& segs, int64_t grad_offset,
                                  const at::Tensor& grad_sq) {
  const bool same_dtypes =
      grad.scalar_type() == master_.scalar_type() && state0_.scalar_type() == master_.scalar_type();
  if (type_ == OptimizerType::kAdamW && h.bias_correction &&
      kernels::fused_adamw_applies(master_, grad, state0_, state1_)) {
    UpdateHyper k = h;
    k.step = steps_;
    for (const Segment& s : segs) {
      k.weight_decay = s.decay ? h.weight_decay : 0.0;
      kernels::fused_adamw(
          master_.narrow(0, s.offset, s.length), grad.narrow(0, s.offset - grad_offset, s.length),
          state0_.narrow(0, s.offset, s.length), state1_.narrow(0, s.offset, s.length), k, grad_sq);
    }
    return grad_sq.defined();
  }
  if (type_ == OptimizerType::kAdamW && h.bias_correction && master_.is_cuda() && same_dtypes &&
      compat::has_fused_adamw(master_.device())) {
    // One fused launch per weight-decay group over views of the segments.
    for (bool decay : {true, false}) {
      std::vector<at::Tensor> ps, gs, ms, vs;
      for (const Segment& s : segs) {
        if (s.decay != decay) continue;
        ps.push_back(master_.narrow(0, s.offset, s.length));
        gs.push_back(grad.narrow(0, s.offset - grad_offset, s.length));
        ms.push_back(state0_.narrow(0, s.offset, s.length));
        vs.push_back(state1_.narrow(0, s.offset, s.length));
      }
      if (ps.empty()) continue;
      const auto f32 = at::TensorOptions().dtype(at::kFloat).device(master_.device());
      // The kernel only reads it; updates inside backward call this once per parameter.
      if (step_tensor_value_ != steps_) {
        step_tensor_ = at::full({}, static_cast<double>(steps_), f32);
        step_tensor_value_ = steps_;
      }
      const at::Tensor& step = step_tensor_;
      // The fused kernel divides gradients by grad_scale.
      at::Tensor divisor =
          h.grad_scale == 1.0 ? at::Tensor() : at::full({}, 1.0 / h.grad_scale, f32);
      compat::fused_adamw(ps, gs, ms, vs, step, h.lr, h.beta1, h.beta2,
                          decay ? h.weight_decay : 0.0, h.eps, divisor);
    }
    return false;
  }
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(steps_)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(steps_)) : 1.0;
  for (const Segment& s : segs) {
    const double wd = s.decay ? h.weight_decay : 0.0;
    at::Tensor p = master_.narrow(0, s.offset, s.length);
    at::Tensor g = grad.narrow(0, s.offset - grad_offset, s.length);
    if (h.grad_scale != 1.0) g = g * h.grad_scale;
    at::Tensor m = state0_.narrow(0, s.offset, s.length);
    at::Tensor v = state1_.narrow(0, s.offset, s.length);
    if (type_ == OptimizerType::kAdamW) {
      p.mul_(1.0 - h.lr * wd);
    } else if (wd != 0.0) {
      g = g.add(p, wd);
    }
    m.mul_(h.beta1).add_(g, 1.0 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
    at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(h.eps);
    p.addcdiv_(m, denom, -h.lr / bc1);
  }
  return false;
}

}  // namespace zt
