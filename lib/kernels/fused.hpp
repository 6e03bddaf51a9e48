// Tensor-level entry points to zerotrain's CUDA kernels (gpu_kernels.hpp): RMSNorm and AdamW
// in one pass each. Built from fused_cuda.cpp with CUDA LibTorch, else fused_plain.cpp, where
// nothing applies and callers keep their ATen path. Calls run on the current CUDA stream of
// the tensors' device; like ATen ops they may be called from any thread.
#pragma once

#include <ATen/ATen.h>

#include "kernels/update.hpp"

namespace zt::kernels {

/// True when the fused RMSNorm handles x [..., hidden] with weight [hidden]: CUDA tensors of
/// one floating dtype, contiguous and 16-byte aligned, a supported hidden size, and the
/// kernels not switched off (environment ZT_FUSED_KERNELS=0, for comparisons).
bool fused_rms_norm_applies(const at::Tensor& x, const at::Tensor& weight);

/// transformers' RMSNorm: y = weight · (x_fp32 · r).to(x.dtype), r = rsqrt(mean(x_fp32²) + eps),
/// returned with r (fp32 [..., 1]). Only where fused_rms_norm_applies().
std::pair<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps);

/// Gradients of fused_rms_norm from grad_y and the saved x, weight, r; each only when wanted
/// (else undefined).
std::pair<at::Tensor, at::Tensor> fused_rms_norm_backward(const at::Tensor& grad_y,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& r, bool want_x,
                                                          bool want_weight);

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

}  // namespace zt::kernels
