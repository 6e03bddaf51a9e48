// What a decoder is made of, block by block: a family composes these specs from its config
// (Family::compose) and the shared modules build exactly what they say. Maths that no spec can
// express yet is a new block (a field here, its module and CPU path in layers.cpp or a file of
// its own, its kernel in lib/kernels/), never a family's flag threaded through the decoder.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "zerotrain/model.hpp"

namespace zt::model {

/// The names a family's checkpoints give the shared blocks: its module tree, so that parameter
/// names are the family's own (transformers' for HF families). Dotted paths nest holders.
struct ModuleNames {
  std::string_view body = "model";              ///< the decoder under the causal LM
  std::string_view embedding = "embed_tokens";  ///< under the body
  std::string_view layers = "layers";           ///< under the body
  std::string_view final_norm = "norm";         ///< under the body
  std::string_view lm_head = "lm_head";         ///< under the causal LM, or the body (below)
  bool head_in_body = false;
  std::string_view self_attn = "self_attn";  ///< in each layer
  /// Non-empty: q, k and v are one projection of this name (in rows q, k, v), not three.
  std::string_view fused_qkv;
  std::string_view o_proj = "o_proj";
  std::string_view gate_up_proj = "gate_up_proj";  ///< fused_gate_up models
  std::string_view down_proj = "down_proj";
  std::string_view moe_router = "gate";  ///< a mixture's router under `mlp` (gpt-oss: router)
};

/// An RMSNorm: normalized in fp32 and cast back, then scaled by its weight (transformers'
/// LlamaRMSNorm); or, `unit_offset`, scaled by (1 + weight) in fp32 before the cast (Gemma's,
/// whose weights start at 0).
struct NormSpec {
  double eps = 1e-6;
  bool unit_offset = false;
};

/// The gate's activation in the gated MLP: silu (SwiGLU) or gelu with the tanh approximation
/// (GeGLU: transformers' gelu_pytorch_tanh).
enum class Activation { kSilu, kGeluTanh };

/// One rotary embedding: frequencies from `theta` with `scaling`, over the first `rotary_dim`
/// dimensions of each head, rotated in halves (i, i + rotary_dim / 2) or, `interleaved`, in
/// adjacent pairs (GLM).
struct RotarySpec {
  double theta = 10000.0;
  RopeScaling scaling;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  /// max_position_embeddings: where dynamic scaling starts.
  int64_t max_positions = 2048;
};

/// Self-attention of one layer.
struct AttentionSpec {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  bool qkv_bias = false, o_bias = false;
  /// A per-head RMSNorm of the queries and keys (`q_norm`, `k_norm`, weight [head_dim]) after
  /// their projections and before RoPE (Qwen3).
  std::optional<NormSpec> qk_norm;
  /// Keys further back than this are not attended to (a sliding window).
  std::optional<int64_t> window;
  /// The scores' scale; unset: 1 / √head_dim (Gemma: query_pre_attn_scalar^-½).
  std::optional<double> scale;
  /// The scores soft-capped to cap · tanh(scores / cap) before the mask (Gemma 2).
  std::optional<double> softcap;
  /// A learned logit per head (`sinks` [heads]) that joins each row's softmax and takes its
  /// share of the probability, its column then dropped (gpt-oss's attention sinks).
  bool sinks = false;
  /// Which of DecoderSpec::rotaries rotates this layer's queries and keys.
  size_t rotary = 0;
};

/// The gated MLP: down(act(gate(x)) · up(x)), silu (SwiGLU); gate and up as two projections
/// or as the halves of one `gate_up_proj` (gate first).
struct MlpSpec {
  int64_t intermediate = 0;
  bool bias = false;
  bool fused_gate_up = false;
  Activation activation = Activation::kSilu;
};

/// A sparse mixture of experts in a layer's MLP place (transformers' SparseMoeBlock): a router
/// `gate` (weight [experts, hidden], not a Linear: no adapter targets it by default) scores each
/// token; softmax over all experts in fp32, the top_k kept (renormalized to sum 1 where
/// `normalize_top_k`: Qwen3-MoE's norm_topk_prob, Mixtral always); each chosen expert's gated
/// MLP down(act(gate(x)) · up(x)) weighted by its score, summed. The experts' weights are
/// transformers 5's fused tensors `experts.gate_up_proj` [experts, 2·intermediate, hidden] (gate
/// rows first) and `experts.down_proj` [experts, hidden, intermediate]; checkpoints with one
/// module per expert are read into them (model/weights.cpp). Dropless: every (token, expert)
/// pair is computed, no capacity.
struct MoeSpec {
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t intermediate = 0;  ///< each expert's (moe_intermediate_size)
  bool normalize_top_k = false;
  Activation activation = Activation::kSilu;
  /// How the router scores and picks experts: softmax over all, then the top_k (above); or
  /// kSigmoidGroups (GLM-4.5, DeepSeek-V3): sigmoid scores from an fp32 product, the choice by
  /// score + the router's `e_score_correction_bias` (a frozen [experts] parameter) among the
  /// `top_groups` of `groups` equal groups ranked by their two best, the weights the chosen
  /// scores without the bias (renormalized where normalize_top_k, + 1e-20) × `scaling`
  /// (routed_scaling_factor), kept in fp32 for the weighted sum.
  /// kTopKSoftmax (gpt-oss): the top_k of the logits (the router with a bias), their softmax
  /// in the logits' dtype the weights.
  enum class Router { kSoftmaxTopK, kSigmoidGroups, kTopKSoftmax };
  Router router = Router::kSoftmaxTopK;
  int64_t groups = 1, top_groups = 1;
  double scaling = 1.0;
  /// > 0: a shared expert, a dense gated MLP of this width (`shared_experts`), whose output
  /// every token adds to its routed experts' (GLM-4.5's n_shared_experts × moe_intermediate).
  int64_t shared_intermediate = 0;
  /// gpt-oss's experts: the router has a bias; the tensors are [experts, in, out]
  /// (`transposed`) with biases `gate_up_proj_bias` [experts, 2·intermediate] and
  /// `down_proj_bias` [experts, hidden]; gate and up interleave in gate_up's columns (even:
  /// gate), and the activation is the clamped SwiGLU: gate ≤ limit, up in [-limit, limit],
  /// (up + 1) · gate · σ(alpha · gate).
  bool router_bias = false, transposed = false, expert_bias = false, clamped_swiglu = false;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  /// Expert parallelism (ModelConfig::expert_shard): this rank's block holds experts
  /// [shard_rank · local, (shard_rank + 1) · local), local = experts / shard_size.
  int64_t shard_size = 1, shard_rank = 0;
  int64_t local_experts() const { return experts / shard_size; }
};

/// A layer's norms by place, under their module names; an empty name: no norm there.
struct LayerNorms {
  std::string_view before_attention = "input_layernorm";
  std::string_view after_attention;  ///< on the attention's output, before the residual add
  std::string_view before_mlp = "post_attention_layernorm";
  std::string_view after_mlp;  ///< on the MLP's output, before the residual add
};

/// One decoder layer: x + attention(norm(x)), then + mlp(norm(·)), with the norms of `norms`.
struct LayerSpec {
  AttentionSpec attention;
  MlpSpec mlp;
  /// Set: the layer's MLP is this mixture of experts (registered as `mlp`), not `mlp`.
  std::optional<MoeSpec> moe;
  NormSpec norm;
  LayerNorms norms;
};

/// The whole decoder: the rotary embeddings its layers use, the layers, the final norm.
struct DecoderSpec {
  std::vector<RotarySpec> rotaries;
  std::vector<LayerSpec> layers;
  NormSpec final_norm;
  /// The token embeddings × √hidden, the factor rounded to their dtype, inside the embedding
  /// module as transformers 5's Gemma 2 and 3 (their ScaledWordEmbedding): P-Tuning's virtual
  /// tokens, which PEFT hands to the model with the token embeddings as inputs_embeds, enter
  /// unscaled.
  bool scale_embeddings = false;
  /// The logits soft-capped to cap · tanh(logits / cap) (Gemma 2's final_logit_softcapping).
  std::optional<double> logit_softcap;
  /// Set: the mixtures of experts' load-balancing loss is computed, to be added with this
  /// coefficient (transformers' output_router_logits with router_aux_loss_coef).
  std::optional<double> router_aux_coef;
};

/// The decoder that the shared switches of `c` describe (sizes, biases, RoPE, partial and
/// interleaved rotary, a fused gate_up, glm4's output norms, a sliding window on every layer):
/// what every family composes first and then changes.
DecoderSpec shared_decoder(const ModelConfig& c);

/// The decoder the family of `c` composes (Family::compose, else shared_decoder).
DecoderSpec decoder_spec(const ModelConfig& c);

/// Parameters of a decoder of `d` over embeddings [vocab, hidden] (a second matrix for an
/// untied output layer). `active`: those one token's forward multiplies — a mixture's top_k
/// experts rather than all of them (what 6·N FLOPs per token counts).
int64_t parameter_count(const DecoderSpec& d, int64_t hidden, int64_t vocab, bool tied,
                        bool active = false);

}  // namespace zt::model
