// The decoder's building blocks with HF's parameter names. Parameters are registered without
// initialization (values come from a ParameterSource): either allocated, or placeholders that
// hold only their shape (one element with zero strides) until an Engine or load_weights
// places real values.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>

#include "model/blocks.hpp"
#include "quant/four_bit_weight.hpp"
#include "zerotrain/model.hpp"

namespace zt::model {

/// Creates a parameter tensor of a given shape (allocated or a placeholder).
struct ParamFactory {
  at::TensorOptions options;
  bool allocate = true;
  /// Set for the decoder's projections of a 4-bit model: a Linear made with it keeps its weight
  /// as quant::FourBitLayout storage (the model's quantization; not the output layer's).
  const QuantizationConfig* quantization = nullptr;
  at::Tensor operator()(at::IntArrayRef shape) const { return make(shape, options); }
  /// `n` bytes (a quantized weight's storage).
  at::Tensor bytes(int64_t n) const { return make({n}, options.dtype(at::kByte)); }

 private:
  at::Tensor make(at::IntArrayRef shape, const at::TensorOptions& o) const {
    if (allocate) return at::empty(shape, o);
    return at::zeros({1}, o).expand(shape).detach();
  }
};

/// The 4-bit layout of a [rows, cols] weight (`groups` > 1: [groups, rows / groups, cols]) in
/// `dtype` under `q`; ConfigError naming a quant_type or blocksize bitsandbytes lacks.
std::shared_ptr<const quant::FourBitLayout> four_bit_layout(const QuantizationConfig& q,
                                                            int64_t rows, int64_t cols,
                                                            at::ScalarType dtype,
                                                            int64_t groups = 1);

/// x · Wᵀ + bias for a 4-bit W held as `storage` (quant::FourBitLayout): W is dequantized for
/// the product and again in backward, which returns only the input's (and bias's) gradient —
/// the base is frozen. `output_unread` or a defined `kept`: as linear_for_backward, no product
/// is computed (nor W dequantized) in forward.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& storage,
                            const quant::FourBitLayout& layout, const at::Tensor& bias,
                            bool output_unread = false, const at::Tensor& kept = {});

/// x · weightᵀ + bias for back-propagation only: no product is computed; returns `kept` (the
/// output's values from the unit's first pass, zt::keep_for_recompute_if_room) or, undefined,
/// an uninitialized tensor of the output's shape, with the projection's backward. For a unit
/// recomputed in backward.
at::Tensor linear_for_backward(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& kept = {});

struct Linear;
struct SequenceShard;  // model/sequence_parallel.hpp

/// What an adapter method adds to one Linear. lib/peft/ implements the methods (LoRA and rsLoRA:
/// peft/lora.cpp) and attaches them (peft/linear_adapters.hpp); the model only calls them. An
/// adapter registers its parameters on the Linear it is attached to, under PEFT's names
/// ("q_proj.lora_A.weight"), so it is not a module itself. Not thread-safe beyond what its
/// Linear is: it is called from the thread running the model.
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  /// The projection's output with the adapter (the base's product and the adapter's);
  /// `output_unread` and `kept` as Linear::forward.
  virtual at::Tensor forward(const Linear& base, const at::Tensor& x, bool output_unread,
                             const at::Tensor& kept) const = 0;
  /// Whether forward may return an output kept from an earlier pass (false where it draws
  /// random numbers in training, which a recomputation draws again).
  virtual bool reuses_kept(bool training) const = 0;
  /// Folds the adapter into `weight`, the base's values as fp32 [out, in], in place
  /// (merge_lora), and takes it out again (unmerge_lora: after merge_into of the same weight).
  virtual void merge_into(at::Tensor& weight) const = 0;
  virtual void unmerge_from(at::Tensor& weight) const = 0;
};

/// A projection: a base (a dense weight, or a 4-bit one, and an optional bias) plus, optionally,
/// one adapter.
struct Linear : torch::nn::Module {
  at::Tensor weight, bias;
  int64_t in_features, out_features;
  /// Set when the base is 4-bit: `weight` is then its frozen uint8 storage in this layout.
  std::shared_ptr<const quant::FourBitLayout> quantized;
  /// The attached adapter (peft::attach_adapter), if any; `adapter_merged`: folded into
  /// `weight` (peft's merge_lora), so forward leaves it out.
  std::shared_ptr<const LinearAdapter> adapter;
  bool adapter_merged = false;
  /// Set while the model's adapters are off (CausalLM::set_adapters_enabled): forward is the
  /// base's.
  bool adapter_disabled = false;

