// The model's autograd functions: RoPE's and varlen attention's kernels, RMSNorm, SwiGLU and the
// recomputation's stand-ins (LinearForBackward, SumForBackward). The blocks that call them:
// layers.cpp; the chunked loss: linear_cross_entropy.cpp; LoRA's: lib/peft/lora.cpp.
#include "model/functions.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "kernels/fused.hpp"
#include "model/layers.hpp"
#include "util/torch_compat.hpp"

namespace zt::model {

namespace {

// The rotation as one kernel each way (CUDA): the same values as layers.cpp's expression.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim,
                            bool interleaved) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["interleaved"] = interleaved;
    return kernels::fused_rotary(x, cos, sin, rotary_dim, interleaved, /*backward=*/false);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor g = grads[0];
    if (g.stride(-1) != 1) g = g.contiguous();
    const at::Tensor dx =
        kernels::fused_rotary(g, saved[0], saved[1], ctx->saved_data["rotary_dim"].toInt(),
                              ctx->saved_data["interleaved"].toBool(), /*backward=*/true);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class VarlenAttentionFunction : public torch::autograd::Function<VarlenAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            int64_t max_length, double scale, int64_t window_left) {
    compat::VarlenAttention r =
        compat::varlen_attention_forward(q, k, v, cu_seqlens, max_length, scale, window_left);
    ctx->save_for_backward({q, k, v, r.out, r.logsumexp, r.rng_state, r.unused, cu_seqlens});
    ctx->saved_data["max_length"] = max_length;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window_left"] = window_left;
    return r.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    const compat::VarlenAttention fwd{s[3], s[4], s[5], s[6]};
    auto [dq, dk, dv] = compat::varlen_attention_backward(
        grads[0].contiguous(), s[0], s[1], s[2], fwd, s[7], ctx->saved_data["max_length"].toInt(),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["window_left"].toInt());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps, bool unit_offset) {
    ctx->saved_data["unit_offset"] = unit_offset;
    if (kernels::fused_rms_norm_applies(x, weight)) {  // the same math in one pass (GPU)
      auto [y, r] = kernels::fused_rms_norm(x, weight, eps, unit_offset);
      ctx->save_for_backward({x, weight, r});
      return y;
    }
    at::Tensor h = x.to(at::kFloat);
    at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, r});
    if (unit_offset) return ((h * r) * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
    return weight * normalized(h, r, x.scalar_type());
  }

  // (h·r).to(dtype) in one pass: the product is rounded once, as a separate cast would.
  static at::Tensor normalized(const at::Tensor& h, const at::Tensor& r, at::ScalarType dtype) {
    at::Tensor out = at::empty(h.sizes(), h.options().dtype(dtype));
    return at::mul_out(out, h, r);
  }

  // y = w · n, n = (h·r).to(dtype), h = x_fp32, r = (mean(h²) + eps)^-½; with g_n = (g·w) in
  // fp32: dL/dh = r·(g_n − h·r²·Σ(g_n·h)/N) (Σ and N over the last dimension), dL/dw = Σ g·n.
  // Unit offset (y = (h·r·(1 + w)).to(dtype)): n = h·r and g_n = g·(1 + w), all in fp32.
  // Written as two passes over [tokens, hidden] after the dot product (g_n − h·c in place, then
  // ·r into x's dtype) where the formula term by term takes four.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& r = saved[2];
    const at::Tensor& g = grads[0];
    const bool unit_offset = ctx->saved_data["unit_offset"].toBool();
    if (kernels::fused_rms_norm_applies(x, weight)) {
      auto [grad_x, grad_weight] = kernels::fused_rms_norm_backward(
          g, x, weight, r, ctx->needs_input_grad(0), ctx->needs_input_grad(1), unit_offset);
      return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
    }
    at::Tensor h = x.to(at::kFloat);
    at::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor n = unit_offset ? h * r : normalized(h, r, x.scalar_type());
      const at::Tensor gn = unit_offset ? g.to(at::kFloat) * n : g * n;
      grad_weight = gn.sum_to_size(weight.sizes()).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor gn = unit_offset ? g.to(at::kFloat) * (1.0 + weight.to(at::kFloat))
                                  : (g * weight).to(at::kFloat);
      at::Tensor dot = (gn * h).sum(-1, /*keepdim=*/true);
      const double n = static_cast<double>(x.size(-1));
      gn.addcmul_(h, r.pow(2) * dot / n, -1.0);
      grad_x = normalized(gn, r, x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

// silu(gate) · up in one kernel each way (CUDA), keeping only gate and up for backward (the
// formula's autograd also keeps silu's output). `halves`: gate and up are the halves of one
// fused projection's output `both`, whose gradient is then returned as one tensor.
class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& both, int64_t cols, bool gelu) {
    const bool halves = both.numel() > 0;
    ctx->saved_data["halves"] = halves;
    ctx->saved_data["gelu"] = gelu;
    if (halves) {
      ctx->save_for_backward({both});
      ctx->saved_data["cols"] = cols;
    } else {
      ctx->save_for_backward({gate, up});
    }
    return kernels::fused_swiglu(gate, up, gelu);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const bool gelu = ctx->saved_data["gelu"].toBool();
    if (ctx->saved_data["halves"].toBool()) {
      const int64_t cols = ctx->saved_data["cols"].toInt();
      const at::Tensor& both = saved[0];
      auto [grad_both, unused] = kernels::fused_swiglu_backward(
          grads[0], both.narrow(-1, 0, cols), both.narrow(-1, cols, cols), /*halves=*/true, gelu);
      return {at::Tensor(), at::Tensor(), grad_both, at::Tensor(), at::Tensor()};
    }
    auto [grad_gate, grad_up] =
        kernels::fused_swiglu_backward(grads[0], saved[0], saved[1], /*halves=*/false, gelu);
    return {grad_gate, grad_up, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A projection's backward without its forward product: the output is the kept values (a new
// handle on them, as SumForBackward) or uninitialized.
class LinearForBackward : public torch::autograd::Function<LinearForBackward> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& kept) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.numel() > 0;
    if (kept.numel() > 0) return kept.detach();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    return at::empty(shape, x.options());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    at::Tensor g = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_x, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) grad_x = at::mm(g, weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) grad_weight = at::mm(g.t(), x.reshape({-1, x.size(-1)}));
    if (ctx->needs_input_grad(2) && ctx->saved_data["bias"].toBool()) grad_bias = g.sum(0);
    return {grad_x, grad_weight, grad_bias, at::Tensor()};
  }
};

