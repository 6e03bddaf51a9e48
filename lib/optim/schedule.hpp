// Learning-rate schedules: DeepSpeed's (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest) and HF Trainer's lr_scheduler_type values.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "zerotrain/config.hpp"

namespace zt {

class LrSchedule {
 public:
  /// The schedule a resolved config asks for: the DeepSpeed `scheduler` block when present,
  /// else `args.lr_scheduler_type` with its warmup over `total_steps` optimizer steps. The base
  /// learning rate is the optimizer's.
  /// Throws ConfigError when the schedule needs the run's length and `total_steps` ≤ 0.
  static LrSchedule from_config(const DeepSpeedConfig& ds, const TrainingArguments& args,
                                int64_t total_steps);
  /// The DeepSpeed `scheduler` block when present, else the optimizer's constant rate (what an
  /// engine made without an EngineOptions::learning_rate runs).
  static LrSchedule from_deepspeed(const DeepSpeedConfig& ds, int64_t total_steps);

  /// The learning rate of the optimizer step that follows `applied` applied steps (steps
  /// skipped for fp16 overflow do not advance a schedule, as in DeepSpeed and HF).
  double lr(int64_t applied) const { return fn_(applied); }
  const std::function<double(int64_t)>& function() const { return fn_; }
  const std::string& name() const { return name_; }

 private:
  std::function<double(int64_t)> fn_;
  std::string name_;
};

}  // namespace zt
