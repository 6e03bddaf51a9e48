// Dequantizing bitsandbytes' 4-bit blocks on the GPU: one elementwise pass per weight, with the
// products and roundings of quant::dequantize_weight's ATen path (fp32 multiply, then the
// store's round-to-nearest-even), so the two give the same bits.
#include <algorithm>
#include <cstdint>

#include "kernels/gpu_common.cuh"
#include "kernels/gpu_kernels.hpp"

namespace zt::kernels::gpu {
namespace {

constexpr int kQuantThreads = 256;

unsigned grid_for(int64_t work) {
  const int64_t blocks = (work + kQuantThreads - 1) / kQuantThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535 * 16)));
}

// Byte j holds element 2j in its high nibble and 2j + 1 in its low one.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_4bit_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                           FourBitTable table, T* __restrict__ out, int64_t n, int log2_block) {
  const int64_t bytes = (n + 1) / 2;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < bytes;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t b = codes[j];
    const int64_t e = 2 * j;
    // __fmul_rn: the IEEE product, never contracted with anything around it.
    out[e] = from_float<T>(__fmul_rn(table.v[b >> 4], absmax[e >> log2_block]));
    if (e + 1 < n)
      out[e + 1] = from_float<T>(__fmul_rn(table.v[b & 0x0F], absmax[(e + 1) >> log2_block]));
  }
}

// The same values eight at a time: four code bytes in one load, one absmax (a block holds a
// multiple of eight elements, aligned), 16 or 32 bytes out in vector stores; the table in shared
// memory (a kernel parameter indexed by a code would be copied to local memory per thread).
template <typename T>
struct alignas(16) Eight {
  T v[8];
};

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_4bit_x8_kernel(const uint32_t* __restrict__ codes, const float* __restrict__ absmax,
                              FourBitTable table, Eight<T>* __restrict__ out, int64_t groups,
                              int log2_block) {
  __shared__ float values[16];
  if (threadIdx.x < 16) values[threadIdx.x] = table.v[threadIdx.x];
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t w = codes[i];
    const float scale = absmax[(8 * i) >> log2_block];
    Eight<T> r;
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // byte k of the word is byte 4i + k (little-endian)
      const uint32_t b = (w >> (8 * k)) & 0xFF;
      r.v[2 * k] = from_float<T>(__fmul_rn(values[b >> 4], scale));
      r.v[2 * k + 1] = from_float<T>(__fmul_rn(values[b & 0x0F], scale));
    }
    out[i] = r;
  }
}

// code[q] × nested absmax of its block of 256, then + offset: two roundings, as ATen's mul, add.
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_absmax_kernel(const uint8_t* __restrict__ q, const float* __restrict__ nested,
                             const float* __restrict__ code, const float* __restrict__ offset,
                             float* __restrict__ out, int64_t blocks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < blocks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __fadd_rn(__fmul_rn(code[q[i]], nested[i >> 8]), *offset);
  }
}

}  // namespace

cudaError_t dequantize_4bit(Scalar t, const uint8_t* codes, const float* absmax,
                            const FourBitTable& table, void* out, int64_t n, int log2_block,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n % 8 == 0 && log2_block >= 3 && reinterpret_cast<uintptr_t>(codes) % 4 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    const int64_t groups = n / 8;
    const unsigned grid = grid_for(groups);
    const auto* words = reinterpret_cast<const uint32_t*>(codes);
    switch (t) {
      case Scalar::kFloat32:
        dequantize_4bit_x8_kernel<float><<<grid, kQuantThreads, 0, stream>>>(
            words, absmax, table, static_cast<Eight<float>*>(out), groups, log2_block);
        break;
      case Scalar::kFloat16:
        dequantize_4bit_x8_kernel<__half><<<grid, kQuantThreads, 0, stream>>>(
            words, absmax, table, static_cast<Eight<__half>*>(out), groups, log2_block);
        break;
      case Scalar::kBFloat16:
        dequantize_4bit_x8_kernel<__nv_bfloat16><<<grid, kQuantThreads, 0, stream>>>(
            words, absmax, table, static_cast<Eight<__nv_bfloat16>*>(out), groups, log2_block);
        break;
    }
    return cudaPeekAtLastError();
  }
  const unsigned grid = grid_for((n + 1) / 2);
  switch (t) {
    case Scalar::kFloat32:
      dequantize_4bit_kernel<float><<<grid, kQuantThreads, 0, stream>>>(
          codes, absmax, table, static_cast<float*>(out), n, log2_block);
      break;
    case Scalar::kFloat16:
      dequantize_4bit_kernel<__half><<<grid, kQuantThreads, 0, stream>>>(
          codes, absmax, table, static_cast<__half*>(out), n, log2_block);
      break;
    case Scalar::kBFloat16:
      dequantize_4bit_kernel<__nv_bfloat16><<<grid, kQuantThreads, 0, stream>>>(
          codes, absmax, table, static_cast<__nv_bfloat16*>(out), n, log2_block);
      break;
  }
  return cudaPeekAtLastError();
}

cudaError_t dequantize_absmax(const uint8_t* q, const float* nested, const float* code,
                              const float* offset, float* out, int64_t blocks,
                              cudaStream_t stream) {
  if (blocks <= 0) return cudaSuccess;
  dequantize_absmax_kernel<<<grid_for(blocks), kQuantThreads, 0, stream>>>(q, nested, code, offset,
                                                                           out, blocks);
  return cudaPeekAtLastError();
}

}  // namespace zt::kernels::gpu