  Linear(int64_t in, int64_t out, bool with_bias, const ParamFactory& o);
  /// The options of the projection's values (its dtype, not the 4-bit storage's): what an
  /// adapter's parameters are made with.
  at::TensorOptions value_options() const {
    return quantized ? weight.options().dtype(quantized->dtype) : weight.options();
  }
  /// The base weight's values [out, in] in `dtype`: `weight` cast, or a 4-bit base dequantized.
  at::Tensor dense_weight(at::ScalarType dtype) const;
  /// Whether the parameters hold values (a model made without allocating holds placeholders
  /// until the engine loads its own copies).
  bool holds_values() const;
  /// The base's x · weightᵀ + bias. `output_unread` or a defined `kept`: see forward.
  at::Tensor base_forward(const at::Tensor& x, bool output_unread = false,
                          const at::Tensor& kept = {}) const {
    if (quantized) return quantized_linear(x, weight, *quantized, bias, output_unread, kept);
    return output_unread || kept.defined() ? linear_for_backward(x, weight, bias, kept)
                                           : at::linear(x, weight, bias);
  }
  /// `output_unread`: only back-propagated through (see linear_for_backward); the product is
  /// then skipped where the adapter allows (LoRA with dropout in training computes it).
  /// `kept`: the output's values from the unit's first pass (only where reuses_kept()),
  /// returned instead of the product, with its backward.
  at::Tensor forward(const at::Tensor& x, bool output_unread = false, const at::Tensor& kept = {}) {
    if (!adapter || adapter_merged || adapter_disabled) return base_forward(x, output_unread, kept);
    return adapter->forward(*this, x, output_unread, kept);
  }
  /// Whether forward can take its output from an earlier pass (then it skips the product, and a
  /// 4-bit base's dequantization, which its backward does anyway).
  bool reuses_kept() const {
    return !adapter || adapter_merged || adapter_disabled || adapter->reuses_kept(is_training());
  }
};

/// transformers' RMSNorm, weight · (x_fp32 · rsqrt(mean(x_fp32²) + eps)).to(x.dtype), with the
/// same forward operations (bit-identical output) but a backward of its own that keeps only x
/// and the [.., 1] fp32 reciprocal norms — autograd of the formula keeps an fp32 copy of x and
/// the normalized x as well, about 3× the memory per norm when activations are not recomputed.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

/// Gemma's RMSNorm: (x_fp32 · rsqrt(mean(x_fp32²) + eps) · (1 + weight_fp32)).to(x.dtype), as
/// transformers' Gemma2RMSNorm computes it, with rms_norm's backward (and its kernel on CUDA).
at::Tensor rms_norm_unit_offset(const at::Tensor& x, const at::Tensor& weight, double eps);

struct RMSNorm : torch::nn::Module {
  at::Tensor weight;
  double eps;
  bool unit_offset = false;  ///< NormSpec::unit_offset
  RMSNorm(int64_t dim, double eps_, const ParamFactory& o) : eps(eps_) {
    weight = register_parameter("weight", o({dim}));
  }
  RMSNorm(int64_t dim, const NormSpec& spec, const ParamFactory& o) : RMSNorm(dim, spec.eps, o) {
    unit_offset = spec.unit_offset;
  }
  /// As transformers: normalize in fp32, cast back, then scale (rms_norm below); Gemma's scales
  /// by 1 + weight before the cast.
  at::Tensor forward(const at::Tensor& x) {
    return unit_offset ? rms_norm_unit_offset(x, weight, eps) : rms_norm(x, weight, eps);
  }
};

struct Embedding : torch::nn::Module {
  at::Tensor weight;
  Embedding(int64_t n, int64_t dim, const ParamFactory& o) {
    weight = register_parameter("weight", o({n, dim}));
  }
  at::Tensor forward(const at::Tensor& ids) { return at::embedding(weight, ids); }
};

/// Whether the rotary frequencies depend on how far the positions reach (dynamic NTK,
/// LongRoPE): then cos / sin of a position depend on the longest position of the batch.
bool reach_matters(const RotarySpec& r);

