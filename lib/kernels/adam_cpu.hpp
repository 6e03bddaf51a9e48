// The CPU Adam(W) kernel on flat fp32 arrays (adam_cpu.cpp says how it is vectorized and split
// over threads), and the first touch of the memory it updates.
#pragma once

#include <vector>

#include "kernels/update.hpp"

namespace zt::kernels {

/// Adam(W) over the given segments of flat arrays, on all intra-op threads; decay per segment.
/// `grad` starts at element `grad_offset` of the arrays (it may hold only the segments' range).
void adam_cpu_segments(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                       const std::vector<Segment>& segments, const UpdateHyper& hyper,
                       int64_t grad_offset = 0);
/// Zero-fills `arrays` (each `numel` floats, indexed like the optimizer state): the elements of
/// each group of segments with the threads and ranges adam_cpu_segments uses for that group, the
/// rest on the calling thread. Fresh memory's pages are placed where they are first written, so
/// state first touched this way sits where the update that reads it runs (measured: +18% for
/// the update on the GPU machine's host against memory LibTorch's fill touched).
void adam_cpu_first_touch(const std::vector<float*>& arrays, int64_t numel,
                          const std::vector<std::vector<Segment>>& groups);
/// How many threads adam_cpu_segments splits `elements` over (parallel_ranges' split of
/// [0, elements) into that many ranges is the kernel's).
int64_t adam_cpu_threads(int64_t elements);
/// The kernel on one contiguous array of `n` elements, all decayed; for the benchmark and tests.
void adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
              const UpdateHyper& hyper);
/// The instruction set the kernel dispatched to on this machine ("avx512f", "avx2", ...).
const char* adam_cpu_isa();

}  // namespace zt::kernels
