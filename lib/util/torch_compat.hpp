// The one place that bridges LibTorch versions: Debian's 1.13 (CI) and 2.x (the GPU machine).
// Everything else calls these helpers instead of testing TORCH_VERSION_* itself.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include <optional>

static_assert(TORCH_VERSION_MAJOR > 1 || (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR >= 13),
              "zerotrain needs LibTorch 1.13 or newer");

#define ZT_TORCH_2 (TORCH_VERSION_MAJOR >= 2)

// c10::Allocator::allocate lost its const in LibTorch 2.3; custom allocators declare
// `c10::DataPtr allocate(size_t n) ZT_ALLOCATE_CONST override`.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define ZT_ALLOCATE_CONST
#else
#define ZT_ALLOCATE_CONST const
#endif

namespace zt::compat {

/// HF's tf32 flag: TF32 tensor cores for fp32 matmuls (cuBLAS) and convolutions (cuDNN).
inline void set_allow_tf32(bool on) {
  at::globalContext().setAllowTF32CuBLAS(on);
  at::globalContext().setAllowTF32CuDNN(on);
}

/// True when LibTorch has a fused multi-tensor AdamW kernel for tensors on `device`
/// (at::_fused_adamw_: CUDA since 2.0, CPU since 2.4).
inline bool has_fused_adamw(const at::Device& device) {
#if ZT_TORCH_2
  return device.is_cuda() || (device.is_cpu() && TORCH_VERSION_MINOR >= 4);
#else
  (void)device;
  return false;
#endif
}

/// One fused AdamW update of every tensor in the lists (decoupled weight decay, bias
/// correction from `step`, which counts this update; gradients divided by `grad_divisor` when
/// it is defined). Only when has_fused_adamw().
inline void fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, const at::Tensor& step, double lr, double beta1,
                        double beta2, double weight_decay, double eps,
                        const at::Tensor& grad_divisor = {}) {
#if ZT_TORCH_2
  std::vector<at::Tensor> steps(params.size(), step);
  std::optional<at::Tensor> divisor;
  if (grad_divisor.defined()) divisor = grad_divisor;
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1,
                    beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, divisor,
                    /*found_inf=*/std::nullopt);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)step, (void)lr;
  (void)beta1, (void)beta2, (void)weight_decay, (void)eps, (void)grad_divisor;
  TORCH_CHECK(false, "fused AdamW needs LibTorch 2.x");
#endif
}

/// True when LibTorch has the grouped GEMM at::_grouped_mm (2.8 and newer): on CUDA, bf16
/// operands on sm90 / sm100 run one CUTLASS kernel for every group, the group sizes read on the
/// device; elsewhere it loops over the groups (reading their sizes on the host).
constexpr bool has_grouped_mm() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  return true;
#else
  return false;
#endif
}

/// at::_grouped_mm(a, b, offs) where has_grouped_mm(): `offs` int32 [G] the groups' end
/// positions along the dimension the 2-D operand(s) are cut in — a [M, K] × b [G, K, N] gives
/// [M, N] with rows [offs[g-1], offs[g]) times b[g]; a [N, M] × b [M, K] (both 2-D) gives
/// [G, N, K], group g the product of columns / rows [offs[g-1], offs[g]).
inline at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  return at::_grouped_mm(a, b, offs);
#else
  (void)a, (void)b, (void)offs;
  TORCH_CHECK(false, "grouped_mm needs LibTorch 2.8 or newer");
#endif
}

