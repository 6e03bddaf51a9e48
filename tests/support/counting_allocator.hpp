// A CPU allocator that counts live and peak bytes of every LibTorch CPU allocation, installed
// in a test process to measure what the engine really holds.
#pragma once

#include <cstdint>

namespace zt::test {

/// Replaces LibTorch's CPU allocator with a counting wrapper (idempotent). Allocations made
/// before the call are not counted but are freed correctly.
void install_counting_allocator();
int64_t live_cpu_bytes();
int64_t peak_cpu_bytes();
void reset_peak_cpu_bytes();

}  // namespace zt::test
