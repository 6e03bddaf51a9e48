// The autograd functions of the model's blocks that layers.cpp calls and layers.hpp does not
// declare (RMSNorm, SwiGLU and the recomputation's are in layers.hpp). Internal to lib/model/.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "model/layers.hpp"

namespace zt::model {

/// RoPE on the first `rotary_dim` dimensions of x by the CUDA kernel each way
/// (kernels::fused_rotary_applies must hold): the values of layers.cpp's expression.
at::Tensor fused_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t rotary_dim, bool interleaved);

/// Causal FlashAttention within each span of q [N, H, D], k and v [N, Hkv, D], the rows laid
/// end to end (compat::varlen_attention_forward), with its backward. `window` > 0: a sliding
/// window of that many positions (the query's own included), as transformers' sliding_window.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const DocumentSpans& spans, double scale, int64_t window = 0);

}  // namespace zt::model
