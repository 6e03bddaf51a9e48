// A long phase's progress before the first step (see phase_meter.hpp).
#include "train/phase_meter.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "util/log.hpp"

namespace zt::train {

std::string duration_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  if (s < 60) return fmt::format("{} s", s);
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

PhaseMeter::PhaseMeter(std::string what, std::string unit, double total, double scale, bool report,
                       std::function<void(const Progress&)> on_progress)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      total_(std::max(0.0, total)),
      scale_(scale > 0 ? scale : 1.0),
      report_(report),
      on_progress_(std::move(on_progress)) {}

double PhaseMeter::seconds() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

// Counts as integers, scaled units (MiB, M values) with three digits or to one decimal.
std::string PhaseMeter::amount(double units) const {
  const double v = units / scale_;
  if (scale_ == 1.0 || v >= 100) return fmt::format("{:.0f}", v);
  return v >= 1 ? fmt::format("{:.1f}", v) : fmt::format("{:.3g}", v);
}

void PhaseMeter::update(double done) {
  done_ = std::max(done_, done);
  if (!report_) return;
  const double elapsed = seconds();
  const double rate = done_ / std::max(1e-9, elapsed);  // units per second
  const double left = total_ > done_ && rate > 0 ? (total_ - done_) / rate : 0.0;
  if (on_progress_) {
    Progress p;
    p.phase = what_;
    p.phase_unit = unit_;
    p.phase_done = done_ / scale_;
    p.phase_total = total_ / scale_;
    p.phase_rate = rate / scale_;
    p.eta_seconds = left;
    on_progress_(p);
  }
  if (elapsed < next_log_) return;
  next_log_ = elapsed + kLogEverySeconds;
  logged_ = true;
  if (total_ > 0) {
    log::info("{}: {} of {} {} ({:.0f}%), {:.3g} {}/s, {} left", what_, amount(done_),
              amount(total_), unit_, 100.0 * done_ / total_, rate / scale_, unit_,
              duration_text(left));
  } else {
    log::info("{}: {} {}, {:.3g} {}/s, {} so far", what_, amount(done_), unit_, rate / scale_,
              unit_, duration_text(elapsed));
  }
}

std::string PhaseMeter::position() const {
  return total_ > 0 ? fmt::format("{} of {} {} done", amount(done_), amount(total_), unit_)
                    : fmt::format("{} {} done", amount(done_), unit_);
}

void PhaseMeter::finish() {
  if (report_ && logged_) {
    log::info("{}: done, {} {} in {}", what_, amount(done_), unit_, duration_text(seconds()));
  }
}

}  // namespace zt::train
