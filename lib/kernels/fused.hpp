// Tensor-level entry points to zerotrain's CUDA kernels (gpu_kernels.hpp): RMSNorm, AdamW,
// rotary embedding, SwiGLU and the cross-entropy of a chunk of logits, in one pass each. Built from
// fused_cuda.cpp with CUDA LibTorch, else fused_plain.cpp, where nothing applies and callers keep
// their ATen path. Calls run on the current CUDA stream of the tensors' device; like ATen ops they
// may be called from any thread.
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "kernels/update.hpp"

namespace zt::kernels {

/// True when the fused RMSNorm handles x [..., hidden] with weight [hidden]: CUDA tensors of
/// one floating dtype, contiguous and 16-byte aligned, a supported hidden size, and the
/// kernels not switched off (environment ZT_FUSED_KERNELS=0, for comparisons).
bool fused_rms_norm_applies(const at::Tensor& x, const at::Tensor& weight);

/// transformers' RMSNorm: y = weight · (x_fp32 · r).to(x.dtype), r = rsqrt(mean(x_fp32²) + eps),
/// returned with r (fp32 [..., 1]); `unit_offset`: Gemma's y = (x_fp32 · r · (1 + weight_fp32))
/// .to(x.dtype). Only where fused_rms_norm_applies().
std::pair<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, bool unit_offset = false);

/// Gradients of fused_rms_norm from grad_y and the saved x, weight, r; each only when wanted
/// (else undefined).
std::pair<at::Tensor, at::Tensor> fused_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& r,
    bool want_x, bool want_weight, bool unit_offset = false);

/// True when fused_adamw handles these flat tensors or views of the same elements of them:
/// CUDA, one floating dtype, contiguous, kernels not switched off.
bool fused_adamw_applies(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq);

/// One AdamW update in place (LibTorch's fused AdamW math, in one pass; decoupled decay of
/// hyper.weight_decay on every element, bias-corrected at hyper.step). `grad_sq`: undefined,
/// or an fp32 scalar on the same device that Σ grad² (unscaled) is added to.
void fused_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const UpdateHyper& hyper,
                 const at::Tensor& grad_sq = {});

/// True when fused_adamw_mixed handles fp32 master / exp_avg / exp_avg_sq with a `grad` in bf16
/// or fp16 and `compute_copy` (undefined, or grad's dtype): CUDA, contiguous, one device.
bool fused_adamw_mixed_applies(const at::Tensor& master, const at::Tensor& grad,
                               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                               const at::Tensor& compute_copy);

/// fused_adamw's update of fp32 masters from a compute-dtype gradient (no fp32 copy of it),
/// writing the updated masters rounded into `compute_copy` (if defined) in the same pass.
void fused_adamw_mixed(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const UpdateHyper& hyper,
                       const at::Tensor& grad_sq, const at::Tensor& compute_copy);

/// True when fused_rotary handles x [B, H, T, D] (last dimension contiguous) with cos / sin
/// [T, R] or [B, 1, T, R] of x's dtype (R = rotary_dim, even, ≤ D).
bool fused_rotary_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t rotary_dim);

/// transformers' rotary embedding on x's first rotary_dim dimensions (halves, or adjacent pairs
/// when `interleaved`), the rest passed through, with its roundings; `backward`: the gradient
/// of that for an incoming gradient x. Returns [B, H, T, D] laid out as [B, T, H, D].
at::Tensor fused_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t rotary_dim, bool interleaved, bool backward);

/// True when fused_swiglu handles gate and up [..., I] (one dtype, last dimension contiguous,
/// rows at one stride each: a projection's output or a half of a fused one).
bool fused_swiglu_applies(const at::Tensor& gate, const at::Tensor& up);

/// silu(gate) · up as transformers rounds it (`gelu`: GeGLU's gelu_tanh(gate) · up); contiguous.
at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up, bool gelu = false);

/// The gradients of fused_swiglu for `grad`. `halves`: gate and up are the two halves of one
/// [..., 2I] tensor (gate first) and the result is its gradient, in `.first`; otherwise the
/// gradients of gate and up.
std::pair<at::Tensor, at::Tensor> fused_swiglu_backward(const at::Tensor& grad,
                                                        const at::Tensor& gate,
                                                        const at::Tensor& up, bool halves,
                                                        bool gelu = false);

/// True when fused_cross_entropy handles logits [rows, vocab] (CUDA, contiguous, a floating
/// dtype) and labels [rows] (int64 on the same device).
bool fused_cross_entropy_applies(const at::Tensor& logits, const at::Tensor& labels);

/// Per-row cross-entropy (fp32 [rows]; 0 where the label is -100, NaN for a label outside the
/// vocabulary). `write_grad`: the logits become d loss / d logits (softmax − onehot, 0 on
/// ignored rows) in place, rounded to their dtype. `softcap` > 0: of the soft-capped logits
/// softcap · tanh(z / softcap), the gradient taken through the cap.
at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& labels, bool write_grad,
                               double softcap = 0.0);

/// True when fused_dequantize_4bit handles 4-bit `codes` (contiguous uint8 on a CUDA device)
/// in blocks of `blocksize` (a power of two), the kernels not switched off.
bool fused_dequantize_applies(const at::Tensor& codes, int64_t blocksize);

/// The `numel` values of 4-bit codes, flat in `dtype`: table[code] × absmax (fp32 [blocks], the
/// codes' device) in fp32, then rounded — quant::dequantize_weight's values, bit for bit. Only
/// where fused_dequantize_applies.
at::Tensor fused_dequantize_4bit(const at::Tensor& codes, const at::Tensor& absmax,
                                 const std::array<float, 16>& table, int64_t blocksize,
                                 int64_t numel, at::ScalarType dtype);

/// Double quantization's fp32 absmax from its uint8 codes `q`: code[q] × nested[i / 256] +
/// offset (fp32 [1]), each rounded. On q's device; only where fused_dequantize_applies(q, 256).
at::Tensor fused_dequantize_absmax(const at::Tensor& q, const at::Tensor& nested,
                                   const at::Tensor& code, const at::Tensor& offset);

}  // namespace zt::kernels
