// device_stats with a CUDA LibTorch: the caching allocator's own counters.
#include <c10/cuda/CUDACachingAllocator.h>

#include "util/device_stats.hpp"

namespace zt::device_stats {
namespace {
const auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
}

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

void reset_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace zt::device_stats
