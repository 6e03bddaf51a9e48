// The update rule of DeepSpeed's DynamicLossScaler.update_scale.
#include "precision/loss_scaler.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt {

LossScaler::LossScaler(const LossScalerParams& params) : params_(params) {
  state_.cur_scale = params.initial_scale;
  state_.cur_hysteresis = params.hysteresis;
}

void LossScaler::update(bool overflow) {
  if (!params_.dynamic) return;
  State& s = state_;
  const int64_t delayed_shift = params_.hysteresis;
  if (overflow) {
    if (delayed_shift == 1 || s.cur_hysteresis == 1) {
      if (s.cur_scale == params_.min_scale) {
        throw NumericError(fmt::format(
            "fp16 loss scale already at its minimum ({}) and the gradients still overflow at "
            "step {} — the run diverged; lower the learning rate, use bf16, or lower "
            "fp16.min_loss_scale",
            params_.min_scale, s.cur_iter));
      }
      s.cur_scale = std::max(s.cur_scale / 2.0, params_.min_scale);
    } else {
      s.cur_hysteresis -= 1;
    }
    s.last_overflow_iter = s.cur_iter;
  } else {
    if (params_.consecutive_hysteresis) s.cur_hysteresis = delayed_shift;
    if ((s.cur_iter - s.last_overflow_iter) % params_.scale_window == 0) {
      if (!params_.consecutive_hysteresis) s.cur_hysteresis = delayed_shift;
      s.cur_scale *= 2.0;
    }
  }
  s.cur_iter += 1;
}

}  // namespace zt
