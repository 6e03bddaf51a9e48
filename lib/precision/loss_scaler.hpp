// DeepSpeed's DynamicLossScaler, rule for rule (REFERENCE §1), and the static scale.
#pragma once

#include <cstdint>

#include "zerotrain/config.hpp"

namespace zt {

class LossScaler {
 public:
  struct State {
    double cur_scale = 1.0;
    int64_t cur_iter = 0;
    int64_t last_overflow_iter = -1;
    int64_t cur_hysteresis = 1;
  };

  /// A scale of 1 that never changes (bf16 / fp32).
  LossScaler() = default;
  explicit LossScaler(const LossScalerParams& params);

  double scale() const { return state_.cur_scale; }
  bool dynamic() const { return params_.dynamic; }

  /// Applies one step's overflow status (the same on every rank). On overflow at the minimum
  /// scale it throws NumericError, as DeepSpeed raises "loss scale already at minimum".
  void update(bool overflow);

  const State& state() const { return state_; }
  void set_state(const State& s) { state_ = s; }

 private:
  LossScalerParams params_{false, 1.0, 1000, 1, false, 1.0};
  State state_;
};

}  // namespace zt