/// cos / sin tables [T, rotary_dim] for positions [start, start + T) (fp32 math, cast to
/// `dtype`), laid out for the rotation (halves, or GLM's adjacent pairs).
std::pair<at::Tensor, at::Tensor> rotary_tables(const RotarySpec& r, int64_t start, int64_t length,
                                                at::ScalarType dtype, const at::Device& device);
/// Rotary tables for explicit positions [B, T] (packed sequences restart per document):
/// cos/sin [B, 1, T, D], broadcasting over heads.
std::pair<at::Tensor, at::Tensor> rotary_tables(const RotarySpec& r, const at::Tensor& positions,
                                                at::ScalarType dtype);
/// The same of the first rotary embedding of the decoder `c` describes (tests, kernels).
std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, int64_t start, int64_t length,
                                                at::ScalarType dtype, const at::Device& device);
std::pair<at::Tensor, at::Tensor> rotary_tables(const ModelConfig& c, const at::Tensor& positions,
                                                at::ScalarType dtype);

/// The key/value cache of one layer (generation, and prefix tuning's learned prefixes).
struct KvCache {
  at::Tensor k, v;  ///< [B, kv_heads, S, head_dim]: the keys and values so far, or fixed buffers
  /// Decoding one token a row into fixed buffers (all defined, or none: then k and v grow by
  /// concatenation): the buffer position this step's key and value go to (int64 [1] on the
  /// device), and which buffer positions each row's query may attend to (bool [B, 1, 1, S]).
  /// Nothing the step reads is on the host, so a step can be recorded (StepGraph).
  at::Tensor slot, keys;
  /// Decoding into fixed buffers: buffer positions [0, reach) hold every key this step may see,
  /// so attention reads only them (0: the whole buffer). Set by the decoding loop, which
  /// records a step anew for each reach.
  int64_t reach = 0;
};

/// Where the documents of a [B, T] batch lie once its rows are laid end to end: what
/// variable-length attention takes instead of a mask (no [T, T] mask, no attention across
/// documents, no work on the masked-out half).
struct DocumentSpans {
  at::Tensor cu_seqlens;   ///< int32 [n + 1] on the model's device: 0, then each span's end
  int64_t max_length = 0;  ///< the longest span
};

/// The spans of an attention mask [B, T] (0 = padding, otherwise a document number, as
/// Attention::forward reads it): each row's runs of one value, padding runs as spans of their
/// own (their queries see only padding; no real query sees them, as with the mask). nullopt when
/// a document number comes back in a row after another value — only a mask says that. Reads the
/// mask on the host (a device mask is copied there first).
std::optional<DocumentSpans> document_spans(const at::Tensor& mask, const at::Device& device);

/// True when every layer's attention of decoder `d` runs over DocumentSpans for activations of
/// `dtype` on `device`: CUDA, fp16 or bf16, head sizes FlashAttention takes (sliding windows
/// included), no soft-capped or sink attention, LibTorch with the variable-length kernels
/// (compat::has_varlen_attention), and not switched off by the environment (ZT_VARLEN_ATTENTION=0,
/// for comparisons).
bool varlen_attention_applies(const DecoderSpec& d, at::ScalarType dtype, const at::Device& device);
/// The same for the decoder `c` describes.
bool varlen_attention_applies(const ModelConfig& c, at::ScalarType dtype, const at::Device& device);

