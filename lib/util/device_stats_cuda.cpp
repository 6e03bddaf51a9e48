// device_stats with a CUDA LibTorch: the caching allocator's own counters.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <algorithm>
#include <atomic>

#include "util/device_stats.hpp"

namespace zt::device_stats {
namespace {
const auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
// The cap cap_memory set per device (0: none), so usable_memory answers within it.
constexpr int kMaxDevices = 64;
std::atomic<int64_t> caps[kMaxDevices];
}  // namespace

int64_t peak_allocated(int device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .allocated_bytes[kAggregate]
      .peak;
}

int64_t allocated(int device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .allocated_bytes[kAggregate]
      .current;
}

int64_t peak_reserved(int device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .reserved_bytes[kAggregate]
      .peak;
}

int64_t usable_memory(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const int64_t usable =
      static_cast<int64_t>(free) +
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device))
          .reserved_bytes[kAggregate]
          .current;
  const int64_t cap = device >= 0 && device < kMaxDevices ? caps[device].load() : 0;
  return cap > 0 ? std::min(usable, cap) : usable;
}

void reset_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

int64_t total_memory(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: this is only a size estimate
    return 0;
  }
  return static_cast<int64_t>(total);
}

void cap_memory(int device, int64_t bytes) {
  const int64_t total = total_memory(device);
  if (total <= 0) return;
  if (device >= 0 && device < kMaxDevices) caps[device] = std::min(bytes, total);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(
      std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total)), device);
}

void set_sync_errors(bool on) {
  c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                    : c10::cuda::SyncDebugMode::L_DISABLED);
}

}  // namespace zt::device_stats
