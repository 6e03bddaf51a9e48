// Decoder-only LLMs as transformers builds them (LLaMA, Qwen2, Mistral, GLM, GLM-4): the
// configuration from an HF config.json, the model in LibTorch with HF's parameter names, weight
// loading and saving, and generation.
//
// Thread-safety: a CausalLM is used by one thread at a time (as any torch::nn::Module).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zerotrain/units.hpp"

namespace zt {

class Communicator;

namespace model {
struct FamilySettings;
}

struct RopeScaling {
  std::string type = "default";  ///< default | linear | dynamic | llama3 | yarn | longrope
  /// The context's extension; yarn and longrope without one: max / original positions.
  double factor = 1.0;
  double low_freq_factor = 1.0;   ///< llama3
  double high_freq_factor = 4.0;  ///< llama3
  /// The positions the model was pre-trained on (llama3, yarn, longrope).
  int64_t original_max_position_embeddings = 0;
  /// yarn and longrope: cos and sin are multiplied by this; unset: derived from the factor
  /// (and, for yarn, mscale / mscale_all_dim) as transformers derives it.
  std::optional<double> attention_factor;
  double beta_fast = 32.0, beta_slow = 1.0;      ///< yarn: the ramp's bounds, in rotations
  std::optional<double> mscale, mscale_all_dim;  ///< yarn (DeepSeek): the attention factor's
  bool truncate = true;  ///< yarn: the ramp's bounds rounded to whole dimensions (gpt-oss: no)
  /// longrope: per-frequency divisors (rotary_dim / 2 each), short up to the original
  /// positions, long beyond.
  std::vector<double> short_factor, long_factor;
  bool factor_given = false;  ///< whether `factor` came from the file (written back only then)
};

/// A 4-bit base for the decoder's projections (QLoRA), in bitsandbytes' blockwise format
/// (docs/quantization.md): what transformers' BitsAndBytesConfig(load_in_4bit) and
/// LLaMA-Factory's quantization_bit 4 ask for. The embeddings, the norms and the output layer
/// stay in the model's dtype, as in PEFT's QLoRA recipe.
struct QuantizationConfig {
  std::string quant_type = "nf4";  ///< nf4 | fp4
  bool double_quant = true;        ///< the absmax again in 8-bit codes, blocks of 256
  int64_t blocksize = 64;          ///< elements per absmax: 32, 64, …, 4096
};

/// What an HF config.json says about a decoder, in either spelling: transformers 4.x
/// (`torch_dtype`, `rope_theta`, `rope_scaling`) or 5.x (`dtype`, `rope_parameters`).
struct ModelConfig {
  std::string model_type;  ///< a registered family: llama, qwen2, qwen3, mistral, phi3, gemma2, …
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;     ///< Qwen2, or LLaMA's attention_bias
  bool o_proj_bias = false;  ///< LLaMA's attention_bias
  bool mlp_bias = false;
  /// RoPE rotates the first head_dim × partial_rotary_factor dimensions of each head (GLM: 0.5)
  /// and passes the rest through.
  double partial_rotary_factor = 1.0;
  /// GLM's RoPE: dimensions rotate in adjacent pairs (0, 1), (2, 3), ... instead of LLaMA's
  /// halves (i, i + rotary_dim / 2).
  bool rope_interleaved = false;
  /// GLM's MLP: one `gate_up_proj` [2 × intermediate, hidden] (gate rows first) instead of
  /// `gate_proj` and `up_proj`.
  bool fused_gate_up = false;
  /// GLM-4-0414 (`glm4`): each sublayer's output is normed before its residual add
  /// (`post_self_attn_layernorm`, `post_mlp_layernorm`).
  bool post_sublayer_norms = false;
  std::optional<int64_t> sliding_window;  ///< Mistral / Qwen2 with use_sliding_window
  at::ScalarType dtype = at::kFloat;      ///< the checkpoint's dtype (torch_dtype / dtype)
  double initializer_range = 0.02;
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
  std::string source = "<inline>";
  /// Set: the decoder's projections keep 4-bit weights, quantized from the checkpoint's while
  /// it loads (the run's choice, not config.json's; model_config_json leaves it out).
  std::optional<QuantizationConfig> quantization = std::nullopt;
  /// Expert parallelism (the run's choice, not config.json's; model_config_json leaves it out):
  /// a model made with size > 1 holds experts [rank · E / size, (rank + 1) · E / size) of every
  /// mixture, and its mixtures send each token's rows to their experts' ranks and back by
  /// all-to-all (CausalLM::set_expert_communicator). decoder_spec refuses a size that does not
  /// divide a mixture's experts, naming expert_parallel_size.
  struct ExpertShard {
    int64_t size = 1;  ///< ranks that share one copy of the experts (expert_parallel_size)
    int64_t rank = 0;  ///< this rank's place among them: its world rank modulo size
  } expert_shard;
  /// The config.json text this config was read from by load_model_config (empty for a config
  /// given inline): model_config_json writes its members back as they were.
  std::string source_json;
  /// What the family read beyond the members above for its blocks (Gemma's soft-caps, layer
  /// types, query scale, ...): made by its reader, read by its compose and writer; null for a
  /// config built in code (the family's defaults). Immutable, shared by copies.
  std::shared_ptr<const model::FamilySettings> family_settings;

  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  /// Dimensions of each head that RoPE rotates (transformers' int(head_dim × factor); the
  /// parser refuses an odd count).
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
  }
  /// Total parameters of the model this config builds.
  int64_t parameter_count() const;
  /// The dotted prefix of decoder layer `i`'s parameter names ("model.layers.3.", ChatGLM's
  /// "transformer.encoder.layers.3.").
  std::string layer_prefix(int64_t i) const;
};

