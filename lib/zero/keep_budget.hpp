// EngineOptions::recompute_keep_bytes at work: how many bytes the unit calls alive at once may
// keep from their first pass beyond what their recomputation needs
// (zt::keep_for_recompute_if_room). No tensors here: units.cpp counts the bytes, this decides
// the limit (unit-tested in tests/test_engine_settings.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

namespace zt::zero {

/// What the automatic budget reads of the device (device_stats on CUDA; tests pass their own).
struct DeviceMemory {
  int64_t allocated = 0;      ///< bytes allocated now
  int64_t peak_reserved = 0;  ///< the most the caching allocator has reserved so far
  int64_t usable = 0;         ///< free on the device plus what the allocator holds now
};

/// Shared by the engine and its unit calls, which give their bytes back on backward's threads
/// (`used`); everything else is read and written on the forward thread only.
struct KeepBudget {
  std::atomic<int64_t> used{0};
  int64_t fixed = 0;  ///< the budget, unless `memory` is set (EngineOptions::kAutoKeep)
  /// Set: the automatic budget, read from the device around the first optimizer step this
  /// budget sees (which keeps nothing beyond need and is the measure).
  std::function<DeviceMemory()> memory;

  /// The most bytes all calls may keep beyond need when a call asks for activations of `rows`
  /// rows during optimizer step `step` (the engine's global step: a resumed run starts above 0).
  /// Automatic: 0 during the first step seen; from the next one on, 90% of the usable memory
  /// less the peak reserved by then, less the first step's activations scaled by how many more
  /// rows this call has than the first step's largest.
  int64_t limit(int64_t rows, int64_t step);

 private:
  int64_t first_step_ = -1;
  int64_t resident_ = -1;   ///< allocated when the first step first asked (weights, state)
  int64_t first_rows_ = 0;  ///< the most rows the first step asked for
  bool measured_ = false;
  DeviceMemory after_;  ///< read once, after the first step
};

}  // namespace zt::zero
