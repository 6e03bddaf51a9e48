// Rotary embeddings, attention, the MLP and the autograd functions of RMSNorm, SwiGLU and
// recomputation (the chunked loss: linear_cross_entropy.cpp; adapters of a Linear: lib/peft/).
#include "model/layers.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/fused.hpp"
#include "model/family.hpp"
#include "util/torch_compat.hpp"

namespace zt::model {

namespace {

// Inverse frequencies with transformers' scaling rules (default, linear, llama3), over the
// rotated dimensions.
at::Tensor inverse_frequencies(const ModelConfig& c) {
  const int64_t dim = c.rotary_dim();
  at::Tensor inv = 1.0 / at::pow(c.rope_theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) /
                                                   static_cast<double>(dim));
  const RopeScaling& s = c.rope_scaling;
  if (s.type == "linear") return inv / s.factor;
  if (s.type != "llama3") return inv;
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = old_len / s.low_freq_factor;
  const double high_wavelen = old_len / s.high_freq_factor;
  const double pi = 3.14159265358979323846;
  at::Tensor wavelen = 2 * pi / inv;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / s.factor, inv);
  at::Tensor smooth =
      (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// GLM's pairs: (x0, x1, x2, x3, ...) → (-x1, x0, -x3, x2, ...).
at::Tensor rotate_pairs(const at::Tensor& x) {
  const at::Tensor even = x.slice(-1, 0, c10::nullopt, 2), odd = x.slice(-1, 1, c10::nullopt, 2);
  return at::stack({-odd, even}, -1).flatten(-2);
}

// Per frequency, the angles of the dimensions it rotates: halves (LLaMA) or adjacent pairs (GLM).
at::Tensor angles(const ModelConfig& c, const at::Tensor& freqs) {
  return c.rope_interleaved ? freqs.repeat_interleave(2, -1) : at::cat({freqs, freqs}, -1);
}

// The rotation as one kernel each way (CUDA): the same values as the expression below.
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

// RoPE on the first rotary_dim dimensions of x [.., head_dim]; the rest pass through.
at::Tensor rotate(const ModelConfig& c, const at::Tensor& x, const at::Tensor& cos,
                  const at::Tensor& sin) {
  const int64_t rd = c.rotary_dim();
  if (kernels::fused_rotary_applies(x, cos, sin, rd)) {
    return RotaryFunction::apply(x, cos, sin, rd, c.rope_interleaved);
  }
  if (rd == x.size(-1) && !c.rope_interleaved) return x * cos + rotate_half(x) * sin;
  const at::Tensor r = x.narrow(-1, 0, rd);
  at::Tensor y = r * cos + (c.rope_interleaved ? rotate_pairs(r) : rotate_half(r)) * sin;
  if (rd == x.size(-1)) return y;
  return at::cat({y, x.narrow(-1, rd, x.size(-1) - rd)}, -1);
}

// Causal FlashAttention within each span of q [N, H, D], k and v [N, Hkv, D], the rows laid
// end to end (compat::varlen_attention_forward), with its backward.
class VarlenAttentionFunction : public torch::autograd::Function<VarlenAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            int64_t max_length, double scale) {
    compat::VarlenAttention r =
        compat::varlen_attention_forward(q, k, v, cu_seqlens, max_length, scale);
    ctx->save_for_backward({q, k, v, r.out, r.logsumexp, r.rng_state, r.unused, cu_seqlens});
    ctx->saved_data["max_length"] = max_length;
    ctx->saved_data["scale"] = scale;
    return r.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    const compat::VarlenAttention fwd{s[3], s[4], s[5], s[6]};
    auto [dq, dk, dv] = compat::varlen_attention_backward(
        grads[0].contiguous(), s[0], s[1], s[2], fwd, s[7], ctx->saved_data["max_length"].toInt(),
        ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const DocumentSpans& spans, double scale) {
  return VarlenAttentionFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                        spans.cu_seqlens, spans.max_length, scale);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, int64_t start, int64_t length,
                                                at::ScalarType dtype, const at::Device& device) {
  at::Tensor inv = inverse_frequencies(c);
  at::Tensor pos = at::arange(start, start + length, at::kLong).to(at::kFloat);
  at::Tensor emb = angles(c, at::outer(pos, inv));
  return {emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)};
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, const at::Tensor& positions,
                                                at::ScalarType dtype) {
  at::Tensor inv = inverse_frequencies(c).to(positions.device());
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv;  // [B, T, D/2]
  at::Tensor emb = angles(c, freqs).unsqueeze(1);                   // [B, 1, T, D]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

Attention::Attention(const ModelConfig& c, const ParamFactory& o) : config(&c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.kv_dim();
  const ModuleNames& names = family_of(c).names;
  if (!names.fused_qkv.empty()) {
    query_key_value = register_module(std::string(names.fused_qkv),
                                      std::make_shared<Linear>(h, q + 2 * kv, c.qkv_bias, o));
    o_proj = register_module(std::string(names.o_proj),
                             std::make_shared<Linear>(q, h, c.o_proj_bias, o));
    return;
  }
  q_proj = register_module("q_proj", std::make_shared<Linear>(h, q, c.qkv_bias, o));
  k_proj = register_module("k_proj", std::make_shared<Linear>(h, kv, c.qkv_bias, o));
  v_proj = register_module("v_proj", std::make_shared<Linear>(h, kv, c.qkv_bias, o));
  o_proj =
      register_module(std::string(names.o_proj), std::make_shared<Linear>(q, h, c.o_proj_bias, o));
}

std::optional<DocumentSpans> document_spans(const at::Tensor& mask, const at::Device& device) {
  const at::Tensor m = mask.to(at::kCPU, at::kLong).contiguous();
  const int64_t rows = m.size(0), width = m.size(1);
  const int64_t* v = m.data_ptr<int64_t>();
  std::vector<int32_t> ends{0};
  int64_t longest = 0;
  std::vector<int64_t> seen;  // the row's document numbers so far
  for (int64_t r = 0; r < rows; ++r) {
    seen.clear();
    for (int64_t t = 0; t < width; ++t) {
      const int64_t doc = v[r * width + t];
      if (t > 0 && doc == v[r * width + t - 1]) continue;
      if (doc != 0 && std::find(seen.begin(), seen.end(), doc) != seen.end()) return std::nullopt;
      seen.push_back(doc);
      if (r > 0 || t > 0) ends.push_back(static_cast<int32_t>(r * width + t));
    }
  }
  ends.push_back(static_cast<int32_t>(rows * width));
  for (size_t i = 1; i < ends.size(); ++i)
    longest = std::max<int64_t>(longest, ends[i] - ends[i - 1]);
  DocumentSpans spans;
  spans.cu_seqlens = at::tensor(ends, at::kInt).to(device);
  spans.max_length = longest;
  return spans;
}

bool varlen_attention_applies(const ModelConfig& c, at::ScalarType dtype,
                              const at::Device& device) {
  static const bool off = [] {
    const char* e = std::getenv("ZT_VARLEN_ATTENTION");
    return e != nullptr && std::string(e) == "0";
  }();
  return compat::has_varlen_attention() && !off && device.is_cuda() &&
         (dtype == at::kBFloat16 || dtype == at::kHalf) && c.head_dim % 8 == 0 &&
         c.head_dim <= 256 && !c.sliding_window;
}

at::Tensor Attention::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& attention_mask, KvCache* cache,
                              const DocumentSpans* spans, bool output_unread) {
  const ModelConfig& c = *config;
  const int64_t b = x.size(0), t = x.size(1), d = c.head_dim;
  const int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads;
  at::Tensor q, k, v;
  if (query_key_value) {
    const at::Tensor qkv = query_key_value->forward(x);
    q = qkv.narrow(-1, 0, heads * d);
    k = qkv.narrow(-1, heads * d, kv_heads * d);
    v = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d);
  } else {
    q = q_proj->forward(x);
    k = k_proj->forward(x);
    v = v_proj->forward(x);
  }
  q = q.view({b, t, heads, d}).transpose(1, 2);
  k = k.view({b, t, kv_heads, d}).transpose(1, 2);
  v = v.view({b, t, kv_heads, d}).transpose(1, 2);
  q = rotate(c, q, cos, sin);
  k = rotate(c, k, cos, sin);
  if (cache != nullptr) {
    if (cache->k.defined()) {
      k = at::cat({cache->k, k}, 2);
      v = at::cat({cache->v, v}, 2);
    }
    cache->k = k;
    cache->v = v;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (spans != nullptr && cache == nullptr) {
    // [B, H, T, D] views of [B, T, H, D] (the rotation writes that layout): rows end to end.
    const at::Tensor out =
        varlen_attention(q.transpose(1, 2).reshape({b * t, heads, d}),
                         k.transpose(1, 2).reshape({b * t, kv_heads, d}),
                         v.transpose(1, 2).reshape({b * t, kv_heads, d}), *spans, scale);
    return o_proj->forward(out.view({b, t, heads * d}), output_unread);
  }
  const int64_t s = k.size(2);  // keys: cached + new (attention handles the head groups)
  // Query i (absolute position s - t + i) sees keys j <= its position, within the sliding
  // window if any, and only real tokens.
  at::Tensor mask;
  const bool padded = attention_mask.numel() > 0;
  if (padded || c.sliding_window || t != s) {
    at::Tensor qpos = at::arange(s - t, s, at::TensorOptions().dtype(at::kLong).device(x.device()));
    at::Tensor kpos = at::arange(0, s, at::TensorOptions().dtype(at::kLong).device(x.device()));
    mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1);  // [t, s]
    if (c.sliding_window)
      mask = mask.logical_and(kpos.unsqueeze(0) > qpos.unsqueeze(1) - *c.sliding_window);
    mask = mask.view({1, 1, t, s});
    if (padded) {
      // Real keys of the query's own document (queries are the last t of the s keys).
      at::Tensor kdoc = attention_mask.view({b, 1, 1, s});
      at::Tensor qdoc = attention_mask.narrow(1, s - t, t).view({b, 1, t, 1});
      mask = mask.logical_and(kdoc.ne(0)).logical_and(kdoc.eq(qdoc).logical_or(qdoc.eq(0)));
    }
  }
  at::Tensor out = compat::attention(q, k, v, mask, /*causal=*/!mask.defined(), scale);
  return o_proj->forward(out.transpose(1, 2).reshape({b, t, heads * d}), output_unread);
}

