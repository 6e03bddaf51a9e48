// zerotrain's own CUDA kernels, on raw device pointers (no LibTorch here: gpu_kernels.cu is
// compiled by nvcc wherever the CUDA toolkit is, CI included). Callers are in fused_cuda.cpp,
// which checks shapes, dtypes and alignment and picks the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace zt::kernels::gpu {

enum class Scalar { kFloat32, kFloat16, kBFloat16 };

/// Rows of `hidden` elements per RMSNorm launch need hidden % (16 / element size) == 0 and
/// hidden ≤ 16 × 1024 (bf16 / fp16) or 8 × 1024 (fp32): one block of ≤ 1024 threads holds a row
/// in registers, two 16-byte packs per thread.
bool rms_norm_supports(Scalar t, int64_t hidden);

/// y = w · (x·r).to(T), r = (mean(x²) + eps)^-½ per row, in fp32 — transformers' LlamaRMSNorm,
/// roundings included. `r` gets one float per row. x, w, y 16-byte aligned.
cudaError_t rms_norm_forward(Scalar t, const void* x, const void* w, void* y, float* r,
                             int64_t rows, int64_t hidden, float eps, cudaStream_t stream);

/// How many blocks rms_norm_backward uses (rows of `grad_w_partial`).
int rms_norm_backward_blocks(Scalar t, int64_t rows, int64_t hidden, int sm_count);

/// The gradients of rms_norm_forward: `grad_x` (nullable) gets d/dx; `grad_w_partial`
/// (nullable, fp32 [blocks, hidden]) gets per-block sums of d/dw, to be summed over blocks.
cudaError_t rms_norm_backward(Scalar t, const void* grad_y, const void* x, const void* w,
                              const float* r, void* grad_x, float* grad_w_partial, int64_t rows,
                              int64_t hidden, int blocks, cudaStream_t stream);

/// One AdamW update (decoupled weight decay, bias-corrected) in fp32 arithmetic on tensors of
/// one dtype — LibTorch's fused AdamW's formula. The host forms the constants in fp64, so that
/// 1 − β2 is 1e-3 to fp32's precision (1.f − 0.999f, which LibTorch's kernel computes, is
/// 1.3e-5 off).
struct AdamwArgs {
  float decay = 0.f;  ///< lr · weight_decay
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 1e-3f;
  float step_size = 0.f;              ///< lr / (1 − β1^step)
  float bias_correction2_sqrt = 1.f;  ///< √(1 − β2^step)
  float eps = 1e-8f;
  float grad_scale = 1.f;  ///< multiplies the gradient first
};

/// Updates n elements of p, m (exp_avg), v (exp_avg_sq) from g. `grad_sq` (nullable, one float
/// on the device): Σ g² of the unscaled gradient is added to it. `vectorized` needs all four
/// pointers 16-byte aligned.
cudaError_t adamw(Scalar t, void* p, const void* g, void* m, void* v, int64_t n,
                  const AdamwArgs& args, float* grad_sq, bool vectorized, int sm_count,
                  cudaStream_t stream);

}  // namespace zt::kernels::gpu
