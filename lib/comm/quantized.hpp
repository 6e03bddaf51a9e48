// Blockwise int8 exchanges for ZeRO++'s quantized communication: qwZ (stage-3 weight gathers)
// and qgZ (gradient reduce-scatters). Each block of kQuantBlock values shares one fp32 scale,
// its largest magnitude over 127; a value travels as the nearest multiple of its block's scale,
// so its error is at most half a step, amax / 254. A block holding a non-finite value arrives
// non-finite (the overflow checks still see it). Values travel as bytes: per block kQuantBlock
// int8 values, then the blocks' scales, 1 + 4 / kQuantBlock bytes a value (about 0.52 of bf16).
//
// The exchanges are collectives over the communicator (each rank calls them at the same point
// with its own group, as lib/comm/groups.hpp's); the dequantization (and the sum) runs at
// wait(). Same threading as Communicator.
#pragma once

#include <vector>

#include "zerotrain/comm.hpp"

namespace zt::comm {

constexpr int64_t kQuantBlock = 256;

/// Bytes that n values take quantized (blocks padded with zeros).
int64_t quantized_bytes(int64_t n);

/// `values` (rows × n, any floating dtype, contiguous) as rows × quantized_bytes(n) bytes.
at::Tensor quantize_blocks(const at::Tensor& values);

/// The inverse of quantize_blocks: `bytes` (rows × quantized_bytes(n)) as rows × n fp32 values.
at::Tensor dequantize_blocks(const at::Tensor& bytes, int64_t n);

/// qwZ: `output` (group.size() × input.numel(), input's dtype) receives every member's `input`
/// in group order, each quantized on the way. An empty group is the whole job.
WorkHandle quantized_all_gather(Communicator& comm, const at::Tensor& output,
                                const at::Tensor& input, const std::vector<int>& group);

/// qgZ: as group_reduce_scatter (member j receives the sum of every member's chunk j), each
/// chunk quantized on the way and the sum taken in fp32 of the dequantized chunks. An empty
/// group is the whole job.
WorkHandle quantized_reduce_scatter(Communicator& comm, const at::Tensor& output,
                                    const at::Tensor& input, const std::vector<int>& group);

}  // namespace zt::comm