Mlp::Mlp(const ModelConfig& c, const ParamFactory& o) {
  if (c.fused_gate_up) {
    const ModuleNames& names = family_of(c).names;
    gate_up_proj =
        register_module(std::string(names.gate_up_proj),
                        std::make_shared<Linear>(c.hidden_size, 2 * c.intermediate_size, false, o));
    down_proj =
        register_module(std::string(names.down_proj),
                        std::make_shared<Linear>(c.intermediate_size, c.hidden_size, false, o));
    return;
  }
  gate_proj = register_module(
      "gate_proj", std::make_shared<Linear>(c.hidden_size, c.intermediate_size, c.mlp_bias, o));
  up_proj = register_module(
      "up_proj", std::make_shared<Linear>(c.hidden_size, c.intermediate_size, c.mlp_bias, o));
  down_proj = register_module(
      "down_proj", std::make_shared<Linear>(c.intermediate_size, c.hidden_size, c.mlp_bias, o));
}

DecoderLayer::DecoderLayer(const ModelConfig& c, const ParamFactory& o) {
  self_attn =
      register_module(std::string(family_of(c).names.self_attn), std::make_shared<Attention>(c, o));
  mlp = register_module("mlp", std::make_shared<Mlp>(c, o));
  input_layernorm = register_module("input_layernorm",
                                    std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, o));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, o));
  if (c.post_sublayer_norms) {
    post_self_attn_layernorm = register_module(
        "post_self_attn_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, o));
    post_mlp_layernorm = register_module(
        "post_mlp_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, o));
  }
}

namespace {

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    if (kernels::fused_rms_norm_applies(x, weight)) {  // the same math in one pass (GPU)
      auto [y, r] = kernels::fused_rms_norm(x, weight, eps);
      ctx->save_for_backward({x, weight, r});
      return y;
    }
    at::Tensor h = x.to(at::kFloat);
    at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, r});
    return weight * normalized(h, r, x.scalar_type());
  }

  // (h·r).to(dtype) in one pass: the product is rounded once, as a separate cast would.
  static at::Tensor normalized(const at::Tensor& h, const at::Tensor& r, at::ScalarType dtype) {
    at::Tensor out = at::empty(h.sizes(), h.options().dtype(dtype));
    return at::mul_out(out, h, r);
  }

  // y = w · n, n = (h·r).to(dtype), h = x_fp32, r = (mean(h²) + eps)^-½; with g_n = (g·w) in
  // fp32: dL/dh = r·(g_n − h·r²·Σ(g_n·h)/N) (Σ and N over the last dimension), dL/dw = Σ g·n.
  // Written as two passes over [tokens, hidden] after the dot product (g_n − h·c in place, then
  // ·r into x's dtype) where the formula term by term takes four.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& r = saved[2];
    const at::Tensor& g = grads[0];
    if (kernels::fused_rms_norm_applies(x, weight)) {
      auto [grad_x, grad_weight] = kernels::fused_rms_norm_backward(
          g, x, weight, r, ctx->needs_input_grad(0), ctx->needs_input_grad(1));
      return {grad_x, grad_weight, at::Tensor()};
    }
    at::Tensor h = x.to(at::kFloat);
    at::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(1)) {
      grad_weight = (g * normalized(h, r, x.scalar_type()))
                        .sum_to_size(weight.sizes())
                        .to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor gn = (g * weight).to(at::kFloat);
      at::Tensor dot = (gn * h).sum(-1, /*keepdim=*/true);
      const double n = static_cast<double>(x.size(-1));
      gn.addcmul_(h, r.pow(2) * dot / n, -1.0);
      grad_x = normalized(gn, r, x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor()};
  }
};

