// Rotary embeddings, attention, the MLP and the decoder layer (their autograd functions:
// functions.cpp; the chunked loss: linear_cross_entropy.cpp; adapters of a Linear: lib/peft/).
#include "model/layers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/fused.hpp"
#include "model/family.hpp"
#include "model/functions.hpp"
#include "model/moe.hpp"
#include "model/sequence_parallel.hpp"
#include "model/tiled_mlp.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/error.hpp"

namespace zt::model {

namespace {

// yarn's attention factor when the file gives none (transformers' get_mscale).
double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

// What cos and sin are multiplied by: 1 but for yarn and longrope.
double attention_factor(const RotarySpec& r) {
  const RopeScaling& s = r.scaling;
  if (s.attention_factor) return *s.attention_factor;
  if (s.type == "yarn") {
    if (s.mscale.value_or(0.0) != 0.0 && s.mscale_all_dim.value_or(0.0) != 0.0)
      return yarn_mscale(s.factor, *s.mscale) / yarn_mscale(s.factor, *s.mscale_all_dim);
    return yarn_mscale(s.factor, 1.0);
  }
  if (s.type == "longrope" && s.factor > 1.0) {
    return std::sqrt(1.0 + std::log(s.factor) /
                               std::log(static_cast<double>(s.original_max_position_embeddings)));
  }
  return 1.0;
}

// yarn: each frequency between its interpolated (÷ factor) and its original value, by a ramp
// over the dimensions whose rotations within the original length lie between beta_slow and
// beta_fast.
at::Tensor yarn_frequencies(const RotarySpec& r, const at::Tensor& exponents) {
  const RopeScaling& s = r.scaling;
  const double dim = static_cast<double>(r.rotary_dim);
  const double pi = 3.14159265358979323846;
  const double original = static_cast<double>(s.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2 * pi)) / (2 * std::log(r.theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;
  const at::Tensor positions = at::pow(r.theta, exponents);
  const at::Tensor extrapolated = 1.0 / positions, interpolated = 1.0 / (s.factor * positions);
  const at::Tensor ramp =
      ((at::arange(r.rotary_dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  const at::Tensor keep = 1 - ramp;  // the share of each frequency left unscaled
  return interpolated * (1 - keep) + extrapolated * keep;
}

// Inverse frequencies over the rotated dimensions with transformers' scaling rules, for
// positions below `reach` (dynamic and longrope choose by it, as transformers' per-forward
// update does from max(position_ids) + 1).
at::Tensor inverse_frequencies(const RotarySpec& r, int64_t reach) {
  const int64_t dim = r.rotary_dim;
  const RopeScaling& s = r.scaling;
  const at::Tensor exponents =
      at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  if (s.type == "yarn") return yarn_frequencies(r, exponents);
  if (s.type == "longrope") {
    const std::vector<double>& f =
        reach > s.original_max_position_embeddings ? s.long_factor : s.short_factor;
    const at::Tensor ext = at::tensor(f, at::kDouble).to(at::kFloat);
    return 1.0 / (ext * at::pow(r.theta, exponents));
  }
  double base = r.theta;
  if (s.type == "dynamic" && reach > r.max_positions) {
    const double grown =
        s.factor * static_cast<double>(reach) / static_cast<double>(r.max_positions) -
        (s.factor - 1);
    base *= std::pow(grown, static_cast<double>(dim) / static_cast<double>(dim - 2));
  }
  at::Tensor inv = 1.0 / at::pow(base, exponents);
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
at::Tensor angles(const RotarySpec& r, const at::Tensor& freqs) {
  return r.interleaved ? freqs.repeat_interleave(2, -1) : at::cat({freqs, freqs}, -1);
}

// Each dtype's own lowest, exactly (a double a little past bf16's range does not convert).
double lowest_of(at::ScalarType t) {
  return t == at::kFloat    ? std::numeric_limits<float>::lowest()
         : t == at::kDouble ? std::numeric_limits<double>::lowest()
         : t == at::kHalf
             ? static_cast<double>(static_cast<float>(std::numeric_limits<c10::Half>::lowest()))
             : static_cast<double>(
                   static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest()));
}

// Attention whose scores are soft-capped before the mask (Gemma 2), as transformers' eager
// attention computes it: (q·kᵀ)·scale → cap·tanh(·/cap) → masked → softmax in fp32 → ·v. q [B, H,
// T, D], k and v [B, KV, S, D] (each key/value head serves H / KV query heads), `mask` [.., T, S]
// (true: attend). Masked scores take the dtype's lowest value, so a row with no key left is
// uniform rather than NaN, as transformers'.
at::Tensor softcapped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, double scale, double cap) {
  const int64_t groups = q.size(1) / k.size(1);
  const at::Tensor keys = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const at::Tensor values = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) * scale;
  scores = at::tanh(scores / cap) * cap;
  scores = scores.masked_fill(mask.logical_not(), lowest_of(q.scalar_type()));
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, values);
}

// Attention with a learned sink logit per head (gpt-oss), as transformers' eager attention
// computes it: (q·kᵀ)·scale, masked to the dtype's lowest, the head's sink appended to each row,
// the row's maximum subtracted, softmax in the scores' dtype, the sink's column dropped, ·v.
// Shapes as softcapped_attention's; `sinks` [H].
at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& mask, double scale, const at::Tensor& sinks) {
  const int64_t groups = q.size(1) / k.size(1);
  const at::Tensor keys = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const at::Tensor values = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(mask.logical_not(), lowest_of(scores.scalar_type()));
  const at::Tensor sink = sinks.to(scores.scalar_type())
                              .view({1, -1, 1, 1})
                              .expand({scores.size(0), scores.size(1), scores.size(2), 1});
  at::Tensor combined = at::cat({scores, sink}, -1);
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  const at::Tensor probs = at::softmax(combined, -1).narrow(-1, 0, scores.size(-1));
  return at::matmul(probs.to(values.scalar_type()), values);
}

// cos or sin of the angles `emb` in fp32, times yarn's or longrope's attention factor.
at::Tensor scaled_cos_sin(const RotarySpec& r, const at::Tensor& emb, bool cosine) {
  const at::Tensor t = cosine ? emb.cos() : emb.sin();
  const double factor = attention_factor(r);
  return factor == 1.0 ? t : t * factor;
}

// RoPE on the first rotary_dim dimensions of x [.., head_dim]; the rest pass through.
at::Tensor rotate(const RotarySpec& spec, const at::Tensor& x, const at::Tensor& cos,
                  const at::Tensor& sin) {
  const int64_t rd = spec.rotary_dim;
  if (kernels::fused_rotary_applies(x, cos, sin, rd)) {
    return fused_rotate(x, cos, sin, rd, spec.interleaved);
  }
  if (rd == x.size(-1) && !spec.interleaved) return x * cos + rotate_half(x) * sin;
  const at::Tensor r = x.narrow(-1, 0, rd);
  at::Tensor y = r * cos + (spec.interleaved ? rotate_pairs(r) : rotate_half(r)) * sin;
  if (rd == x.size(-1)) return y;
  return at::cat({y, x.narrow(-1, rd, x.size(-1) - rd)}, -1);
}

}  // namespace

bool reach_matters(const RotarySpec& r) {
  return r.scaling.type == "dynamic" || r.scaling.type == "longrope";
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const RotarySpec& r, int64_t start, int64_t length,
                                                at::ScalarType dtype, const at::Device& device) {
  at::Tensor inv = inverse_frequencies(r, start + length);
  at::Tensor pos = at::arange(start, start + length, at::kLong).to(at::kFloat);
  at::Tensor emb = angles(r, at::outer(pos, inv));
  return {scaled_cos_sin(r, emb, /*cosine=*/true).to(dtype).to(device),
          scaled_cos_sin(r, emb, /*cosine=*/false).to(dtype).to(device)};
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const RotarySpec& r, const at::Tensor& positions,
                                                at::ScalarType dtype) {
  // dynamic and longrope read how far the positions reach (one host sync, theirs only).
  const int64_t reach =
      reach_matters(r) && positions.numel() > 0 ? positions.max().item<int64_t>() + 1 : 0;
  at::Tensor inv = inverse_frequencies(r, reach).to(positions.device());
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv;  // [B, T, D/2]
  at::Tensor emb = angles(r, freqs).unsqueeze(1);                   // [B, 1, T, D]
  return {scaled_cos_sin(r, emb, /*cosine=*/true).to(dtype),
          scaled_cos_sin(r, emb, /*cosine=*/false).to(dtype)};
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, int64_t start, int64_t length,
                                                at::ScalarType dtype, const at::Device& device) {
  return rotary_tables(decoder_spec(c).rotaries.at(0), start, length, dtype, device);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, const at::Tensor& positions,
                                                at::ScalarType dtype) {
  return rotary_tables(decoder_spec(c).rotaries.at(0), positions, dtype);
}

std::shared_ptr<const quant::FourBitLayout> four_bit_layout(const QuantizationConfig& q,
                                                            int64_t rows, int64_t cols,
                                                            at::ScalarType dtype, int64_t groups) {
  const std::optional<quant::FourBit> type = quant::parse_four_bit(q.quant_type);
  if (!type || !quant::valid_blocksize(q.blocksize)) {
    throw ConfigError(
        fmt::format("4-bit base: quant_type '{}' with blocksize {}: give nf4 or fp4, and a block "
                    "of 32, 64, …, 4096 elements",
                    q.quant_type, q.blocksize));
  }
  auto layout = std::make_shared<quant::FourBitLayout>();
  layout->type = *type;
  layout->blocksize = q.blocksize;
  layout->double_quant = q.double_quant;
  layout->rows = rows;
  layout->cols = cols;
  layout->groups = groups;
  layout->dtype = dtype;
  return layout;
}

Linear::Linear(int64_t in, int64_t out, bool with_bias, const ParamFactory& o)
    : in_features(in), out_features(out) {
  if (o.quantization != nullptr) {
    quantized =
        four_bit_layout(*o.quantization, out, in, c10::typeMetaToScalarType(o.options.dtype()));
    weight = register_parameter("weight", o.bytes(quantized->bytes()), /*requires_grad=*/false);
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

Attention::Attention(const AttentionSpec& s, const RotarySpec& r, int64_t h,
                     const ModuleNames& names, const ParamFactory& o)
    : spec(s), rotary(r) {
  const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  if (!names.fused_qkv.empty()) {
    query_key_value = register_module(std::string(names.fused_qkv),
                                      std::make_shared<Linear>(h, q + 2 * kv, s.qkv_bias, o));
  } else {
    q_proj = register_module("q_proj", std::make_shared<Linear>(h, q, s.qkv_bias, o));
    k_proj = register_module("k_proj", std::make_shared<Linear>(h, kv, s.qkv_bias, o));
    v_proj = register_module("v_proj", std::make_shared<Linear>(h, kv, s.qkv_bias, o));
  }
  o_proj = register_module(std::string(names.o_proj), std::make_shared<Linear>(q, h, s.o_bias, o));
  if (s.qk_norm) {
    q_norm = register_module("q_norm", std::make_shared<RMSNorm>(s.head_dim, *s.qk_norm, o));
    k_norm = register_module("k_norm", std::make_shared<RMSNorm>(s.head_dim, *s.qk_norm, o));
  }
  if (s.sinks) sinks = register_parameter("sinks", o({s.heads}));
}

namespace {

// The blocks of the decoder `c` describes, with one layer at least: a lone block is built from
// a config that may have none (tests).
DecoderSpec with_a_layer(ModelConfig c) {
  c.num_hidden_layers = std::max<int64_t>(1, c.num_hidden_layers);
  return decoder_spec(c);
}

}  // namespace

Attention::Attention(const ModelConfig& c, const ParamFactory& o)
    : Attention(with_a_layer(c).layers.front().attention, with_a_layer(c).rotaries.front(),
                c.hidden_size, family_of(c).names, o) {}

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

bool varlen_attention_applies(const DecoderSpec& d, at::ScalarType dtype,
                              const at::Device& device) {
  static const bool off = [] {
    const char* e = std::getenv("ZT_VARLEN_ATTENTION");
    return e != nullptr && std::string(e) == "0";
  }();
  const bool layers_fit = std::all_of(d.layers.begin(), d.layers.end(), [](const LayerSpec& l) {
    return l.attention.head_dim % 8 == 0 && l.attention.head_dim <= 256 && !l.attention.softcap &&
           !l.attention.sinks;
  });
  return compat::has_varlen_attention() && !off && device.is_cuda() &&
         (dtype == at::kBFloat16 || dtype == at::kHalf) && layers_fit;
}

bool varlen_attention_applies(const ModelConfig& c, at::ScalarType dtype,
                              const at::Device& device) {
  return varlen_attention_applies(decoder_spec(c), dtype, device);
}

at::Tensor Attention::buffered_attention(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, KvCache& cache, double scale) {
  // One query a row (t = 1): its key and value written at the slot, then attention over the
  // buffer's positions the row may see — within the sliding window if any (left padding keeps
  // the rows aligned, so buffer distance is position distance).
  TORCH_CHECK(q.size(2) == 1, "buffered_attention: one query a row, got ", q.size(2));
  cache.k.index_copy_(2, cache.slot, k);
  cache.v.index_copy_(2, cache.slot, v);
  // Only the positions decoding has reached: the rest of the buffer holds no visible key.
  const int64_t reach = cache.reach > 0 ? cache.reach : cache.k.size(2);
  const at::Tensor keys = cache.k.narrow(2, 0, reach), values = cache.v.narrow(2, 0, reach);
  at::Tensor mask = cache.keys.narrow(3, 0, reach);
  if (spec.window) {
    const at::Tensor index = at::arange(reach, cache.slot.options());
    mask = mask.logical_and(index.gt(cache.slot - *spec.window).view({1, 1, 1, -1}));
  }
  if (spec.sinks) return sink_attention(q, keys, values, mask, scale, sinks).transpose(1, 2);
  if (spec.softcap) {
    return softcapped_attention(q, keys, values, mask, scale, *spec.softcap).transpose(1, 2);
  }
  // The query heads of a key head together ([B, kv_heads, group, D]): the products read each
  // key once, with no copy of the keys per query head. Softmax in fp32, as eager attention.
  const int64_t b = q.size(0), kv_heads = keys.size(1), d = q.size(3);
  const int64_t group = q.size(1) / kv_heads;
  const at::Tensor grouped = q.reshape({b, kv_heads, group, d});
  at::Tensor scores = at::matmul(grouped, keys.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, values).view({b, kv_heads * group, 1, d}).transpose(1, 2);
}

at::Tensor Attention::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& attention_mask, KvCache* cache,
                              const DocumentSpans* spans, bool output_unread,
                              const SequenceShard* sequence) {
  const int64_t b = x.size(0), local_t = x.size(1), d = spec.head_dim;
  int64_t t = local_t, heads = spec.heads, kv_heads = spec.kv_heads;
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
  q = q.view({b, t, heads, d});
  k = k.view({b, t, kv_heads, d});
  if (q_norm) {  // over each head's values, before RoPE
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = rotate(rotary, q.transpose(1, 2), cos, sin);
  k = rotate(rotary, k.transpose(1, 2), cos, sin);
  v = v.view({b, t, kv_heads, d}).transpose(1, 2);
  const double scale = spec.scale ? *spec.scale : 1.0 / std::sqrt(static_cast<double>(d));
  if (cache != nullptr && cache->slot.defined()) {
    return o_proj->forward(buffered_attention(q, k, v, *cache, scale).reshape({b, t, heads * d}),
                           output_unread);
  }
  if (cache != nullptr) {
    if (cache->k.defined()) {
      k = at::cat({cache->k, k}, 2);
      v = at::cat({cache->v, v}, 2);
    }
    cache->k = k;
    cache->v = v;
  }
  // Sequence parallelism: this rank's heads over every position from here to the output.
  const SequenceShard* shard = cache == nullptr ? sequence : nullptr;
  at::Tensor head_sinks = sinks;
  if (shard != nullptr) {
    std::tie(q, k, v) = shard->to_heads(q, k, v);
    heads = q.size(1);
    kv_heads = k.size(1);
    t = q.size(2);
    if (spec.sinks) head_sinks = sinks.narrow(0, shard->place * heads, heads);
  }
  at::Tensor out;  // [B, heads, t, D]
  if (spans != nullptr && cache == nullptr) {
    // [B, H, T, D] views of [B, T, H, D] (the rotation writes that layout): rows end to end.
    out = varlen_attention(q.transpose(1, 2).reshape({b * t, heads, d}),
                           k.transpose(1, 2).reshape({b * t, kv_heads, d}),
                           v.transpose(1, 2).reshape({b * t, kv_heads, d}), *spans, scale,
                           spec.window.value_or(0))
              .view({b, t, heads, d})
              .transpose(1, 2);
  } else {
    const int64_t s = k.size(2);  // keys: cached + new (attention handles the head groups)
    // Query i (absolute position s - t + i) sees keys j <= its position, within the sliding
    // window if any, and only real tokens.
    at::Tensor mask;
    const bool padded = attention_mask.numel() > 0;
    // A window of at least s positions hides no key: plain causal attention (the fused kernels).
    const bool windowed = spec.window && *spec.window < s;
    if (padded || windowed || t != s || spec.softcap || spec.sinks) {
      at::Tensor qpos =
          at::arange(s - t, s, at::TensorOptions().dtype(at::kLong).device(x.device()));
      at::Tensor kpos = at::arange(0, s, at::TensorOptions().dtype(at::kLong).device(x.device()));
      mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1);  // [t, s]
      if (windowed) mask = mask.logical_and(kpos.unsqueeze(0) > qpos.unsqueeze(1) - *spec.window);
      mask = mask.view({1, 1, t, s});
      if (padded) {
        // Real keys of the query's own document (queries are the last t of the s keys).
        at::Tensor kdoc = attention_mask.view({b, 1, 1, s});
        at::Tensor qdoc = attention_mask.narrow(1, s - t, t).view({b, 1, t, 1});
        mask = mask.logical_and(kdoc.ne(0)).logical_and(kdoc.eq(qdoc).logical_or(qdoc.eq(0)));
      }
    }
    out = spec.sinks     ? sink_attention(q, k, v, mask, scale, head_sinks)
          : spec.softcap ? softcapped_attention(q, k, v, mask, scale, *spec.softcap)
                         : compat::attention(q, k, v, mask, /*causal=*/!mask.defined(), scale);
  }
  const at::Tensor merged = shard != nullptr ? shard->to_positions(out) : out.transpose(1, 2);
  return o_proj->forward(merged.reshape({b, local_t, spec.heads * d}), output_unread);
}

Mlp::Mlp(const MlpSpec& s, int64_t h, const ModuleNames& names, const ParamFactory& o)
    : activation(s.activation) {
  const int64_t i = s.intermediate;
  if (s.fused_gate_up) {
    gate_up_proj = register_module(std::string(names.gate_up_proj),
                                   std::make_shared<Linear>(h, 2 * i, s.bias, o));
    down_proj =
        register_module(std::string(names.down_proj), std::make_shared<Linear>(i, h, s.bias, o));
    return;
  }
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(h, i, s.bias, o));
  up_proj = register_module("up_proj", std::make_shared<Linear>(h, i, s.bias, o));
  down_proj = register_module("down_proj", std::make_shared<Linear>(i, h, s.bias, o));
}

DecoderLayer::DecoderLayer(const LayerSpec& s, const RotarySpec& rotary, int64_t h,
                           const ModuleNames& names, const ParamFactory& o) {
  self_attn = register_module(std::string(names.self_attn),
                              std::make_shared<Attention>(s.attention, rotary, h, names, o));
  if (s.moe) {
    moe = register_module("mlp", std::make_shared<SparseMoe>(*s.moe, h, o, names));
  } else {
    mlp = register_module("mlp", std::make_shared<Mlp>(s.mlp, h, names, o));
  }
  const auto norm = [&](std::string_view name) {
    return name.empty()
               ? nullptr
               : register_module(std::string(name), std::make_shared<RMSNorm>(h, s.norm, o));
  };
  before_attention = norm(s.norms.before_attention);
  before_mlp = norm(s.norms.before_mlp);
  after_attention = norm(s.norms.after_attention);
  after_mlp = norm(s.norms.after_mlp);
}

at::Tensor DecoderLayer::feed_forward(const at::Tensor& x, bool output_unread) {
  if (moe) return moe->forward(x);
  if (mlp_shards) {
    const int64_t hidden = x.size(-1);
    const int64_t tiles = mlp_tiles(x.numel() / hidden, hidden, *mlp_shards);
    if (tiles > 1) return tiled_mlp(*mlp, x, tiles, output_unread);
  }
  return mlp->forward(x, output_unread);
}

at::Tensor Mlp::compute(const at::Tensor& x) {
  const at::Tensor a =
      gate_up_proj ? gated_activation_halves(gate_up_proj->forward(x), activation)
                   : gated_activation(gate_proj->forward(x), up_proj->forward(x), activation);
  return down_proj->forward(a);
}

at::Tensor Mlp::forward(const at::Tensor& x, bool output_unread) {
  // The recomputation reads back what the first pass kept, if it kept (nothing is left then).
  at::Tensor a;
  if (gate_up_proj) {
    const at::Tensor both = gate_up_proj->forward(x, false, kept_for_recompute());
    if (gate_up_proj->reuses_kept()) keep_for_recompute_if_room({both});
    a = gated_activation_halves(both, activation);
  } else {
    const at::Tensor kept_gate = kept_for_recompute();
    const at::Tensor kept_up = kept_gate.defined() ? kept_for_recompute() : at::Tensor();
    const at::Tensor gate = gate_proj->forward(x, false, kept_gate);
    const at::Tensor up = up_proj->forward(x, false, kept_up);
    if (gate_proj->reuses_kept() && up_proj->reuses_kept()) keep_for_recompute_if_room({gate, up});
    a = gated_activation(gate, up, activation);
  }
  return down_proj->forward(a, output_unread);
}

}  // namespace zt::model
