// The progress of a long phase before the first optimizer step (tokenizing the data, loading
// and quantizing the weights, precomputing the reference): how much is done, the rate and the
// time left, in the log every few seconds and to the host's progress callback (the CLI's
// terminal line) at every update.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>

#include "zerotrain/trainer.hpp"

namespace zt::train {

class PhaseMeter {
 public:
  using Clock = std::chrono::steady_clock;
  /// Seconds between two progress lines in the log (the first comes after as many).
  static constexpr double kLogEverySeconds = 5.0;

  /// Phase `what` ("precomputing the reference") of `total` units (0: not known in advance),
  /// shown in `unit`s of `scale` units each ("batches" 1, "MiB" 2^20). `report`: this rank logs
  /// and calls `on_progress` (rank 0); `on_progress` may be empty.
  PhaseMeter(std::string what, std::string unit, double total, double scale, bool report,
             std::function<void(const Progress&)> on_progress);

  /// `done` units of the phase are finished (not fewer than before).
  void update(double done);
  /// The phase's size, once known (a rank learns how much of the weights it reads as it starts).
  void set_total(double total) { total_ = std::max(0.0, total); }
  /// Where the phase stands, for messages: "12 of 40 batches done".
  std::string position() const;
  /// The phase is over: a closing line in the log when it lasted long enough to have said
  /// where it stood ("… done: 40 batches in 55 s").
  void finish();

 private:
  double seconds() const;
  std::string amount(double units) const;

  std::string what_, unit_;
  double total_, scale_;
  bool report_;
  std::function<void(const Progress&)> on_progress_;
  Clock::time_point start_ = Clock::now();
  double done_ = 0.0;
  double next_log_ = kLogEverySeconds;
  bool logged_ = false;
};

/// A duration for people: "42 s", "3:07", "1:02:03".
std::string duration_text(double seconds);

}  // namespace zt::train
