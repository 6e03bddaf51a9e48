// AdamW / Adam / SGD on one rank's flat fp32 shard, with weight decay chosen per segment.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "kernels/update.hpp"
#include "zerotrain/config.hpp"

namespace zt {

/// Owns the optimizer state of a flat master shard and updates it in place.
///
/// The CPU path is a vectorized loop (GCC function multi-versioning: AVX-512 / AVX2 / baseline
/// chosen at load time, no -march baked in) run on all intra-op threads; CUDA uses zerotrain's
/// one-pass AdamW kernel (kernels/fused.hpp) where the dtypes agree, else LibTorch's fused
/// multi-tensor AdamW (2.x), else ATen ops (also the path for bf16 masters on CPU). State
/// tensors live on the master's device (pinned host memory when offloaded).
class ShardOptimizer {
 public:
  /// `momentum` matters for SGD only (no buffer without it). The master may be fp32 or bf16
  /// (DeepSpeed's bf16_master_weights_and_grads); the moments are kept in `state_dtype`.
  /// `update_groups`: the sets of segments update() will be given, one call each (offloaded
  /// steps: one bucket's; empty sets are ignored); host state is first touched by the threads
  /// that update it (kernels::adam_cpu_first_touch). None: the whole segment list, as step()
  /// passes it.
  ShardOptimizer(OptimizerType type, at::Tensor master, std::vector<Segment> segments,
                 double momentum = 0.0, at::ScalarType state_dtype = at::kFloat,
                 const std::vector<std::vector<Segment>>& update_groups = {});

  /// One update with `grad` (same shape as the master) times hyper.grad_scale.
  void step(const at::Tensor& grad, const UpdateHyper& hyper) {
    begin_step();
    update(grad, hyper, segments_);
  }
  /// The same update in pieces (offloaded steps pipeline their copies per bucket): count the
  /// step once, then update disjoint subsets of the segments.
  void begin_step() { ++steps_; }
  /// `grad` holds the state elements [grad_offset, grad_offset + grad.numel()), which must cover
  /// the segments (offloaded steps pass one bucket's gradients at a time). `grad_sq`: undefined,
  /// or an fp32 scalar on the master's device that Σ g² over the segments (before grad_scale)
  /// is added to — on the GPU in the update's own pass over the gradient. `grad` may be in a
  /// lower precision than fp32 masters (updates inside backward hand autograd's gradient over
  /// as it is). `compute_copy`: undefined, or a tensor of grad's shape that receives the
  /// updated masters of the segments rounded to its dtype (the parameters the model computes
  /// with) — on the GPU in the same pass.
  void update(const at::Tensor& grad, const UpdateHyper& hyper,
              const std::vector<Segment>& segments, int64_t grad_offset = 0,
              const at::Tensor& grad_sq = {}, const at::Tensor& compute_copy = {});
  const std::vector<Segment>& segments() const { return segments_; }

  OptimizerType type() const { return type_; }
  int64_t steps() const { return steps_; }
  const at::Tensor& master() const { return master_; }
  /// Adam: exp_avg / exp_avg_sq. SGD with momentum: momentum buffer / undefined.
  const at::Tensor& state0() const { return state0_; }
  const at::Tensor& state1() const { return state1_; }
  void set_state(int64_t steps, const at::Tensor& s0, const at::Tensor& s1);
  /// Bytes of optimizer state; the master's own bytes only with `with_master`.
  int64_t state_bytes(bool with_master = true) const;

 private:
  void step_sgd(const at::Tensor& grad, const UpdateHyper& h, const std::vector<Segment>& segs,
                int64_t grad_offset);
  void step_cpu(const at::Tensor& grad, const UpdateHyper& h, const std::vector<Segment>& segs,
                int64_t grad_offset);
  // True when it also added Σ g² to grad_sq.
  bool step_generic(const at::Tensor& grad, const UpdateHyper& h, const std::vector<Segment>& segs,
                    int64_t grad_offset, const at::Tensor& grad_sq);
  // The fused kernel on fp32 masters and a compute-dtype gradient, compute copy included;
  // false (nothing done) where it does not apply.
  bool step_mixed(const at::Tensor& grad, const UpdateHyper& h, const std::vector<Segment>& segs,
                  int64_t grad_offset, const at::Tensor& grad_sq, const at::Tensor& compute_copy);

  OptimizerType type_;
  at::Tensor master_, state0_, state1_;
  std::vector<Segment> segments_;
  int64_t steps_ = 0;
  at::Tensor
      step_tensor_;  ///< steps_ on the master's device for the fused kernel, made once a step
  int64_t step_tensor_value_ = -1;
};

}  // namespace zt