// silu(gate) · up in one kernel each way (CUDA), keeping only gate and up for backward (the
// formula's autograd also keeps silu's output). `halves`: gate and up are the halves of one
// fused projection's output `both`, whose gradient is then returned as one tensor.
class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& both, int64_t cols) {
    const bool halves = both.numel() > 0;
    ctx->saved_data["halves"] = halves;
    if (halves) {
      ctx->save_for_backward({both});
      ctx->saved_data["cols"] = cols;
    } else {
      ctx->save_for_backward({gate, up});
    }
    return kernels::fused_swiglu(gate, up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    if (ctx->saved_data["halves"].toBool()) {
      const int64_t cols = ctx->saved_data["cols"].toInt();
      const at::Tensor& both = saved[0];
      auto [grad_both, unused] = kernels::fused_swiglu_backward(
          grads[0], both.narrow(-1, 0, cols), both.narrow(-1, cols, cols), /*halves=*/true);
      return {at::Tensor(), at::Tensor(), grad_both, at::Tensor()};
    }
    auto [grad_gate, grad_up] =
        kernels::fused_swiglu_backward(grads[0], saved[0], saved[1], /*halves=*/false);
    return {grad_gate, grad_up, at::Tensor(), at::Tensor()};
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

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (kernels::fused_swiglu_applies(gate, up)) {
    return SwigluFunction::apply(gate, up, at::empty({0}, gate.options()), gate.size(-1));
  }
  return at::silu(gate) * up;
}

at::Tensor swiglu_halves(const at::Tensor& gate_up) {
  const int64_t cols = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, cols), up = gate_up.narrow(-1, cols, cols);
  if (kernels::fused_swiglu_applies(gate, up)) {
    // gate and up enter as non-differentiable views: the gradient goes to gate_up whole.
    return SwigluFunction::apply(gate.detach(), up.detach(), gate_up, cols);
  }
  return up * at::silu(gate);
}