/// Parses config.json text. Unsupported model types, rope types or inconsistent sizes are a
/// ConfigError naming the key and listing what is supported.
ModelConfig parse_model_config(std::string_view json, const std::string& source = "<inline>");
/// Reads `<dir>/config.json` (or a file path).
ModelConfig load_model_config(const std::string& path);
/// config.json text for `config` that transformers 4.43+ and 5.x both read as this model. A
/// config read from a file keeps every member of that file as it was, with `dtype` changed to
/// the config's and the other line's spelling added where it is missing (`rope_theta` /
/// `rope_scaling` / `torch_dtype` for 4.x, `rope_parameters` / `dtype` for 5.x). An inline
/// config is written in full, in both spellings.
std::string model_config_json(const ModelConfig& config);
/// A ChatGLM2/3 config as transformers' `glm` (GlmForCausalLM) states the same model — the
/// mapping of transformers' convert_glm_weights_to_hf.py: padded_vocab_size → vocab_size,
/// ffn_hidden_size → intermediate_size, kv_channels → head_dim, multi_query_group_num →
/// num_key_value_heads, add_qkv_bias → attention_bias, 10000 × rope_ratio → rope_theta,
/// partial_rotary_factor 0.5. Written in full by model_config_json (not from the source file).
ModelConfig chatglm_as_glm(const ModelConfig& chatglm);
/// The `glm` name of a ChatGLM parameter and, for `query_key_value`, the rows [first, first +
/// count) of it that the glm tensor takes: one entry per glm tensor (q, k and v for the fused
/// projection; one for every other name). `name` must be a ChatGLM parameter name of `config`.
struct GlmTensorFrom {
  std::string glm_name;
  int64_t first_row = 0, rows = -1;  ///< rows -1: the whole tensor
};
std::vector<GlmTensorFrom> glm_names_of_chatglm(const ModelConfig& config, const std::string& name);

/// Loss of a batch: the sum of token losses and the number of tokens it covers.
struct LossSum {
  at::Tensor sum;  ///< fp32 scalar, differentiable
  int64_t tokens = 0;
  /// A mixture of experts whose config sets output_router_logits, in a forward with gradients:
  /// transformers' load-balancing loss of this batch (fp32 scalar, differentiable through the
  /// routers, under activation checkpointing and ZeRO-3 too) and router_aux_loss_coef. The
  /// objective adds aux_coef · aux per batch, as transformers' model adds it to its loss.
  /// Undefined (and 0) otherwise.
  at::Tensor aux{};
  double aux_coef = 0.0;
};

class Tokenizer;

/// transformers' `stop_strings` (StopStringCriteria): a sequence stops at the token that
/// completes one of the strings — the token holds the string's last character, perhaps with
/// more text after it, and the tokens before it (the prompt's included) hold the rest. A
/// token's text is its text decoded alone, after a fixed prefix (so a leading space stays), as
/// transformers reads the vocabulary; special tokens count as no text. Immutable; shared.
class StopStrings {
 public:
  /// `token_texts[id]`: the text of token `id` (ids past its end have none). InvalidArgument
  /// for no strings or an empty one.
  StopStrings(std::vector<std::string> strings,
              std::shared_ptr<const std::vector<std::string>> token_texts);
  /// The strings of an option's text: one string, or (text starting with '[') a JSON list of
  /// strings; none for empty text. InvalidArgument naming `what` for a malformed list.
  static std::vector<std::string> parse(const std::string& text,
                                        const std::string& what = "stop_strings");
  /// Every token's text as transformers' StopStringCriteria reads it from `tokenizer`.
  static std::shared_ptr<const std::vector<std::string>> token_texts(const Tokenizer& tokenizer);

