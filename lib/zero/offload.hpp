// ZeRO-Offload: the masters and the optimizer state live in (page-locked) host memory and the
// CPU AdamW updates them. At the boundary every bucket's gradients are already reduced (so
// clipping and the overflow check saw all of them); the step is then pipelined per bucket:
// gradients come down while the CPU updates the previous bucket, and updated masters go up
// while it moves on.
#pragma once

#include <vector>

#include "zero/engine_impl.hpp"

namespace zt::zero {

class OffloadedOptimizer {
 public:
  /// Host buffers for `engine`'s trainable buckets (a few gradient slots, each as long as the
  /// longest slice — not a host copy of the whole accumulator).
  explicit OffloadedOptimizer(EngineImpl& engine);

  /// The masters: `numel` fp32 values in host memory first written by the threads of the CPU
  /// optimizer's per-bucket updates (`groups`: pages stay where first touched), then
  /// page-locked in place when the model is on a GPU.
  static at::Tensor allocate_master(int64_t numel, bool pin,
                                    const std::vector<std::vector<Segment>>& groups);

  /// One optimizer step with `h` over every trainable bucket, publishing each as it is done.
  void step(const UpdateHyper& h);

  const std::vector<at::Tensor>& gradient_slots() const { return slots_; }

 private:
  EngineImpl& e_;
  std::vector<at::Tensor> slots_;  ///< pinned host gradients, reused round-robin
};

}  // namespace zt::zero