at::Tensor linear_for_backward(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& kept) {
  // LibTorch 1.13's custom functions need every input defined: none is an empty one.
  const at::Tensor none = at::empty({0}, x.options());
  return LinearForBackward::apply(x, weight, bias.defined() ? bias : none,
                                  kept.defined() ? kept : none);
}

at::Tensor Mlp::forward(const at::Tensor& x, bool output_unread) {
  // The recomputation reads back what the first pass kept, if it kept (nothing is left then).
  at::Tensor a;
  if (gate_up_proj) {
    const at::Tensor both = gate_up_proj->forward(x, false, kept_for_recompute());
    if (gate_up_proj->reuses_kept()) keep_for_recompute_if_room({both});
    a = swiglu_halves(both);
  } else {
    const at::Tensor kept_gate = kept_for_recompute();
    const at::Tensor kept_up = kept_gate.defined() ? kept_for_recompute() : at::Tensor();
    const at::Tensor gate = gate_proj->forward(x, false, kept_gate);
    const at::Tensor up = up_proj->forward(x, false, kept_up);
    if (gate_proj->reuses_kept() && up_proj->reuses_kept()) keep_for_recompute_if_room({gate, up});
    a = swiglu(gate, up);
  }
  return down_proj->forward(a, output_unread);
}

at::Tensor sum_kept(const at::Tensor& x, const at::Tensor& y, const at::Tensor& kept) {
  return SumForBackward::apply(x, y, kept);
}

at::Tensor sum_unread(const at::Tensor& x, const at::Tensor& y) {
  return SumForBackward::apply(x, y, at::empty({0}, x.options()));
}

}  // namespace zt::model