  /// Whether the last of `tokens` (a row's completion so far, after `prompt`) completes a stop
  /// string. False when `tokens` is empty.
  bool completes(const std::vector<int64_t>& prompt, const std::vector<int64_t>& tokens) const;
  const std::vector<std::string>& strings() const { return strings_; }

 private:
  const std::string& text(int64_t id) const;
  std::vector<std::string> strings_;
  std::shared_ptr<const std::vector<std::string>> texts_;
  size_t longest_ = 0;
};

/// Options for generate() and generate_batch(): transformers' `generate` arguments of the same
/// names (docs/generation.md). Checked before any generation (InvalidArgument).
struct GenerationOptions {
  int64_t max_new_tokens = 64;
  bool do_sample = false;  ///< greedy when false
  double temperature = 1.0;
  int64_t top_k = 0;                   ///< 0: off
  double top_p = 1.0;                  ///< 1: off
  double min_p = 0.0;                  ///< 0: off
  double repetition_penalty = 1.0;     ///< 1: off; over each row's prompt and completion tokens
  std::vector<int64_t> eos_token_ids;  ///< stop tokens (kept as the completion's last token)
  /// Stop strings (null: none); the completing token is kept, as transformers keeps it.
  std::shared_ptr<const StopStrings> stop_strings;
  /// Sampling's seed: with it, a sequence's stream (generate_batch) fixes its draws.
  uint64_t seed = 0;
};

/// One sequence's completion from generate_batch.
struct Generated {
  std::vector<int64_t> tokens;
  bool stopped = false;  ///< it ended with a stop token or string (else at max_new_tokens)
};

/// Extension point for prompt-learning adapters (P-Tuning, prefix tuning; see peft.hpp). A
/// CausalLM holds at most one, registered as its submodule `prompt_encoder`.
class PromptAdapter : public torch::nn::Module {
 public:
  virtual int64_t num_virtual_tokens() const = 0;
  /// True for P-Tuning (tokens in front of the input), false for prefix tuning.
  virtual bool prepends_tokens() const = 0;
  /// P-Tuning: [num_virtual_tokens, hidden] embeddings placed before the input's embeddings
  /// (attention mask and labels are extended to match); undefined for other methods.
  virtual at::Tensor virtual_embeddings() = 0;
  /// Prefix tuning: per layer, key and value prefixes [kv_heads, num_virtual_tokens, head_dim]
  /// that every position attends to (not rotated; the input's positions start after them);
  /// empty for other methods.
  virtual std::vector<std::pair<at::Tensor, at::Tensor>> layer_prefixes() = 0;
};

/// A decoder-only causal LM with HF's module tree and parameter names (`model.embed_tokens`,
/// `model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`). Its units for ZeRO-3 and
/// activation checkpointing are the embeddings, each layer, and the head (final norm + LM head).
class CausalLM : public torch::nn::Module {
 public:
  /// Parameters get `options` (device, dtype). With `allocate` they are allocated but not
  /// initialized (call initialize_random or load_weights); without, they are placeholders that
  /// hold only their shape, for an Engine given a ParameterSource (ZeRO-3 then never builds the
  /// whole model anywhere) or for load_weights.
  CausalLM(const ModelConfig& config, at::TensorOptions options, bool allocate = true);
  ~CausalLM() override;

  const ModelConfig& config() const { return config_; }
  UnitGate& gate() { return gate_; }
  std::vector<UnitSpec> units();

  /// Seeded random initialization as transformers does it (normal(0, initializer_range) for
  /// projections and embeddings, zero biases, unit norms). Every rank gets the same values.
  void initialize_random(uint64_t seed);

  /// The summed cross-entropy of next-token prediction over labels != -100 (labels are shifted
  /// inside, as HF's causal LM loss). The logits are produced in chunks of `chunk_tokens`
  /// positions and never held whole. `attention_mask` (1 = real token, 0 = padding) may be
  /// undefined. Packed sequences number their documents 1, 2, ... in `attention_mask` instead
  /// (a token attends only within its document) and give `position_ids` [B, T] restarting at 0
  /// per document; labels must then be -100 at each document's first token (as the data
  /// module's packing does), since with the shift that label would be predicted by the previous
  /// document's last token. A lone document never uses its first label, so nothing changes.
  LossSum loss(const at::Tensor& input_ids, const at::Tensor& labels,
               const at::Tensor& attention_mask = {}, int64_t chunk_tokens = 1024,
               const at::Tensor& position_ids = {});