// Sums whose values a recomputed unit does not read: the kept values from the first pass, or
// none at all; the sum's backward either way.
class SumForBackward : public torch::autograd::Function<SumForBackward> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& x,
                            const at::Tensor& /*y*/, const at::Tensor& kept) {
    // A new handle on the kept storage (an input returned as is would alias it for autograd).
    return kept.numel() > 0 ? kept.detach() : at::empty(x.sizes(), x.options());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], grads[0], at::Tensor()};
  }
};

// x · Wᵀ + b over a 4-bit W: dequantized in forward and again in backward, so that nothing of W
// but its storage is kept; the storage is frozen (no gradient). `kept` or `output_unread`: as
// LinearForBackward, no product.
class QuantizedLinearFunction : public torch::autograd::Function<QuantizedLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& storage, const at::Tensor& bias,
                            const at::Tensor& kept, const quant::FourBitLayout& layout,
                            bool output_unread) {
    ctx->save_for_backward({storage});
    ctx->saved_data["layout"] = quant::layout_numbers(layout);
    ctx->saved_data["bias"] = bias.numel() > 0;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = layout.rows;
    if (kept.numel() > 0) return kept.detach();
    if (output_unread) return at::empty(shape, x.options());
    const at::Tensor w = quant::dequantize_weight(layout, storage, x.scalar_type());
    return bias.numel() > 0 ? at::linear(x, w, bias) : at::linear(x, w);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const quant::FourBitLayout layout =
        quant::layout_from_numbers(ctx->saved_data["layout"].toIntVector());
    const at::Tensor& g = grads[0];
    at::Tensor grad_x, grad_bias;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::matmul(g, quant::dequantize_weight(layout, saved[0], g.scalar_type()));
    }
    if (ctx->needs_input_grad(2) && ctx->saved_data["bias"].toBool()) {
      grad_bias = g.reshape({-1, layout.rows}).sum(0);
    }
    return {grad_x, at::Tensor(), grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& storage,
                            const quant::FourBitLayout& layout, const at::Tensor& bias,
                            bool output_unread, const at::Tensor& kept) {
  // LibTorch 1.13's custom functions need every input defined: none is an empty one.
  const at::Tensor none = at::empty({0}, x.options());
  return QuantizedLinearFunction::apply(x, storage, bias.defined() ? bias : none,
                                        kept.defined() ? kept : none, layout, output_unread);
}

at::Tensor fused_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t rotary_dim, bool interleaved) {
  return RotaryFunction::apply(x, cos, sin, rotary_dim, interleaved);
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const DocumentSpans& spans, double scale, int64_t window) {
  // transformers' sliding window W: key j is seen from query i when i − j < W, FlashAttention's
  // window_size_left W − 1 (transformers' flash path passes the same).
  return VarlenAttentionFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                        spans.cu_seqlens, spans.max_length, scale,
                                        window > 0 ? window - 1 : int64_t{-1});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps, false);
}

at::Tensor rms_norm_unit_offset(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps, true);
}

at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, Activation act) {
  const bool gelu = act == Activation::kGeluTanh;
  if (kernels::fused_swiglu_applies(gate, up)) {
    return SwigluFunction::apply(gate, up, at::empty({0}, gate.options()), gate.size(-1), gelu);
  }
  // transformers' act_fn(gate) * up, in the activations' dtype.
  return (gelu ? at::gelu(gate, "tanh") : at::silu(gate)) * up;
}

at::Tensor gated_activation_halves(const at::Tensor& gate_up, Activation act) {
  const bool gelu = act == Activation::kGeluTanh;
  const int64_t cols = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, cols), up = gate_up.narrow(-1, cols, cols);
  if (kernels::fused_swiglu_applies(gate, up)) {
    // gate and up enter as non-differentiable views: the gradient goes to gate_up whole.
    return SwigluFunction::apply(gate.detach(), up.detach(), gate_up, cols, gelu);
  }
  return up * (gelu ? at::gelu(gate, "tanh") : at::silu(gate));
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return gated_activation(gate, up, Activation::kSilu);
}

at::Tensor swiglu_halves(const at::Tensor& gate_up) {
  return gated_activation_halves(gate_up, Activation::kSilu);
}

at::Tensor linear_for_backward(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& kept) {
  // LibTorch 1.13's custom functions need every input defined: none is an empty one.
  const at::Tensor none = at::empty({0}, x.options());
  return LinearForBackward::apply(x, weight, bias.defined() ? bias : none,
                                  kept.defined() ? kept : none);
}

at::Tensor sum_kept(const at::Tensor& x, const at::Tensor& y, const at::Tensor& kept) {
  return SumForBackward::apply(x, y, kept);
}

at::Tensor sum_unread(const at::Tensor& x, const at::Tensor& y) {
  return SumForBackward::apply(x, y, at::empty({0}, x.options()));
}

}  // namespace zt::model
