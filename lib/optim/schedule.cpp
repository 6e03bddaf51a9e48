// Formulas of DeepSpeed's lr_schedules.py and HF's get_scheduler, as functions of the number of
// applied optimizer steps.
//
// DeepSpeed steps its scheduler after each optimizer step, starting from
// last_batch_iteration = -1, so the k-th step (0-based) uses the value at iteration k-1; the
// value "before it has started" is min_lr (WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest) or 0
// (WarmupCosineLR). HF's LambdaLR uses lambda(k) for the k-th step.
#include "optim/schedule.hpp"
#include "zerotrain/schedule.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt {
namespace {

constexpr double kPi = 3.14159265358979323846;

// DeepSpeed's warmup fraction at iteration `it` (< warmup).
double warmup_gamma(int64_t it, int64_t warmup, WarmupType type) {
  if (type == WarmupType::kLog)
    return std::log(static_cast<double>(it + 1)) / std::log(static_cast<double>(warmup));
  return static_cast<double>(it) / static_cast<double>(warmup);
}

std::function<double(int64_t)> deepspeed_schedule(const SchedulerConfig& s, double base_lr) {
  const double min_lr = s.warmup_min_lr.value();
  const double max_lr = s.warmup_max_lr.value();
  const int64_t warmup = std::max<int64_t>(2, s.warmup_num_steps.value());
  const int64_t total = s.total_num_steps.value();
  const WarmupType type = s.warmup_type;
  switch (s.type) {
    case SchedulerType::kWarmupLR:
      return [=](int64_t applied) {
        int64_t it = applied - 1;
        if (it < 0) return min_lr;
        double gamma = it < warmup ? warmup_gamma(it, warmup, type) : 1.0;
        return min_lr + (max_lr - min_lr) * gamma;
      };
    case SchedulerType::kWarmupDecayLR:
      return [=](int64_t applied) {
        int64_t it = applied - 1;
        if (it < 0) return min_lr;
        double gamma = it < warmup
                           ? warmup_gamma(it, warmup, type)
                           : std::max(0.0, static_cast<double>(total - it) /
                                               std::max(1.0, static_cast<double>(total - warmup)));
        return min_lr + (max_lr - min_lr) * gamma;
      };
    case SchedulerType::kWarmupCosineLR: {
      const double warmup_min_ratio = s.warmup_min_ratio;
      const double cos_min_ratio = s.cos_min_ratio;
      return [=](int64_t applied) {
        int64_t it = applied - 1;
        if (it < 0) return 0.0;
        double ratio;
        if (it < warmup) {
          ratio = warmup_min_ratio + warmup_gamma(it, warmup, type) * (1.0 - warmup_min_ratio);
        } else {
          double real_last = static_cast<double>(it - warmup + 1);
          double real_total = static_cast<double>(total - warmup);
          double c = (1.0 + std::cos(kPi * real_last / real_total)) / 2.0;
          ratio = std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * c);
        }
        return base_lr * ratio;
      };
    }
    case SchedulerType::kOneCycle: {
      const double lo = s.cycle_min_lr, hi = s.cycle_max_lr;
      const double first = static_cast<double>(s.cycle_first_step_size);
      const double second =
          static_cast<double>(s.cycle_second_step_size.value_or(s.cycle_first_step_size));
      const double total_size = first + second;
      const double step_ratio = first / total_size;
      const double decay_rate = s.decay_lr_rate;
      const int64_t decay_step = s.decay_step_size;
      return [=](int64_t applied) {
        int64_t it = applied - 1;
        if (it < 0) return lo;
        if (static_cast<double>(it) < total_size) {
          double batch = static_cast<double>(it + 1);
          double cycle = std::floor(1.0 + batch / total_size);
          double x = 1.0 + batch / total_size - cycle;
          double scale = x <= step_ratio ? x / step_ratio : (x - 1.0) / (step_ratio - 1.0);
          return lo + (hi - lo) * scale;
        }
        if (decay_step == 0 || decay_rate == 0.0) return lo;
        double interval =
            (static_cast<double>(it) - total_size + 1.0) / static_cast<double>(decay_step);
        return lo / (1.0 + decay_rate * interval);
      };
    }
    case SchedulerType::kLRRangeTest: {
      const double lo = s.lr_range_test_min_lr;
      const double size = static_cast<double>(s.lr_range_test_step_size);
      const double rate = s.lr_range_test_step_rate;
      const bool stairs = s.lr_range_test_staircase;
      return [=](int64_t applied) {
        int64_t it = applied - 1;
        if (it < 0) return lo;
        double interval = static_cast<double>(it + 1) / size;
        if (stairs) interval = std::floor(interval);
        return lo * (1.0 + rate * interval);
      };
    }
  }
  return [base_lr](int64_t) { return base_lr; };
}

