// Whether a request for memory can fit this machine at all, asked before anything is allocated:
// a size read from a config, a flag or a file that is beyond the machine's whole memory is a
// mistake (or a hostile file), said in GiB instead of an allocator's raw text.
#pragma once

#include <string>

namespace zt::capacity {

/// This machine's host memory plus, when `cuda_device` >= 0, that GPU's whole memory, in bytes
/// (0 when unknown).
double machine_bytes(int cuda_device);

/// Throws ConfigError "<what> needs X GiB, more than this machine's Y GiB of memory (host and
/// GPU together); <fix>" when `bytes` exceed machine_bytes(cuda_device). A lower bound of what
/// the request needs is enough: the check only catches what can never fit.
void check_fits(double bytes, int cuda_device, const std::string& what, const std::string& fix);

/// Throws OutOfMemoryError "<what> needs X GiB on <device>, which has Y GiB free; <fix>" when
/// `bytes` exceed `free_bytes` (> 0; the caller measures it: the device's free memory plus what
/// the caching allocator holds unused). `bytes` should be a lower bound of what will be asked
/// for, so that only a request that cannot fit is refused.
void check_free(double bytes, double free_bytes, const std::string& device, const std::string& what,
                const std::string& fix);

/// The host memory new allocations can take without swapping (MemAvailable of /proc/meminfo),
/// in bytes; 0 when unknown. Tests set ZT_TEST_HOST_AVAILABLE_BYTES to stand for it, so that a
/// refusal does not depend on the machine running them.
double host_available_bytes();

/// When `message` is LibTorch's CPU allocator failing ("DefaultCPUAllocator: can't allocate
/// memory: you tried to allocate N bytes ..."), throws OutOfMemoryError "<what>: the host could
/// not allocate X GiB more (Y GiB available); <fix>" instead of its enforce text; returns
/// otherwise, for the caller to rethrow what it caught.
void throw_if_host_allocation_failed(const std::string& message, const std::string& what,
                                     const std::string& fix);

}  // namespace zt::capacity
