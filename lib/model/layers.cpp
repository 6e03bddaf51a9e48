// Rotary embeddings, attention, the MLP and the decoder layer (their autograd functions:
// functions.cpp; the chunked loss: linear_cross_entropy.cpp; adapters of a Linear: lib/peft/).
#include "model/layers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/fused.hpp"
#include "model/family.hpp"
#include "model/functions.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/error.hpp"

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

// RoPE on the first rotary_dim dimensions of x [.., head_dim]; the rest pass through.
at::Tensor rotate(const ModelConfig& c, const at::Tensor& x, const at::Tensor& cos,
                  const at::Tensor& sin) {
  const int64_t rd = c.rotary_dim();
  if (kernels::fused_rotary_applies(x, cos, sin, rd)) {
    return fused_rotate(x, cos, sin, rd, c.rope_interleaved);
  }
  if (rd == x.size(-1) && !c.rope_interleaved) return x * cos + rotate_half(x) * sin;
  const at::Tensor r = x.narrow(-1, 0, rd);
  at::Tensor y = r * cos + (c.rope_interleaved ? rotate_pairs(r) : rotate_half(r)) * sin;
  if (rd == x.size(-1)) return y;
  return at::cat({y, x.narrow(-1, rd, x.size(-1) - rd)}, -1);
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

Linear::Linear(int64_t in, int64_t out, bool with_bias, const ParamFactory& o)
    : in_features(in), out_features(out) {
  if (o.quantization != nullptr) {
    const QuantizationConfig& q = *o.quantization;
    const std::optional<quant::FourBit> type = quant::parse_four_bit(q.quant_type);
    if (!type || !quant::valid_blocksize(q.blocksize)) {
      throw ConfigError(fmt::format(
          "4-bit base: quant_type '{}' with blocksize {}: give nf4 or fp4, and a block of 32, "
          "64, …, 4096 elements",
          q.quant_type, q.blocksize));
    }
    auto layout = std::make_shared<quant::FourBitLayout>();
    layout->type = *type;
    layout->blocksize = q.blocksize;
    layout->double_quant = q.double_quant;
    layout->rows = out;
    layout->cols = in;
    layout->dtype = c10::typeMetaToScalarType(o.options.dtype());
    quantized = layout;
    weight = register_parameter("weight", o.bytes(layout->bytes()), /*requires_grad=*/false);
  } else {
    weight = register_parameter("weight", o({out, in}));
  }
  if (with_bias) bias = register_parameter("bias", o({out}));
}

at::Tensor Linear::dense_weight(at::ScalarType dtype) const {
  if (quantized) return quant::dequantize_weight(*quantized, weight, dtype);
  return weight.to(dtype);
}

bool Linear::holds_values() const {
  // ParamFactory's placeholders are one element broadcast: stride 0 along a longer dimension.
  for (int64_t d = 0; d < weight.dim(); ++d) {
    if (weight.size(d) > 1 && weight.stride(d) == 0) return false;
  }
  return true;
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

}  // namespace zt::model
