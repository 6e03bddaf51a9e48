// The shared decoder's specs, and what they cost in parameters (see blocks.hpp).
#include "model/blocks.hpp"

#include <cmath>

namespace zt::model {

DecoderSpec shared_decoder(const ModelConfig& c) {
  DecoderSpec d;
  RotarySpec rotary;
  rotary.theta = c.rope_theta;
  rotary.scaling = c.rope_scaling;
  rotary.rotary_dim = c.rotary_dim();
  rotary.interleaved = c.rope_interleaved;
  rotary.max_positions = c.max_position_embeddings;
  d.rotaries.push_back(rotary);
  LayerSpec layer;
  layer.attention.heads = c.num_attention_heads;
  layer.attention.kv_heads = c.num_key_value_heads;
  layer.attention.head_dim = c.head_dim;
  layer.attention.qkv_bias = c.qkv_bias;
  layer.attention.o_bias = c.o_proj_bias;
  layer.attention.window = c.sliding_window;
  layer.mlp.intermediate = c.intermediate_size;
  layer.mlp.bias = c.mlp_bias;
  layer.mlp.fused_gate_up = c.fused_gate_up;
  layer.norm.eps = c.rms_norm_eps;
  if (c.post_sublayer_norms) {  // glm4
    layer.norms.after_attention = "post_self_attn_layernorm";
    layer.norms.after_mlp = "post_mlp_layernorm";
  }
  d.layers.assign(static_cast<size_t>(c.num_hidden_layers), layer);
  d.final_norm.eps = c.rms_norm_eps;
  return d;
}

int64_t parameter_count(const DecoderSpec& d, int64_t hidden, int64_t vocab, bool tied,
                        bool active) {
  int64_t total = vocab * hidden + hidden;  // the embeddings and the final norm
  if (!tied) total += vocab * hidden;
  for (const LayerSpec& l : d.layers) {
    const AttentionSpec& a = l.attention;
    const int64_t q = a.heads * a.head_dim, kv = a.kv_heads * a.head_dim;
    total += hidden * (q + 2 * kv) + q * hidden;
    if (a.qkv_bias) total += q + 2 * kv;
    if (a.o_bias) total += hidden;
    if (a.qk_norm) total += 2 * a.head_dim;
    if (a.sinks) total += a.heads;
    if (l.moe) {
      const int64_t experts = active ? l.moe->top_k : l.moe->experts;
      total += l.moe->experts * hidden + experts * 3 * hidden * l.moe->intermediate +
               3 * hidden * l.moe->shared_intermediate;
      if (l.moe->router == MoeSpec::Router::kSigmoidGroups || l.moe->router_bias)
        total += l.moe->experts;
      if (l.moe->expert_bias) total += experts * (2 * l.moe->intermediate + hidden);
    } else {
      total += 3 * hidden * l.mlp.intermediate;
      if (l.mlp.bias) total += 2 * l.mlp.intermediate + hidden;
    }
    for (std::string_view norm : {l.norms.before_attention, l.norms.after_attention,
                                  l.norms.before_mlp, l.norms.after_mlp}) {
      if (!norm.empty()) total += hidden;
    }
  }
  return total;
}

}  // namespace zt::model
