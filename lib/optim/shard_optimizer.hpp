// AdamW / Adam / SGD on one rank's flat fp32 shard, with weight decay chosen per segment.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "zerotrain/config.hpp"

namespace zt {

/// A run of real (non-padding) elements of the shard with one weight-decay setting.
struct Segment {
  int64_t offset = 0;
  int64_t length = 0;
  bool decay = true;
};

/// Hyper-parameters of one update (lr comes from the schedule each step).
struct UpdateHyper {
  double lr = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, momentum = 0.0;
  bool bias_correction = true;
  /// Multiplies the gradient inside the update (loss-scale removal and clipping), sparing a
  /// separate pass over it.
  double grad_scale = 1.0;
};

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
  /// is added to — on the GPU in the update's own pass over the gradient.
  void update(const at::Tensor& grad, const UpdateHyper& hyper,
              const std::vector<Segment>& segments, int64_t grad_offset = 0,
              const at::Tensor& grad_sq = {});
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

  OptimizerType type_;
  at::Tensor master_, state0_, state1_;
  std::vector<Segment> segments_;
  int64_t steps_ = 0;
  at::Tensor
      step_tensor_;  ///< steps_ on the master's device for the fused kernel, made once a step
  int64_t step_tensor_value_ = -1;
};

namespace kernels {
struct AdamArgs {
  double lr = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled = true, bias_correction = true;
  int64_t step = 1;
  double grad_scale = 1.0;
};
/// Adam(W) over the given segments of flat arrays, on all intra-op threads; decay per segment.
/// `grad` starts at element `grad_offset` of the arrays (it may hold only the segments' range).
void adam_cpu_segments(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                       const std::vector<Segment>& segments, const AdamArgs& args,
                       int64_t grad_offset = 0);
/// Zero-fills `arrays` (each `numel` floats, indexed like the optimizer state): the elements of
/// each group of segments with the threads and ranges adam_cpu_segments uses for that group, the
/// rest on the calling thread. Fresh memory's pages are placed where they are first written, so
/// state first touched this way sits where the update that reads it runs (measured: +18% for
/// the update on the GPU machine's host against memory LibTorch's fill touched).
void adam_cpu_first_touch(const std::vector<float*>& arrays, int64_t numel,
                          const std::vector<std::vector<Segment>>& groups);
/// How many threads adam_cpu_segments splits `elements` over (parallel_ranges' split of
/// [0, elements) into that many ranges is the kernel's).
int64_t adam_cpu_threads(int64_t elements);
/// The CPU Adam kernel on one contiguous array; exposed for the benchmark and tests.
/// `decoupled`: AdamW (decay applied to the weights) else Adam (L2 added to the gradient).
void adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
              double lr, double beta1, double beta2, double eps, double weight_decay,
              bool decoupled, bool bias_correction, int64_t step);
/// The instruction set the CPU kernel dispatched to on this machine ("avx512f", "avx2", ...).
const char* adam_cpu_isa();
}  // namespace kernels

}  // namespace zt
