// The training loop's log window (see log_window.hpp).
#include "train/log_window.hpp"

#include <algorithm>

namespace zt::train {

LogWindow::LogWindow(const at::Device& device, RunLoss before)
    : loss_(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device))),
      start_(Clock::now()),
      closed_(before) {}

void LogWindow::add_step(const at::Tensor& step_loss, int64_t tokens) {
  loss_ += step_loss;
  tokens_ += tokens;
  ++steps_;
}

double LogWindow::local_loss_sum() const {
  return loss_.item<double>();
}

LogRecord LogWindow::close(double global_loss_sum) {
  const double loss = global_loss_sum / static_cast<double>(std::max<int64_t>(1, steps_));
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  LogRecord r;
  r.loss = loss;
  r.tokens_per_second = static_cast<double>(tokens_) / std::max(1e-9, seconds);
  closed_.sum += global_loss_sum;
  closed_.steps += steps_;
  last_logged_loss_ = loss;
  loss_.zero_();
  steps_ = 0;
  tokens_ = 0;
  start_ = Clock::now();
  return r;
}

RunLoss LogWindow::run_loss(double global_loss_sum) const {
  return RunLoss{closed_.sum + global_loss_sum, closed_.steps + steps_};
}

}  // namespace zt::train