std::function<double(int64_t)> hf_schedule(const std::string& type, double base_lr, int64_t warmup,
                                           int64_t total) {
  auto warm = [warmup](int64_t k) {
    return static_cast<double>(k) / static_cast<double>(std::max<int64_t>(1, warmup));
  };
  if (type == "constant") return [base_lr](int64_t) { return base_lr; };
  if (type == "constant_with_warmup") {
    return [=](int64_t k) { return base_lr * (k < warmup ? warm(k) : 1.0); };
  }
  if (type == "cosine") {
    return [=](int64_t k) {
      if (k < warmup) return base_lr * warm(k);
      double progress = static_cast<double>(k - warmup) /
                        static_cast<double>(std::max<int64_t>(1, total - warmup));
      return base_lr * std::max(0.0, 0.5 * (1.0 + std::cos(kPi * 0.5 * 2.0 * progress)));
    };
  }
  if (type == "polynomial") {
    const double lr_end = 1e-7, power = 1.0;
    return [=](int64_t k) {
      if (k < warmup) return base_lr * warm(k);
      if (k > total) return lr_end;
      double decay_steps = static_cast<double>(total - warmup);
      double remaining = 1.0 - static_cast<double>(k - warmup) / decay_steps;
      return (base_lr - lr_end) * std::pow(remaining, power) + lr_end;
    };
  }
  if (type == "inverse_sqrt") {
    const int64_t timescale = warmup > 0 ? warmup : 10000;
    return [=](int64_t k) {
      if (k < warmup) return base_lr * warm(k);
      double shift = static_cast<double>(timescale - warmup);
      return base_lr / std::sqrt((static_cast<double>(k) + shift) / static_cast<double>(timescale));
    };
  }
  // linear (HF's default)
  return [=](int64_t k) {
    if (k < warmup) return base_lr * warm(k);
    return base_lr * std::max(0.0, static_cast<double>(total - k) /
                                       static_cast<double>(std::max<int64_t>(1, total - warmup)));
  };
}

// Whether the schedule counts towards the run's end, which must then be known.
void check_length_known(const std::string& name, bool needs_total, int64_t total_steps) {
  if (needs_total && total_steps <= 0) {
    throw ConfigError(
        fmt::format("the learning-rate schedule '{}' needs the run length: set max_steps "
                    "(without a train_file there are no epochs to count), or use "
                    "lr_scheduler_type constant",
                    name));
  }
}

}  // namespace

LrSchedule LrSchedule::from_deepspeed(const DeepSpeedConfig& ds, int64_t total_steps) {
  LrSchedule s;
  const double base_lr = ds.optimizer.lr.value();
  if (ds.scheduler.present) {
    check_length_known(ds.scheduler.type_name,
                       ds.scheduler.type == SchedulerType::kWarmupDecayLR ||
                           ds.scheduler.type == SchedulerType::kWarmupCosineLR,
                       total_steps);
    s.fn_ = deepspeed_schedule(ds.scheduler, base_lr);
    s.name_ = ds.scheduler.type_name;
  } else {
    s.fn_ = [base_lr](int64_t) { return base_lr; };
    s.name_ = "constant";
  }
  return s;
}

LrSchedule LrSchedule::from_config(const DeepSpeedConfig& ds, const TrainingArguments& args,
                                   int64_t total_steps) {
  LrSchedule s;
  const double base_lr = ds.optimizer.lr.value();
  if (ds.scheduler.present) {
    s = from_deepspeed(ds, total_steps);
  } else {
    const std::string& type = args.lr_scheduler_type;
    check_length_known(
        type, type != "constant" && type != "constant_with_warmup" && type != "inverse_sqrt",
        total_steps);
    s.fn_ = hf_schedule(args.lr_scheduler_type, base_lr, warmup_steps_for(args, total_steps),
                        total_steps);
    s.name_ = args.lr_scheduler_type;
  }
  return s;
}

std::function<double(int64_t)> learning_rate_schedule(const DeepSpeedConfig& ds,
                                                      const TrainingArguments& args,
                                                      int64_t total_steps) {
  return LrSchedule::from_config(ds, args, total_steps).function();
}

}  // namespace zt
