// Parameter-efficient fine-tuning on a CausalLM — LoRA, P-Tuning (v1), prefix tuning (P-Tuning
// v2) and Freeze — interoperable with HF PEFT's files (adapter_config.json +
// adapter_model.safetensors, PEFT's key names).
//
// Thread-safety: these functions modify or read a model; use them from the thread that owns it.
// Nothing here is collective (under ZeRO-3, pass Engine::gather_full_parameters() values).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/config.hpp"
#include "zerotrain/model.hpp"

namespace zt {

enum class FinetuningType { kFull, kLora, kPTuning, kPrefix, kFreeze };

struct LoraOptions {
  int64_t r = 8;
  double alpha = 16.0;
  double dropout = 0.0;
  /// Module names (a module matches when its path equals or ends with ".name"); ignored when
  /// `target_regex` is set (full match on the module path, as PEFT treats a string).
  /// "all-linear": every projection except the output layer.
  std::vector<std::string> target_modules{"all-linear"};
  std::string target_regex;
  /// PEFT's target_parameters: the mixtures' fused expert tensors ("experts.gate_up_proj",
  /// "experts.down_proj"; a name matches "<experts module>.<tensor>" equal or as a dotted
  /// suffix), each adapted per expert as PEFT's ParamWrapper does (docs/peft.md). Only those
  /// tensors; without dropout, DoRA or PiSSA, as PEFT.
  std::vector<std::string> target_parameters;
  std::string bias = "none";  ///< none | all | lora_only
  std::vector<std::string> modules_to_save;
  bool use_rslora = false;  ///< scale by alpha / sqrt(r) instead of alpha / r
  /// DoRA (PEFT's use_dora): the adapted weight's rows rescaled to a trained magnitude vector
  /// (docs/peft.md).
  bool use_dora = false;
  /// How A and B start (PEFT's init_lora_weights): "true" (A kaiming-uniform, B zero),
  /// "pissa" (the weight's top-r singular triplets; the base keeps the residual), or
  /// "pissa_niter_<n>" (the same from a randomized SVD with n subspace iterations).
  std::string init_lora_weights = "true";
  /// PEFT's rank_pattern and alpha_pattern: a projection's (or expert tensor's) own rank and
  /// alpha where a pattern matches its path — Python's re.match of `(.*\.)?(<pattern>)$`, the
  /// first pattern in order that does — else r and alpha. PEFT 0.21's conversion for
  /// transformers 5's fused experts sets them (lib/peft/fused_experts.hpp); a user may too.
  /// Not with DoRA or PiSSA.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;

