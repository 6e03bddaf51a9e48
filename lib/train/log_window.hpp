// The training loop's log window: what accumulates between two logged records (each step's
// mean token loss, tokens, time), turned into one LogRecord when the logging strategy says so,
// and the run's loss over all its steps for the final summary (a resumed run's earlier steps
// included).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>

#include "train/reporting.hpp"

namespace zt::train {

/// A run's training loss so far: the sum of its steps' losses over all ranks, and the steps.
struct RunLoss {
  double sum = 0.0;
  int64_t steps = 0;
  /// HF's train_loss: the mean step loss (0 before any step).
  double mean() const { return steps > 0 ? sum / static_cast<double>(steps) : 0.0; }
};

class LogWindow {
 public:
  using Clock = std::chrono::steady_clock;

  /// `device`: where step losses live (they are added without a host sync); `before`: the
  /// run's loss before this window (a resumed run's steps up to its checkpoint).
  explicit LogWindow(const at::Device& device, RunLoss before = {});

  /// One optimizer step: its mean token loss (a device scalar) and the tokens it trained on.
  void add_step(const at::Tensor& step_loss, int64_t tokens);
  bool empty() const { return steps_ == 0; }
  /// The window's record (step, epoch, learning rate etc. are the caller's): its mean loss
  /// over `world` ranks' sum `global_loss_sum` of the steps' losses, and tokens per second.
  /// Then starts a new window.
  LogRecord close(double global_loss_sum);
  /// The sum of this window's step losses on this rank (the caller all-reduces it).
  double local_loss_sum() const;

  double last_logged_loss() const { return last_logged_loss_; }
  /// Every step's loss so far: the run's before this window and this window's, whose sum over
  /// ranks is `global_loss_sum` (the caller all-reduces local_loss_sum; 0 when empty).
  RunLoss run_loss(double global_loss_sum) const;

 private:
  at::Tensor loss_;  ///< Σ of the window's step losses on this rank
  int64_t steps_ = 0, tokens_ = 0;
  Clock::time_point start_;
  double last_logged_loss_ = 0.0;
  RunLoss closed_;  ///< the steps of the windows closed (and of the run before them)
};

}  // namespace zt::train
