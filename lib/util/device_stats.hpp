// GPU memory statistics of LibTorch's caching allocator (zeros without a CUDA LibTorch).
#pragma once

#include <cstdint>

namespace zt::device_stats {

/// Peak bytes allocated by LibTorch on `device` since the last reset.
int64_t peak_allocated(int device);
/// Bytes allocated right now.
int64_t allocated(int device);
/// Peak bytes the caching allocator reserved from the device since the last reset.
int64_t peak_reserved(int device);
/// Bytes this process could hold on `device`: what the device has free plus what the caching
/// allocator holds right now (cudaMemGetInfo + the allocator's reserved bytes), no more than a
/// cap_memory cap; 0 without CUDA.
int64_t usable_memory(int device);
void reset_peak(int device);
/// The device's whole memory in bytes (cudaMemGetInfo's total); 0 without CUDA.
int64_t total_memory(int device);
/// Caps what LibTorch's caching allocator may hold on `device` at `bytes` (a smaller card played
/// on a larger one: allocations past it fail as out of memory); nothing without CUDA.
void cap_memory(int device, int64_t bytes);
/// Turns LibTorch's CUDA sync debug mode to "error" (`on`: an operation that makes the host wait
/// for a device — a device-to-host copy, a stream synchronize — throws) or back off.
/// Process-wide; for tests that prove a path never waits. Nothing without CUDA.
void set_sync_errors(bool on);

}  // namespace zt::device_stats
