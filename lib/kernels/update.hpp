// What one optimizer update is given, shared by every implementation of it: the ShardOptimizer
// (optim/), the CPU Adam(W) kernel (adam_cpu.hpp) and the fused CUDA AdamW (fused.hpp).
#pragma once

#include <cstdint>

namespace zt {

/// A run of real (non-padding) elements of a flat shard with one weight-decay setting.
struct Segment {
  int64_t offset = 0;
  int64_t length = 0;
  bool decay = true;
};

/// The hyper-parameters of one update. `lr` comes from the schedule each step; the
/// ShardOptimizer fills in `step` and `decoupled` from its own count and type.
struct UpdateHyper {
  double lr = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  /// Of segments that decay (Segment::decay); the others get none.
  double weight_decay = 0.0;
  double momentum = 0.0;  ///< SGD only
  /// AdamW (decay applied to the weights) rather than Adam (L2 added to the gradient).
  bool decoupled = true;
  bool bias_correction = true;
  int64_t step = 1;  ///< this update's number, from 1
  /// Multiplies the gradient inside the update (loss-scale removal and clipping), sparing a
  /// separate pass over it.
  double grad_scale = 1.0;
};

}  // namespace zt