  /// Per-token log-probabilities of the labels, [batch, seq] fp32: entry t is
  /// log p(labels[t] | input_ids[..t-1]), 0 at t = 0 and where labels is -100 — a sequence's
  /// log-probability is its row's sum. Computed as loss() computes (chunks of `chunk_tokens`
  /// positions, the same masks and packing); backward takes a gradient per entry.
  /// `mean_logits`, when given, receives [batch, seq] fp32 without gradient, aligned the same
  /// way: entry t is the mean over the vocabulary of the logits that score labels[t] (TRL's
  /// `logits/chosen` averages these over the answer's tokens), 0 at t = 0. With `temperature`
  /// ≠ 1 the logits are divided by it first (TRL's GRPO scores completions so; InvalidArgument
  /// for a model with a final logit soft-cap). `entropies`, when given, receives [batch, seq]
  /// fp32 without gradient, aligned the same way: the entropy of the distribution that scores
  /// labels[t] (TRL's `entropy` metric), 0 at t = 0.
  at::Tensor label_log_probs(const at::Tensor& input_ids, const at::Tensor& labels,
                             const at::Tensor& attention_mask = {}, int64_t chunk_tokens = 1024,
                             const at::Tensor& position_ids = {}, at::Tensor* mean_logits = nullptr,
                             double temperature = 1.0, at::Tensor* entropies = nullptr);

  /// Turns the fine-tuning method's adapters (LoRA layers, a prompt adapter) off or back on:
  /// off, the model computes its base model, as PEFT's disable_adapter() (the reference model
  /// of preference training). A backward must not be pending across a switch.
  void set_adapters_enabled(bool enabled);
  bool adapters_enabled() const;

  /// Full fp32 logits [batch, seq, vocab] (for tests and short inputs).
  at::Tensor logits(const at::Tensor& input_ids, const at::Tensor& attention_mask = {});
  /// Hidden states after the embeddings and after every layer (the last one before the final
  /// norm), as HF's output_hidden_states (whose last entry is after the final norm).
  std::vector<at::Tensor> hidden_states(const at::Tensor& input_ids,
                                        const at::Tensor& attention_mask = {});

  /// Generates continuations of `input_ids` [batch, seq] (no padding) with a KV cache.
  /// Returns the new tokens [batch, ≤ max_new_tokens]; rows that stopped early are filled
  /// with the config's pad_token_id (or their stop token). generate_batch's work.
  at::Tensor generate(const at::Tensor& input_ids, const GenerationOptions& options);