  /// These options with r and alpha as rank_pattern / alpha_pattern give them for the module or
  /// parameter at `path` (the patterns cleared). Throws ConfigError for a pattern RE2 refuses.
  LoraOptions at(const std::string& path) const;
  /// The factor the adapter's product B·A is scaled by (PEFT's LoraLayer.scaling): alpha / r,
  /// or alpha / sqrt(r) with rsLoRA. The one definition training and merge use.
  double scaling() const;
};

struct PromptOptions {
  int64_t num_virtual_tokens = 16;
  std::string reparameterization = "MLP";  ///< P-Tuning encoder: MLP | LSTM
  int64_t encoder_hidden_size = 0;         ///< 0: the model's hidden size
  int64_t encoder_num_layers = 2;          ///< LSTM layers (PEFT's default)
  bool prefix_projection = false;          ///< prefix tuning through a 2-layer tanh MLP
};

struct FreezeOptions {
  int64_t trainable_layers = 2;  ///< last N; negative: first N
  std::vector<std::string> trainable_modules{"all"};
  std::vector<std::string> module_names;   ///< name substrings (ChatGLM-Finetuning)
  std::vector<std::string> extra_modules;  ///< embed_tokens, lm_head, norm, ...
};

struct PeftConfig {
  FinetuningType type = FinetuningType::kFull;
  LoraOptions lora;
  PromptOptions prompt;
  FreezeOptions freeze;
  std::string base_model_name_or_path;
};

/// The method and options the flat training arguments ask for (finetuning_type, lora_*,
/// num_virtual_tokens / pre_seq_len, encoder_*, prefix_projection, freeze_*).
PeftConfig peft_config_for(const TrainingArguments& args);

struct ParameterCount {
  int64_t trainable = 0;
  int64_t all = 0;
  /// PEFT's start-up line: "trainable params: 3,584 || all params: 106,304 || trainable%: 3.3715"
  std::string line() const;
};
ParameterCount count_parameters(const torch::nn::Module& model);

/// Applies the method to `model`: adds LoRA A/B to the targeted projections (A kaiming-uniform,
/// B zero, as PEFT), or installs a P-Tuning / prefix encoder (PyTorch's default inits), and sets
/// requires_grad so that only what the method trains is trainable. Seeded: every rank gets the
/// same values. Unsupported combinations are ConfigErrors.
ParameterCount apply_peft(CausalLM& model, const PeftConfig& config, uint64_t seed);

/// The method in words, for a run's start-up line: "LoRA r16 (alpha 32) over a 4-bit NF4 base
/// (double quantization)", "DoRA r8 (alpha 16), started by PiSSA (a full SVD) over a
/// full-precision base", "P-Tuning: 16 virtual tokens through an MLP encoder", ... `base` is
/// the run's 4-bit base (ModelConfig::quantization), `continued` an adapter_name_or_path run.
std::string describe_method(const PeftConfig& config, const std::optional<QuantizationConfig>& base,
                            bool continued);
/// Whether a run's adapter starts as the base computes, so that the model with its adapters off
/// (CausalLM::set_adapters_enabled) is the model the run started from, at any step: a new LoRA
/// or DoRA adapter (B starts at zero) that trains nothing beside its own factors. Not PiSSA (the
/// base holds the residual), not an adapter continued from a folder (`continued`), not one with
/// trained biases or modules_to_save (adapters off leave them as trained), not P-Tuning or
/// prefix tuning (the starting virtual tokens already change the model). Preference training's
/// reference is the model as it starts: the starting trainable values swapped in where this is
/// false (docs/preference.md).
bool adapter_starts_as_base(const PeftConfig& config, bool continued);
/// What the trainable values of such a start are, for a log line ("PiSSA's starting factors
/// over the residual", "the adapter it continues", ...).
std::string adapter_start_description(const PeftConfig& config, bool continued);

/// Writes the adapter in PEFT's format: adapter_config.json and adapter_model.safetensors
/// (LoRA: base_model.model.<module>.lora_A.weight / lora_B.weight, trainable biases and
/// modules_to_save; prompt methods: prompt_embeddings, the encoder's output). `values`, when
/// given, supplies full tensors by parameter name (under ZeRO-3: Engine::gather_full_parameters)
/// instead of the module's own. Written atomically.
void save_adapter(CausalLM& model, const PeftConfig& config, const std::string& dir,
                  const std::vector<std::pair<std::string, at::Tensor>>& values = {});

/// Reads adapter_config.json. Options zerotrain does not implement (use_dora, layers_to_transform,
/// other PEFT types, ...) are ConfigErrors naming them.
PeftConfig load_adapter_config(const std::string& dir);

/// The base model folder of the adapter in `adapter_dir`: `override` when given, else its
/// adapter_config.json's base_model_name_or_path, taken as PEFT takes it (a relative path is
/// relative to the current directory). A base that names no folder is a ConfigError saying
/// what to pass instead.
std::string adapter_base_model(const std::string& adapter_dir, const std::string& override = "");

/// The tensors of an adapter folder's adapter_model.safetensors by the model's parameter names
/// (PEFT's `base_model.model.` prefix removed): LoRA A/B, trained biases, modules_to_save.
std::shared_ptr<ParameterSource> adapter_source(const std::string& adapter_dir);

/// Applies a PEFT adapter folder to `model` (built without one): LoRA weights are loaded into
/// newly created adapters (trainable when `trainable`); P-Tuning and prefix adapters become a
/// fixed table of prompt_embeddings, as PEFT loads them for inference. Shapes are checked.
ParameterCount load_adapter(CausalLM& model, const std::string& dir, bool trainable);

/// Applies what the training arguments ask for — the call a trainer makes. With
/// `adapter_name_or_path`, the LoRA adapter in that folder trains on from its saved values: its
/// adapter_config.json decides the LoRA shape, and lora_r / lora_alpha / use_rslora given
/// explicitly must agree with it; the method must be lora (P-Tuning and prefix adapters keep only
/// the encoder's output, so those resume from zerotrain checkpoints). Otherwise
/// apply_peft(model, peft_config_for(args), seed). Mismatches are ConfigErrors naming the folder.
ParameterCount apply_peft_from_args(CausalLM& model, const TrainingArguments& args, uint64_t seed);

/// Folds every LoRA adapter into its base weight (W += B·A·scaling) / takes it out again.
void merge_lora(CausalLM& model);
void unmerge_lora(CausalLM& model);

/// Writes an HF model folder (config.json + safetensors, 5 GB shards) with LoRA merged in and no
/// adapter tensors, in `dtype`. The model is left unmerged.
void export_merged(CausalLM& model, const std::string& dir, at::ScalarType dtype);

/// A ParameterSource that reads base weights from `base` and everything `base` lacks (adapter
/// parameters) from `model`'s own values — for an Engine over a PEFT model whose base comes
/// from a checkpoint.
std::shared_ptr<ParameterSource> with_adapter_values(std::shared_ptr<ParameterSource> base,
                                                     torch::nn::Module& model);

}  // namespace zt