/// Self-attention as `spec` says, with q_proj, k_proj, v_proj and o_proj, or one fused
/// projection (the family's ModuleNames::fused_qkv, [q + 2 kv, hidden]: all query heads, then
/// the key, then the value groups) and its output projection under the family's name; with
/// qk_norm, `q_norm` and `k_norm` over each head.
struct Attention : torch::nn::Module {
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<Linear> query_key_value;  ///< a fused projection (then q/k/v_proj are null)
  std::shared_ptr<RMSNorm> q_norm, k_norm;  ///< spec.qk_norm only
  at::Tensor sinks;                         ///< spec.sinks only: [heads]
  AttentionSpec spec;
  RotarySpec rotary;
  Attention(const AttentionSpec& spec, const RotarySpec& rotary, int64_t hidden,
            const ModuleNames& names, const ParamFactory& o);
  /// The attention of the first layer of the decoder `c` describes (tests).
  Attention(const ModelConfig& c, const ParamFactory& o);
  /// x [B, T, H]; cos/sin [T, D] or [B, 1, T, D]; attention_mask [B, S] or an empty tensor:
  /// 0 = padding, otherwise a document number — a query sees only keys of its own document
  /// (plain batches have one document, 1; packed ones number theirs 1, 2, ...). With `cache`,
  /// the new keys/values are appended and attention covers the cached ones; with a cache of
  /// fixed buffers (KvCache::slot; T = 1) they are written at the slot and attention covers the
  /// positions KvCache::keys allows, attention_mask unread. With `spans` (the
  /// same mask's document_spans, no cache) attention runs over them instead of the mask.
  /// `output_unread`: only back-propagated through (a recomputed unit): o_proj's product is
  /// skipped. `sequence` (sequence parallelism, no cache): x holds this rank's share of the
  /// positions, and attention runs over every position for this rank's share of the heads,
  /// exchanged before and after (attention_mask and spans then cover the whole sequence).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& attention_mask, KvCache* cache = nullptr,
                     const DocumentSpans* spans = nullptr, bool output_unread = false,
                     const SequenceShard* sequence = nullptr);

 private:
  /// forward's attention into a cache of fixed buffers: q [B, heads, 1, D], k and v
  /// [B, kv_heads, 1, D]; returns [B, 1, heads, D].
  at::Tensor buffered_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                KvCache& cache, double scale);
};

/// x + y for back-propagation only: returns `kept` (the sum's values from an earlier pass) with
/// the sum's backward.
at::Tensor sum_kept(const at::Tensor& x, const at::Tensor& y, const at::Tensor& kept);
/// x + y for back-propagation only: an uninitialized tensor with the sum's backward.
at::Tensor sum_unread(const at::Tensor& x, const at::Tensor& y);

/// act(gate) · up for the gated MLP's activation (silu: SwiGLU; gelu-tanh: GeGLU), rounded as
/// transformers' `act_fn(gate) * up` (one kernel each way on CUDA, saving only gate and up for
/// backward).
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, Activation act);
/// The same of the two halves of one fused projection's output [..., 2I] (gate first).
at::Tensor gated_activation_halves(const at::Tensor& gate_up, Activation act);
/// gated_activation with silu.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
/// gated_activation_halves with silu.
at::Tensor swiglu_halves(const at::Tensor& gate_up);

/// The gated MLP: down(act(gate(x)) · up(x)), SwiGLU (silu) or GeGLU (gelu, tanh approximation),
/// with gate and up as two projections (LLaMA) or as the two halves of one `gate_up_proj` (GLM,
/// gate first; ChatGLM names it `dense_h_to_4h` and the down projection `dense_4h_to_h`).
struct Mlp : torch::nn::Module {
  std::shared_ptr<Linear> gate_proj, up_proj, gate_up_proj, down_proj;
  Activation activation = Activation::kSilu;
  Mlp(const MlpSpec& spec, int64_t hidden, const ModuleNames& names, const ParamFactory& o);
  /// `output_unread`: the result's values will not be read (only back-propagated through), so
  /// the down projection's product — a third of the MLP's forward — is skipped. In the first
  /// pass of a recomputed unit, the gate and up outputs are kept while the engine has room
  /// (zt::keep_for_recompute_if_room), and the recomputation takes them instead of forming them
  /// again: two of the MLP's three products.
  at::Tensor forward(const at::Tensor& x, bool output_unread = false);
  /// The same values, computed whole and nothing kept for a recomputation (a tile of
  /// tiled_mlp).
  at::Tensor compute(const at::Tensor& x);
};

struct SparseMoe;  // model/moe.hpp