  /// Generates a completion of each prompt (token ids, of any lengths; none empty) as
  /// transformers' `generate` does for a left-padded batch: one KV cache for the batch, each
  /// row's positions counted from its first real token, sequences that stop leave the batch
  /// (their rows of the cache are dropped). The cache is allocated once for every position the
  /// generation can reach (B × (longest prompt + max_new_tokens) keys and values a layer); on
  /// CUDA a decoding step is recorded as a CUDA graph and replayed (docs/generation.md). Runs
  /// in eval mode (no dropout), the caller's mode restored. With adapters, as they are set (no
  /// merge). With
  /// do_sample, the draws of prompt i come from (options.seed, streams[i], step) alone —
  /// `streams` defaults to 0, 1, ... — so a sequence samples the same tokens in any batch or
  /// rank when its logits are the same. The model's parameters must be materialized on this
  /// process (not ZeRO-3's placeholders). Not a collective; not thread-safe on one model.
  std::vector<Generated> generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                        const GenerationOptions& options,
                                        const std::vector<uint64_t>& streams = {});

  /// The communicator an expert-parallel model's mixtures exchange rows over (config's
  /// expert_shard.size > 1): the job's, whose ranks [r − rank, r − rank + size) form this rank's
  /// group. Every mixture's forward and backward is then a collective of that group (all-to-alls
  /// in layer order, the same on every rank of the job: ranks of other groups take part with
  /// nothing to exchange), so every rank runs the same forwards — the trainer's lockstep steps
  /// and evaluation. The engine may share the communicator (collectives stay in one order).
  /// Throws InvalidArgument when the world does not fit the shard.
  void set_expert_communicator(std::shared_ptr<Communicator> comm);

  /// Ulysses sequence parallelism over `comm` (the job's; null or size 1: off): ranks
  /// [r − r mod size, r − r mod size + size) form rank r's group, whose members are given the
  /// same batches. loss() and label_log_probs() then run the layers over this rank's share of
  /// the positions only — the sequence padded to a multiple of `size` (padding attends and is
  /// attended to by nothing real, and counts nowhere), rank r mod size holding the r mod size-th
  /// slice — with all-to-alls swapping positions for heads around each attention and back
  /// (keys and values replicated where the model has fewer of them than `size`). loss() returns
  /// the summed loss and the count of this rank's labels (labels are shifted before the cut,
  /// positions counted over the whole sequence), so their sums over the group are the whole
  /// sequence's; label_log_probs() returns the whole [batch, seq] with this rank's positions
  /// filled and 0 elsewhere. Every forward and backward of those two is then a collective of
  /// the job (every rank runs the same forwards; ranks of other groups exchange nothing with
  /// this one); logits(), hidden_states() and generation stay local and whole. Throws
  /// InvalidArgument naming sequence_parallel_size when `size` does not divide the world or the
  /// attention heads, when the key/value heads and `size` do not divide one another, or for a
  /// model with a prompt adapter, experts sharded over ranks or a load-balancing loss.
  void set_sequence_parallel(std::shared_ptr<Communicator> comm, int64_t size);
  /// The degree set by set_sequence_parallel (1: off).
  int64_t sequence_parallel_size() const;

  /// ALST's TiledMLP: while on, each dense MLP of loss() and label_log_probs() runs over its
  /// input rows in `shards` tiles (0: ALST's ceil(rows / hidden_size)), forward without keeping
  /// any tile's intermediate activations, backward recomputing and back-propagating one tile at
  /// a time (dropout's draws replayed), so the [rows, intermediate_size] activations never exist
  /// whole — what bounds a long sequence's layer once attention runs in linear memory. The
  /// values and gradients are the untiled MLP's (its products cut by rows). Off by default.
  void set_tiled_mlp(bool on, int64_t shards = 0);

  /// Installs (or, with null, removes) a prompt-learning adapter. With P-Tuning, logits() and
  /// hidden_states() cover the virtual tokens too (as PEFT's outputs do).
  void set_prompt_adapter(std::shared_ptr<PromptAdapter> adapter);
  PromptAdapter* prompt_adapter() const;

  struct Impl;

 private:
  /// The head unit's results: the cross-entropies (summed, or per position), the tokens they
  /// cover, and (when asked) each position's mean logit and entropy.
  struct HeadOutputs {
    at::Tensor losses;
    int64_t tokens = 0;
    at::Tensor mean_logits;
    at::Tensor aux{};  ///< the load-balancing loss, where it is computed
    at::Tensor entropies{};
  };
  /// What head_losses computes besides the losses: the logits' divisor and the metrics asked.
  struct HeadRequest {
    bool per_position = false;
    bool mean_logits = false;
    bool entropies = false;
    double temperature = 1.0;
  };
  HeadOutputs head_losses(const at::Tensor& input_ids, const at::Tensor& labels,
                          const at::Tensor& attention_mask, int64_t chunk_tokens,
                          const at::Tensor& position_ids, const HeadRequest& request);

  ModelConfig config_;
  UnitGate gate_;
  std::unique_ptr<Impl> impl_;
};

/// Values from a model folder's safetensors (single file or sharded). A tensor the model needs
/// but the checkpoint lacks is an IoError naming it; a shape mismatch too.
std::shared_ptr<ParameterSource> checkpoint_source(const std::string& path);
/// transformers' random initialization, seeded (see CausalLM::initialize_random).
std::shared_ptr<ParameterSource> random_source(const ModelConfig& config, uint64_t seed);

/// Fills every parameter of `model` from `source` (materializing them on their device).
void load_weights(torch::nn::Module& model, ParameterSource& source);

/// Copies the files that travel with a model folder's weights — tokenizer files
/// (tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
/// vocab.json, merges.txt, chat_template.jinja) and generation_config.json — from `from` to
/// `to`, those that exist. Links are followed for reading (a hub cache's snapshot links into
/// its blobs), but each must be a regular file of at most 1 GiB and the JSON ones must parse as
/// JSON objects — one that is not what its name says is not copied (a warning names it); they
/// are written atomically, so a link at the destination is replaced, never written through.
/// Returns how many were copied.
int copy_model_companion_files(const std::string& from, const std::string& to);

/// Checks that a checkpoint has every tensor the model needs, floating point and of the right
/// shape; throws IoError naming the first missing or mismatched tensor, or the layers beyond
/// the config's num_hidden_layers. Other extra tensors are listed in one warning (a head beside
/// tied embeddings gets its own: the tied embedding wins). Reading a tensor through
/// checkpoint_source checks its dtype and shape the same way.
void check_checkpoint(const CausalLM& model, const std::string& path);

}  // namespace zt
