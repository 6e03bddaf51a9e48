// ZeRO-Offload: the masters and the optimizer state live in (page-locked) host memory and the
// CPU AdamW updates them. At the boundary every bucket's gradients are already reduced (so
// clipping and the overflow check saw all of them); the step is then pipelined per bucket:
// gradients come down while the CPU updates the previous bucket, and updated masters go up
// while it moves on.
//
// Partial offload (offload_optimizer.ratio < 1, DeepSpeed's "Twin-Flow"): the leading buckets
// holding that share of the state stay on the CPU; the others' masters and moments live on the
// device, where their update runs while the CPU works on its share. The host copy of the
// device share is refreshed only when read (checkpoints, exports).
#pragma once

#include <memory>
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

  /// Makes the engine's host state (master, moments) current for the device share too: call
  /// before reading it. Cheap when nothing changed since the last call.
  void sync_host() const;
  /// After the host state was written (a restored checkpoint): the device share takes it.
  void load_from_host();

  const std::vector<at::Tensor>& gradient_slots() const { return slots_; }
  /// Bytes of optimizer state on the device (the share that is not offloaded).
  int64_t device_state_bytes() const;
  /// Where the device share begins in the rank's state (its size when all is offloaded).
  int64_t device_from() const { return split_; }

 private:
  EngineImpl& e_;
  std::vector<at::Tensor> slots_;  ///< pinned host gradients, reused round-robin
  int64_t split_ = 0;              ///< state offset of the first bucket updated on the device
  std::unique_ptr<ShardOptimizer> device_;  ///< the device share's state, offsets from split_
  std::vector<std::vector<Segment>> device_segments_;  ///< by bucket: its runs in device_
  mutable bool host_stale_ = false;  ///< device_ changed since the host copy was made
};

}  // namespace zt::zero