/// A decoder layer as `spec` says: its attention, its MLP (or mixture of experts), and the norms
/// of spec.norms under their names (before each sublayer always, after it where named: glm4,
/// Gemma).
struct DecoderLayer : torch::nn::Module {
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<Mlp> mlp;        ///< null where the layer is a mixture of experts
  std::shared_ptr<SparseMoe> moe;  ///< spec.moe: registered as `mlp` in place of the MLP
  std::shared_ptr<RMSNorm> before_attention, before_mlp;
  std::shared_ptr<RMSNorm> after_attention, after_mlp;  ///< null where the spec names none
  /// Set (CausalLM::set_tiled_mlp): the dense MLP runs in tiles (model/tiled_mlp.hpp), this
  /// many (0: ceil(rows / hidden)).
  std::optional<int64_t> mlp_shards;
  /// The attention is registered under the family's name (`self_attn`, ChatGLM's
  /// `self_attention`).
  DecoderLayer(const LayerSpec& spec, const RotarySpec& rotary, int64_t hidden,
               const ModuleNames& names, const ParamFactory& o);
  /// `output_unread`: the caller only back-propagates through the result (a recomputed unit,
  /// zt::recomputing_for_backward()); its values are then not all computed. Under activation
  /// checkpointing the first pass keeps h = x + attention (zt::keep_for_recompute: one more
  /// [tokens, hidden] per layer), so the recomputation skips the attention's output projection
  /// as well as the MLP's down projection — what transformers' checkpointing recomputes less
  /// the two products whose outputs only feed sums.
  /// `sequence`: Attention::forward's.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& attention_mask, KvCache* cache = nullptr,
                     bool output_unread = false, const DocumentSpans* spans = nullptr,
                     const SequenceShard* sequence = nullptr) {
    // A norm after a sublayer (glm4, Gemma) reads its output's values.
    const at::Tensor kept = output_unread && !after_attention ? kept_for_recompute() : at::Tensor();
    at::Tensor a = self_attn->forward(before_attention->forward(x), cos, sin, attention_mask, cache,
                                      spans, /*output_unread=*/kept.defined(), sequence);
    if (after_attention) a = after_attention->forward(a);
    const at::Tensor h = kept.defined() ? sum_kept(x, a, kept) : x + a;
    if (!output_unread && !after_attention) keep_for_recompute(h);
    at::Tensor m = feed_forward(before_mlp->forward(h), output_unread && !after_mlp);
    if (after_mlp) m = after_mlp->forward(m);
    return output_unread ? sum_unread(h, m) : h + m;
  }
  /// The MLP's output, or the mixture of experts' (which computes it whole even when unread:
  /// its products are the experts' chosen rows only).
  at::Tensor feed_forward(const at::Tensor& x, bool output_unread);
};

/// Σ over rows with label != -100 of cross-entropy(hidden · weightᵀ, label), computed in chunks
/// of `chunk` rows, so [rows, vocab] fp32 logits never exist at once. hidden [N, H], weight
/// [V, H], labels [N] (int64). Returns an fp32 scalar. When gradients are recorded, each
/// chunk's gradients are formed in forward while its logits exist (backward scales them), except
/// in fp16, whose loss scale must reach the products: there backward recomputes the logits.
/// `eager_gradients` false always recomputes (tests). `softcap` > 0: the logits are
/// cap · tanh(z / cap) (Gemma 2's final_logit_softcapping), the gradients through the tanh; the
/// fused kernel is then not used.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& labels, int64_t chunk,
                                bool eager_gradients = true, double softcap = 0.0);

/// Each row's mean logit over the vocabulary, [N] fp32 without gradient: mean_v (hidden · wᵀ)_v
/// = hidden · mean_v w_v, one vector product instead of the [N, vocab] logits; with `softcap`
/// the capped logits, averaged a chunk of rows at a time.
at::Tensor row_mean_logits(const at::Tensor& hidden, const at::Tensor& weight,
                           double softcap = 0.0);

/// Each row's entropy of softmax(hidden · wᵀ) (capped with `softcap`), [N] fp32 without
/// gradient, a chunk of rows at a time (never the [N, vocab] logits whole).
at::Tensor row_entropies(const at::Tensor& hidden, const at::Tensor& weight, double softcap = 0.0);

/// The same cross-entropies per row, [N] fp32 (0 where label is -100), for losses that weigh
/// rows differently (preference training): backward takes each row's own gradient. With a
/// frozen weight (not fp16) the hidden-state gradient of a unit gradient is formed in forward
/// and backward scales its rows; otherwise backward recomputes the chunks' logits
/// (`eager_gradients` false always recomputes: tests).
at::Tensor linear_token_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& labels, int64_t chunk,
                                      bool eager_gradients = true, double softcap = 0.0);

}  // namespace zt::model