/// softmax(q·kᵀ·scale + mask)·v for q [B, H, T, D] and k, v [B, Hkv, S, D] where Hkv divides H
/// (grouped-query attention). `mask` is bool [B or 1, 1, T, S] (true = may attend) or undefined
/// with `causal` set for a plain causal mask. LibTorch ≥ 2.5: scaled_dot_product_attention with
/// native GQA (flash / memory-efficient kernels on GPUs). Older: key/value heads repeated, and
/// on 1.13 the same math as transformers' eager attention (scores in the input dtype, softmax in
/// fp32).
inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& mask, bool causal, double scale) {
  const int64_t groups = q.size(1) / k_in.size(1);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  std::optional<at::Tensor> m;
  if (mask.defined()) m = mask;
  return at::scaled_dot_product_attention(q, k_in, v_in, m, 0.0, causal && !mask.defined(), scale,
                                          /*enable_gqa=*/groups > 1);
#else
  at::Tensor k = groups > 1 ? k_in.repeat_interleave(groups, 1) : k_in;
  at::Tensor v = groups > 1 ? v_in.repeat_interleave(groups, 1) : v_in;
#if ZT_TORCH_2
  std::optional<at::Tensor> m;
  if (mask.defined()) m = mask;
  return at::scaled_dot_product_attention(q, k, v, m, 0.0, causal && !mask.defined(), scale);
#else
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  at::Tensor allowed = mask;
  if (!allowed.defined() && causal) {
    allowed = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool))
                  .tril(k.size(-2) - q.size(-2));
  }
  if (allowed.defined()) {
    double lowest = q.scalar_type() == at::kHalf       ? -65504.0
                    : q.scalar_type() == at::kBFloat16 ? -3.3895313892515355e38
                                                       : -3.4028234663852886e38;
    scores = scores.masked_fill(allowed.logical_not(), lowest);
  }
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v);
#endif
#endif
}

/// True when LibTorch has FlashAttention's variable-length entry points
/// (at::_flash_attention_forward / _backward taking cumulative sequence lengths, as in 2.5 and
/// newer). They run on CUDA only, for fp16 / bf16.
constexpr bool has_varlen_attention() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  return true;
#else
  return false;
#endif
}

/// What varlen_attention_forward returns and its backward needs again.
struct VarlenAttention {
  at::Tensor out;        ///< [N, H, D]
  at::Tensor logsumexp;  ///< per query and head, fp32
  at::Tensor rng_state, unused;
};

/// Causal FlashAttention within each of n sequences laid end to end: q [N, H, D], k and v
/// [N, Hkv, D] (Hkv divides H), `cu_seqlens` int32 [n + 1] on the device (0, then where each
/// sequence ends), `max_len` at least the longest. `window_left` ≥ 0: a query sees the keys at
/// most that many positions before it (FlashAttention's window_size_left), −1: all. Only when
/// has_varlen_attention().
inline VarlenAttention varlen_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& cu_seqlens,
                                                int64_t max_len, double scale,
                                                int64_t window_left = -1) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  const std::optional<int64_t> left =
      window_left >= 0 ? std::optional<int64_t>(window_left) : std::nullopt;
  auto r = at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
                                        /*dropout_p=*/0.0, /*is_causal=*/true,
                                        /*return_debug_mask=*/false, scale, left);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
#else
  (void)q, (void)k, (void)v, (void)cu_seqlens, (void)max_len, (void)scale, (void)window_left;
  TORCH_CHECK(false, "variable-length attention needs LibTorch 2.5 or newer");
#endif
}

/// The gradients of q, k and v for `grad_out` [N, H, D] of varlen_attention_forward.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const VarlenAttention& fwd, const at::Tensor& cu_seqlens, int64_t max_len, double scale,
    int64_t window_left = -1) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  const std::optional<int64_t> left =
      window_left >= 0 ? std::optional<int64_t>(window_left) : std::nullopt;
  return at::_flash_attention_backward(grad_out, q, k, v, fwd.out, fwd.logsumexp, cu_seqlens,
                                       cu_seqlens, max_len, max_len, /*dropout_p=*/0.0,
                                       /*is_causal=*/true, fwd.rng_state, fwd.unused, scale, left);
#else
  (void)grad_out, (void)q, (void)k, (void)v, (void)fwd, (void)cu_seqlens, (void)max_len;
  (void)scale, (void)window_left;
  TORCH_CHECK(false, "variable-length attention needs LibTorch 2.5 or newer");
#endif
}

}  // namespace zt::compat
