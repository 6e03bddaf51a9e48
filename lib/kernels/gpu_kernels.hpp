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
/// roundings included; `unit_offset`: y = (x·r·(1 + w)).to(T), Gemma's. `r` gets one float per
/// row. x, w, y 16-byte aligned.
cudaError_t rms_norm_forward(Scalar t, const void* x, const void* w, void* y, float* r,
                             int64_t rows, int64_t hidden, float eps, bool unit_offset,
                             cudaStream_t stream);

/// How many blocks rms_norm_backward uses (rows of `grad_w_partial`).
int rms_norm_backward_blocks(Scalar t, int64_t rows, int64_t hidden, int sm_count);

/// The gradients of rms_norm_forward: `grad_x` (nullable) gets d/dx; `grad_w_partial`
/// (nullable, fp32 [blocks, hidden]) gets per-block sums of d/dw, to be summed over blocks.
cudaError_t rms_norm_backward(Scalar t, const void* grad_y, const void* x, const void* w,
                              const float* r, void* grad_x, float* grad_w_partial, int64_t rows,
                              int64_t hidden, int blocks, bool unit_offset, cudaStream_t stream);

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

/// The same update on fp32 masters p, m, v with a gradient g in the compute dtype `t` (bf16 or
/// fp16); `out` (nullable, dtype `t`) gets the updated masters rounded, in the same pass — the
/// compute copy. `vectorized` needs p, m, v 16-byte and g, out 8-byte aligned.
cudaError_t adamw_mixed(Scalar t, float* p, const void* g, float* m, float* v, void* out, int64_t n,
                        const AdamwArgs& args, float* grad_sq, bool vectorized, int sm_count,
                        cudaStream_t stream);

/// Rotary position embedding of x [B, H, T, D] (strides x_stride for B, H, T; the last
/// dimension contiguous) on its first `rotary_dim` dimensions — halves (LLaMA) or adjacent
/// pairs (`interleaved`, GLM) — the rest copied; out is [B, T, H, D] contiguous. cos / sin
/// [B or 1, T, rotary_dim] (strides cs_stride for B — 0 broadcasts — and T; last contiguous).
/// With the roundings of transformers' `x * cos + rotate_half(x) * sin` in dtype t; `backward`:
/// those of that expression's autograd (the rotation by −θ).
struct RotaryArgs {
  int64_t batch = 0, heads = 0, tokens = 0, head_dim = 0, rotary_dim = 0;
  int64_t x_stride[3] = {0, 0, 0};  ///< B, H, T
  int64_t cs_stride[2] = {0, 0};    ///< B, T
  bool interleaved = false, backward = false;
};
cudaError_t rotary(Scalar t, const void* x, const void* cos, const void* sin, void* out,
                   const RotaryArgs& args, cudaStream_t stream);

/// SwiGLU a = silu(gate) · up (`gelu`: GeGLU, a = gelu_tanh(gate) · up) over rows × cols, gate
/// and up rows `gate_stride` / `up_stride` apart, out contiguous; transformers' roundings (the
/// activation rounded to t, then the product).
cudaError_t swiglu_forward(Scalar t, bool gelu, const void* gate, const void* up, void* out,
                           int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride,
                           cudaStream_t stream);
/// Its autograd: from grad (contiguous rows × cols) and the saved gate / up, d_gate and d_up
/// (rows `grad_gate_stride` / `grad_up_stride` apart; the halves of one buffer for a fused
/// gate_up projection).
cudaError_t swiglu_backward(Scalar t, bool gelu, const void* grad, const void* gate, const void* up,
                            void* grad_gate, void* grad_up, int64_t rows, int64_t cols,
                            int64_t gate_stride, int64_t up_stride, int64_t grad_gate_stride,
                            int64_t grad_up_stride, cudaStream_t stream);

/// Cross-entropy of logits [rows, vocab] (contiguous, dtype t) against labels (int64, −100
/// ignored): loss[row] (fp32) = logsumexp(row) − row[label], 0 for an ignored row, NaN for a
/// label outside [0, vocab). With `write_grad` the row becomes d loss / d logits = softmax −
/// onehot (0 on ignored rows), rounded to t, in place. `softcap` > 0: the logits are first
/// soft-capped, c = softcap · tanh(z / softcap) (Gemma 2), and the gradient is d loss / d z.
cudaError_t cross_entropy(Scalar t, void* logits, const int64_t* labels, float* loss, int64_t rows,
                          int64_t vocab, bool write_grad, float softcap, cudaStream_t stream);

/// The 16 values of a 4-bit code (NF4's or FP4's), passed by value to the kernel.
struct FourBitTable {
  float v[16];
};

/// `n` values of 4-bit codes (two per byte, element 2j in byte j's high nibble): table[code] ×
/// absmax[e >> log2_block] in fp32, stored as T (round to nearest even).
cudaError_t dequantize_4bit(Scalar t, const uint8_t* codes, const float* absmax,
                            const FourBitTable& table, void* out, int64_t n, int log2_block,
                            cudaStream_t stream);

/// Double quantization's absmax: code[q[i]] × nested[i / 256] + *offset, each rounded (no FMA).
cudaError_t dequantize_absmax(const uint8_t* q, const float* nested, const float* code,
                              const float* offset, float* out, int64_t blocks, cudaStream_t stream);

}  // namespace zt::kernels::gpu
