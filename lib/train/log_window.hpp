// The training loop's log window: what accumulates between two logged records (each step's
// mean token loss, tokens, time), turned into one LogRecord when the logging strategy says so,
// and the run's mean loss over every logged window for the final summary.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>

#include "train/reporting.hpp"

namespace zt::train {

class LogWindow {
 public:
  using Clock = std::chrono::steady_clock;

  /// `device`: where step losses live (they are added without a host sync).
  explicit LogWindow(const at::Device& device);

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
  /// Mean loss over every step of every closed window (HF's train_loss).
  double run_mean_loss() const;

 private:
  at::Tensor loss_;  ///< Σ of the window's step losses on this rank
  int64_t steps_ = 0, tokens_ = 0;
  Clock::time_point start_;
  double run_loss_sum_ = 0.0, last_logged_loss_ = 0.0;
  int64_t run_loss_steps_ = 0;
};

}  // namespace zt::train
