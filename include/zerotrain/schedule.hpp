// Learning-rate schedules for an Engine (lib/optim/schedule.cpp): what HF Trainer runs with a
// DeepSpeed config, as one function of the applied step count.
#pragma once

#include <cstdint>
#include <functional>

#include "zerotrain/config.hpp"

namespace zt {

/// The schedule HF Trainer runs with a DeepSpeed config: the config's `scheduler` block when
/// present, else `args.lr_scheduler_type` with its warmup (warmup_steps / warmup_ratio) over
/// `total_steps` optimizer steps; the base rate is the optimizer's `lr`. For
/// EngineOptions::learning_rate. Throws ConfigError when the schedule needs the run's length and
/// `total_steps` ≤ 0. Both configs must be resolved. The function is a pure computation, safe to
/// call from any thread.
std::function<double(int64_t applied)> learning_rate_schedule(const DeepSpeedConfig& ds,
                                                              const TrainingArguments& args,
                                                              int64_t total_steps);

}  // namespace zt
