// Configuration: a DeepSpeed JSON config and HF-TrainingArguments-style options, parsed once
// into typed, validated structs, then "auto" values resolved with HF Trainer's semantics.
//
// Thread-safety: the functions here are pure (no global state besides the log sink) and may be
// called from any thread. Nothing here is collective.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "zerotrain/error.hpp"

namespace zt {

/// A DeepSpeed setting that may be left out (the default applies), written as "auto" (resolved
/// later from the training arguments or the model), or written with a concrete value.
template <typename T>
class Auto {
 public:
  enum class State { kUnset, kAuto, kSet };

  Auto() = default;
  explicit Auto(T default_value) : value_(std::move(default_value)) {}

  State state() const { return state_; }
  bool is_auto() const { return state_ == State::kAuto; }
  bool is_set() const { return state_ == State::kSet; }  ///< a concrete value was written
  bool is_unset() const { return state_ == State::kUnset; }

  /// The value (the default when unset). Throws ConfigError when still "auto": the engine calls
  /// `check_resolved` first, so reaching this is a bug in the caller.
  const T& value() const {
    if (state_ == State::kAuto)
      throw ConfigError("internal: an \"auto\" value was read before resolution");
    return value_;
  }

  void set(T v) {
    value_ = std::move(v);
    state_ = State::kSet;
  }
  void set_auto() { state_ = State::kAuto; }
  /// Fills an "auto" (or unset) value; keeps it distinguishable from a written one.
  void resolve(T v) {
    value_ = std::move(v);
    if (state_ == State::kAuto) state_ = State::kUnset;
  }

 private:
  T value_{};
  State state_ = State::kUnset;
};

enum class OffloadDevice { kNone, kCpu, kNvme };

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  bool pin_memory = false;
  std::string nvme_path;
  int64_t buffer_count = 4;
  /// offload_optimizer only: the share of the optimizer state (masters and moments) the CPU
  /// holds and updates — DeepSpeed's ZeRO-Offload++ "Twin-Flow" `ratio`, in [0, 1], default 1;
  /// the rest stays on the GPU and is updated there (docs/engine.md, "Partial offload").
  double ratio = 1.0;
  bool enabled() const { return device != OffloadDevice::kNone; }
};

/// `zero_optimization` (REFERENCE §1). Sizes are in elements, as in DeepSpeed.
struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  Auto<int64_t> reduce_bucket_size{500000000};
  int64_t allgather_bucket_size = 500000000;
  /// Unset means on at every stage (see `overlap()`; DeepSpeed's own default is off below
  /// stage 3, docs/config.md says why zerotrain differs).
  std::optional<bool> overlap_comm;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
  int64_t sub_group_size = 1000000000;
  Auto<int64_t> stage3_prefetch_bucket_size{50000000};
  Auto<int64_t> stage3_param_persistence_threshold{100000};
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool round_robin_gradients = false;
  bool ignore_unused_parameters = true;
  /// MiCS / hybrid sharding: state and (stage 3) parameters sharded within groups of this many
  /// consecutive ranks and replicated across the groups; -1 (or 0): one group of the whole job.
  int64_t mics_shard_size = -1;
  bool mics_hierarchical_params_gather = false;
  /// ZeRO++ hpZ: a secondary copy of the stage-3 shards within groups of this many consecutive
  /// ranks, which backward's gathers read; 1: none.
  int64_t zero_hpz_partition_size = 1;
  /// ZeRO++ qwZ / qgZ: stage-3 weight gathers / gradient reductions in blockwise int8.
  bool zero_quantized_weights = false;
  bool zero_quantized_gradients = false;

  /// Reduce gradient buckets while backward runs. Off only where written false.
  bool overlap() const { return overlap_comm.value_or(true); }
};

/// The parameters of DeepSpeed's DynamicLossScaler, after the "no scaler keys" quirk.
struct LossScalerParams {
  bool dynamic = true;
  double initial_scale = 4294967296.0;  ///< 2^32: DeepSpeed's class default
  int64_t scale_window = 1000;
  int64_t hysteresis = 1;  ///< DeepSpeed's delayed_shift
  bool consecutive_hysteresis = false;
  double min_scale = 1.0;
};

struct Fp16Config {
  Auto<bool> enabled{false};
  bool auto_cast = false;
  double loss_scale = 0.0;  ///< 0 = dynamic; otherwise a static scale
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  /// True when any of initial_scale_power, loss_scale_window, min_loss_scale, hysteresis,
  /// consecutive_hysteresis was written. When none was, DeepSpeed uses its class defaults.
  bool scaler_keys_given = false;

  /// The scaler DeepSpeed would build from this block.
  LossScalerParams scaler() const;
};

struct Bf16Config {
  Auto<bool> enabled{false};
  /// DeepSpeed's low-precision options: master weights and gradients in bf16 (no fp32 copy),
  /// and Adam moments in bf16 — "pure bf16" training at 8 bytes per parameter.
  bool master_weights_and_grads = false;
  bool optimizer_states = false;
};

enum class OptimizerType { kAdamW, kAdam, kSgd };

/// `optimizer`. When the block is absent, `present` is false and resolution fills it from the
/// training arguments (the Trainer's own AdamW).
struct OptimizerConfig {
  bool present = false;
  std::string type_name = "AdamW";  ///< as written
  OptimizerType type = OptimizerType::kAdamW;
  Auto<double> lr{1e-3};
  Auto<std::array<double, 2>> betas{{0.9, 0.999}};
  Auto<double> eps{1e-8};
  Auto<double> weight_decay{0.0};
  bool bias_correction = true;
  double momentum = 0.0;  ///< SGD only
};

enum class SchedulerType { kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle, kLRRangeTest };
enum class WarmupType { kLog, kLinear };

/// `scheduler`. When absent, the Trainer's `lr_scheduler_type` schedule is used instead.
struct SchedulerConfig {
  bool present = false;
  SchedulerType type = SchedulerType::kWarmupLR;
  std::string type_name;
  // WarmupLR / WarmupDecayLR / WarmupCosineLR
  Auto<double> warmup_min_lr{0.0};
  Auto<double> warmup_max_lr{0.001};
  Auto<int64_t> warmup_num_steps{1000};
  Auto<int64_t> total_num_steps{0};
  WarmupType warmup_type = WarmupType::kLog;
  double warmup_min_ratio = 0.0;  ///< WarmupCosineLR
  double cos_min_ratio = 0.0001;  ///< WarmupCosineLR
  // OneCycle
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  std::optional<int64_t> cycle_second_step_size;  ///< defaults to the first
  int64_t cycle_first_stair_count = 0;
  std::optional<int64_t> cycle_second_stair_count;
  int64_t decay_step_size = 0;
  // LRRangeTest
  double lr_range_test_min_lr = 0.001;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

enum class CommDataType { kDefault, kFp32, kFp16, kBf16 };

/// A whole DeepSpeed config.
struct DeepSpeedConfig {
  std::string source = "<default>";  ///< file path, or "<string>" for inline JSON
  Auto<int64_t> train_batch_size;
  Auto<int64_t> train_micro_batch_size_per_gpu;
  Auto<int64_t> gradient_accumulation_steps;
  Auto<double> gradient_clipping{0.0};
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  CommDataType communication_data_type = CommDataType::kDefault;
  /// Ulysses sequence parallelism's degree (DeepSpeed's top-level `sequence_parallel_size`,
  /// ALST): what TrainingArguments::sequence_parallel_size takes when that is left at 1.
  int64_t sequence_parallel_size = 1;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  Fp16Config fp16;
  Bf16Config bf16;
  /// Unknown keys and ignored monitoring blocks, each with its JSON path (also logged).
  std::vector<std::string> warnings;
};

/// Parses DeepSpeed JSON text. `source` names it in messages (a path, or "<string>").
/// Throws ConfigError with the JSON path for malformed JSON, wrong types, out-of-range or
/// unsupported values. Unknown keys become warnings.
DeepSpeedConfig parse_deepspeed_config(std::string_view json,
                                       const std::string& source = "<string>");

/// Reads and parses a DeepSpeed config file. A missing/unreadable file is an IoError.
DeepSpeedConfig load_deepspeed_config(const std::string& path);

/// Training options with HF TrainingArguments names and defaults.
struct TrainingArguments {
  std::string model_name_or_path;  ///< HF model folder
  std::string model_config;        ///< or a config.json path / inline JSON: random weights
  std::string output_dir = "trainer_output";
  bool overwrite_output_dir = false;
  std::string resume_from_checkpoint;  ///< a checkpoint folder, or "True": newest in output_dir
  std::string train_file;              ///< JSONL
  std::string eval_file;               ///< JSONL
  // LLaMA-Factory's data options (docs/data.md, "LLaMA-Factory's datasets"): names of
  // dataset_dir/dataset_info.json, converted into the files train_file / eval_file name.
  std::string dataset;               ///< comma list of dataset_info.json names (or data files)
  std::string eval_dataset;          ///< the same, for evaluation
  std::string dataset_dir = "data";  ///< the folder of dataset_info.json and the data files
  /// Training records held out for evaluation: a share below 1, else a count.
  double val_size = 0.0;
  std::optional<int64_t> max_samples;  ///< the first N records of each dataset only
  std::string template_name = "auto";  ///< option "template": auto, or a name (docs/data.md)
  /// Chat template kwargs (a JSON object, apply_chat_template's **kwargs), and LLaMA-Factory's
  /// enable_thinking, which sets that kwarg (docs/data.md).
  std::string chat_template_kwargs;
  std::optional<bool> enable_thinking;
  int64_t max_length = 1024;  ///< alias model_max_length
  bool train_on_prompt = false;
  /// TRL's SFT options (docs/data.md): prompt-completion records train the completion only
  /// (unset: true, TRL's None); messages records train the assistant replies only (unset:
  /// true, zerotrain's default — TRL's is false); false trains every token of them.
  std::optional<bool> completion_only_loss;
  std::optional<bool> assistant_only_loss;
  std::string dataset_text_field = "text";  ///< TRL: the key of plain-text records
  bool skip_bad_lines = false;
  bool group_by_length = false;
  /// transformers 5's sampler choice: random | sequential (no shuffling) | group_by_length.
  std::string train_sampling_strategy = "random";
  bool packing = false;
  std::string cache_dir;        ///< tokenized data; empty: output_dir/.cache
  std::string device = "auto";  ///< auto | cpu | cuda
  bool use_cpu = false;         ///< HF's use_cpu (alias no_cuda): device cpu
  /// HF's torch_dtype (a model argument in HF's scripts): auto | float32 | bfloat16 | float16.
  /// bfloat16 / float16 turn on bf16 / fp16 when neither is given; contradicting them is an error.
  std::string torch_dtype = "auto";
  std::optional<bool> tf32;          ///< TF32 for fp32 matmuls and convolutions on GPUs
  std::string eval_strategy = "no";  ///< no | steps | epoch
  /// Steps between evaluations, or below 1 a fraction of all steps; default: logging_steps.
  std::optional<double> eval_steps;
  double eval_delay = 0.0;              ///< no evaluation before this many steps (or epochs)
  bool eval_on_start = false;           ///< evaluate once before the first step
  std::string save_strategy = "steps";  ///< no | steps | epoch
  bool load_best_model_at_end = false;
  std::string metric_for_best_model = "eval_loss";
  std::optional<bool> greater_is_better;  ///< default: false (the metrics are losses)
  bool ignore_data_skip = false;          ///< resume at the start of the saved epoch
  bool do_train = true;
  bool do_eval = false;
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  double num_train_epochs = 3.0;
  int64_t max_steps = -1;
  /// Warmup steps, or below 1 a fraction of all steps (transformers 5's form); over warmup_ratio.
  double warmup_steps = 0;
  double warmup_ratio = 0.0;
  std::string lr_scheduler_type = "linear";
  std::string optim = "adamw_torch";
  bool fp16 = false;
  bool bf16 = false;
  int64_t seed = 42;
  std::optional<int64_t> data_seed;
  double logging_steps = 500;  ///< steps, or below 1 a fraction of all steps (as HF reads it)
  std::string logging_strategy = "steps";  ///< no | steps | epoch
  bool logging_first_step = false;
  /// TensorBoard's folder (report_to tensorboard); empty: HF's default,
  /// output_dir/runs/<date>_<host>.
  std::string logging_dir;
  double save_steps = 500;  ///< steps, or below 1 a fraction of all steps (as HF reads it)
  std::optional<int64_t> save_total_limit;
  bool gradient_checkpointing = false;
  /// zerotrain's own: what a checkpointed layer keeps from its first pass so that its
  /// recomputation skips products (EngineOptions::recompute_keep_bytes): "auto" (what the GPU
  /// has left after the first step), "none", or a budget in GiB (a number ≥ 0).
  std::string gradient_checkpointing_keep = "auto";
  /// LLaMA-Factory's: recomputed layers hold their saved inputs in host memory between forward
  /// and backward (EngineOptions::offload_activations).
  bool use_unsloth_gc = false;
  /// Megatron's (--recompute-num-layers) and NeMo's: with gradient_checkpointing, one checkpoint
  /// per this many consecutive decoder layers; the layers between are rebuilt in backward from
  /// it (EngineOptions::units_per_checkpoint).
  int64_t recompute_num_layers = 1;
  /// zerotrain's own: update each parameter during backward and free its gradient where that
  /// cannot change the math (EngineOptions::update_in_backward; docs/engine.md).
  bool update_in_backward = true;
  bool dataloader_drop_last = false;
  /// DeepSpeed config: a path to a JSON file, or inline JSON text starting with '{'.
  std::string deepspeed;
  int64_t ddp_timeout = 1800;        ///< seconds, for collectives
  int64_t rendezvous_timeout = 300;  ///< seconds, for start-up
  /// none | tensorboard | all (= tensorboard), comma-separated; other integrations are
  /// accepted with a warning (metrics always go to the log and trainer_log.jsonl).
  std::string report_to = "none";
  std::string run_name;
  bool disable_tqdm = false;

  // Fine-tuning method (flat names, as LLaMA-Factory / ChatGLM-Finetuning users write them).
  std::string finetuning_type =
      "full";  ///< full | lora | ptuning | prefix (alias ptuning_v2) | freeze
  int64_t lora_r = 8;
  double lora_alpha = 16.0;
  double lora_dropout = 0.0;
  std::string lora_target_modules = "all-linear";  ///< comma list, a regex, or all-linear
  /// Comma list of the experts' fused tensors LoRA adapts too (TRL's lora_target_parameters,
  /// PEFT's target_parameters): experts.gate_up_proj, experts.down_proj.
  std::string lora_target_parameters;
  std::string lora_bias = "none";    ///< none | all | lora_only
  std::string lora_modules_to_save;  ///< comma list
  bool use_rslora = false;
  bool use_dora = false;             ///< DoRA (LLaMA-Factory / PEFT)
  bool pissa_init = false;           ///< LLaMA-Factory: PiSSA initialization
  int64_t pissa_iter = 16;           ///< LLaMA-Factory: randomized-SVD iterations (-1: full SVD)
  bool pissa_convert = false;        ///< LLaMA-Factory: also write the adapter as plain LoRA
  std::string init_lora_weights;     ///< PEFT's spelling: true | pissa | pissa_niter_<n>
  std::string adapter_name_or_path;  ///< continue from a PEFT LoRA adapter folder
  int64_t num_virtual_tokens = 16;
  std::string encoder_reparameterization_type = "MLP";  ///< MLP | LSTM (ptuning)
  int64_t encoder_hidden_size = 0;                      ///< 0: the model's hidden size
  std::optional<int64_t> pre_seq_len;                   ///< alias of num_virtual_tokens (prefix)
  bool prefix_projection = false;
  int64_t freeze_trainable_layers = 2;           ///< last N layers; negative: first N
  std::string freeze_trainable_modules = "all";  ///< all, or a comma list (mlp, self_attn, ...)
  std::string freeze_module_name;  ///< comma list of name substrings (overrides layers)
  std::string
      freeze_extra_modules;  ///< comma list of modules also trained (embed_tokens, lm_head, norm)

  /// LLaMA-Factory: a mixture of experts trains with its load-balancing loss at this
  /// coefficient (config.json's output_router_logits and router_aux_loss_coef set so); unset or
  /// 0: the config's own settings.
  std::optional<double> moe_aux_loss_coef;
  /// Expert parallelism (docs/model.md): ranks that share one copy of each mixture's experts,
  /// each holding 1/size of them, tokens sent to their experts by all-to-all (DeepSpeed-MoE's
  /// ep_size, Megatron's expert_model_parallel_size). Must divide the world and the experts.
  int64_t expert_parallel_size = 1;
  /// Ulysses sequence parallelism (docs/long_context.md): groups of this many consecutive ranks
  /// share each sequence, every rank holding 1/size of its positions, all-to-all swapping
  /// positions for heads around attention (DeepSpeed's and LLaMA-Factory's name; HF's
  /// parallelism_config `sp_size`). The data is split over world / size groups. Must divide
  /// the world and the attention heads.
  int64_t sequence_parallel_size = 1;
  /// ALST's TiledMLP (Axolotl's names; docs/long_context.md): each dense MLP runs over its rows
  /// in tiles — tiled_mlp_num_shards of them, unset: ceil(rows / hidden_size) — recomputed tile
  /// by tile in backward, so its [tokens, intermediate_size] activations never exist whole.
  bool tiled_mlp = false;
  std::optional<int64_t> tiled_mlp_num_shards;

  // A 4-bit base (QLoRA; docs/quantization.md), in LLaMA-Factory's and transformers'
  // BitsAndBytesConfig names; each spelling keeps its own defaults (quantization_of).
  int64_t quantization_bit = 0;                   ///< LLaMA-Factory: 4 (0: none; 8 is refused)
  std::string quantization_type;                  ///< LLaMA-Factory: nf4 | fp4 (default nf4)
  std::optional<bool> double_quantization;        ///< LLaMA-Factory (default true)
  bool load_in_4bit = false;                      ///< transformers
  bool load_in_8bit = false;                      ///< transformers: refused (no 8-bit base)
  std::string bnb_4bit_quant_type;                ///< transformers: nf4 | fp4 (default fp4)
  std::optional<bool> bnb_4bit_use_double_quant;  ///< transformers (default false)
  /// transformers: accepted when it names the run's dtype (zerotrain computes in that)
  std::string bnb_4bit_compute_dtype;
  std::string bnb_4bit_quant_storage;  ///< transformers: accepted; the codes are kept as bytes

  // Preference training (docs/preference.md): LLaMA-Factory's names; TRL's are aliases.
  std::string stage = "sft";  ///< LLaMA-Factory: sft | dpo | kto; grpo (TRL's GRPO)
  /// alias loss_type: sigmoid | hinge | ipo | robust | orpo | simpo (stage dpo); kto |
  /// apo_zero_unpaired (stage kto, where the default sigmoid means kto)
  std::string pref_loss = "sigmoid";
  double pref_beta = 0.1;  ///< alias beta
  double pref_ftx = 0.0;   ///< LLaMA-Factory: + pref_ftx · the chosen answer's mean NLL, per pair
  double rpo_alpha = 0.0;  ///< TRL ≤0.28: + rpo_alpha · the chosen answers' token-mean NLL
  double dpo_label_smoothing = 0.0;  ///< alias label_smoothing: cDPO's and robust's ε
  double simpo_gamma = 0.5;
  double kto_chosen_weight = 1.0;    ///< alias desirable_weight: KTO's weight of desirable examples
  double kto_rejected_weight = 1.0;  ///< alias undesirable_weight
  int64_t max_prompt_length = 0;  ///< TRL ≤0.28: a prompt keeps its last this many tokens (0: all)
  std::string truncation_mode = "keep_start";  ///< TRL: keep_start | keep_end (of each sequence)
  /// TRL: the reference's log-probs computed once before training and kept with the run
  /// (default: on for full fine-tuning, which has no adapters to switch off; off there, a
  /// frozen copy of the starting weights is the reference).
  std::optional<bool> precompute_ref_log_probs;

  // GRPO (stage grpo, docs/grpo.md): TRL's GRPOConfig names; `beta` (pref_beta, default 0 here)
  // and `loss_type` (pref_loss, default dapo here) are shared with preference training.
  int64_t num_generations = 8;
  int64_t max_completion_length = 512;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  double epsilon = 0.2;
  std::optional<double> epsilon_high;  ///< default: epsilon
  std::optional<double> delta;
  std::string importance_sampling_level = "token";
  std::string scale_rewards = "group";  ///< group (true) | batch | none (false)
  bool mask_truncated_completions = false;
  int64_t num_iterations = 1;  ///< GRPO: optimizer steps per generation batch (TRL's μ)
  /// GRPO: micro-batches one generation batch covers (TRL's; 0: gradient_accumulation_steps);
  /// a multiple of gradient_accumulation_steps, so a generation feeds whole optimizer steps.
  int64_t steps_per_generation = 0;
  /// GRPO: transformers' stop_strings — one string, or a JSON list of strings.
  std::string stop_strings;
  double sapo_temperature_pos = 1.0, sapo_temperature_neg = 1.05;
  bool use_bias_correction_kl = false;
  std::string reward_funcs;    ///< comma list of built-in rewards (builtin_reward's specs)
  std::string reward_weights;  ///< comma list of numbers, one per reward function
  /// A reward program (docs/grpo.md): run with /bin/sh -c, fed JSON lines, answering a number
  /// per line; scored after reward_funcs' functions. Each batch answered within reward_timeout s.
  std::string reward_command;
  double reward_timeout = 60.0;

  // ChatGLM-Finetuning's train.py flags (docs/chatglm.md). Any of them given puts its defaults
  // in place of HF's for what is not given (finalize_chatglm_finetuning in training_args.cpp).
  std::string glm_prompt_layout;     ///< option "mode": glm2 | glm3 (data_set.py's layout)
  int64_t max_source_length = 256;   ///< option "max_src_len"
  bool skip_truncated = false;       ///< option "is_skip"
  std::string train_type;            ///< lora | freeze | ptuning (prefix) | all (full)
  double warmup_min_lr_ratio = 0.0;  ///< DeepSpeed schedulers' auto warmup_min_lr ÷ learning_rate

  /// Names of the options that were given explicitly (flag or JSON key), as opposed to defaulted.
  std::set<std::string> given;
  bool is_given(const std::string& name) const { return given.count(name) != 0; }
  /// HF TrainingArguments fields that were given but have no effect in zerotrain, each with the
  /// line to warn with once (the Trainer does, on rank 0).
  std::map<std::string, std::string> ignored;
};

/// Applies `--name value` / `--name=value` flags (`--fp16` alone means true; `True`/`false`/`1`
/// accepted). `--local_rank N` is accepted and ignored; so is every other HF TrainingArguments
/// field, recorded in `ignored` (or a ConfigError when its value would change results).
/// Positional arguments are returned in order. Throws ConfigError naming an unknown flag or a
/// bad value.
std::vector<std::string> apply_training_flags(TrainingArguments& args,
                                              const std::vector<std::string>& argv);

/// Applies a JSON object of the same names. `source` names it in messages.
void apply_training_json(TrainingArguments& args, std::string_view json_object,
                         const std::string& source = "<string>");

/// Applies a YAML mapping of the same names (LLaMA-Factory's config files), read through
/// yaml-cpp into the values a JSON object would hold (docs/config.md gives the rules). Malformed,
/// too deep or too large YAML is a ConfigError naming `source`, line and column.
void apply_training_yaml(TrainingArguments& args, std::string_view yaml,
                         const std::string& source = "<string>");

/// Whether `path` ends in .yaml or .yml (an options file apply_training_file reads as YAML).
bool is_yaml_path(const std::string& path);

/// Applies the options in the file `path` (`zerotrain train CONFIG.yaml`, `--options
/// FILE.json`): YAML for .yaml / .yml, else a JSON object; a regular file of at most 64 MiB,
/// else an IoError naming it.
void apply_training_file(TrainingArguments& args, const std::string& path);

/// Throws ConfigError naming the first number outside its option's range (the table in
/// docs/config.md) or the first pair of settings that contradict each other. The parsers above
/// end with it; the Trainer runs it again for arguments set in code.
void check_training_arguments(const TrainingArguments& args);

/// The DeepSpeed config the arguments name: none (an empty DeepSpeedConfig: plain data
/// parallel, stage 0), inline JSON text, or a file path.
DeepSpeedConfig deepspeed_config_for(const TrainingArguments& args);

/// Every option name the parser accepts (for help output).
std::vector<std::string> training_option_names();

/// One option for `--help`: its name, its default as text ("" when none) and a line of help.
struct OptionHelp {
  std::string name;
  std::string default_value;
  std::string help;
};
std::vector<OptionHelp> training_option_help();

/// The batch a checkpoint was saved with (trainer_state.json), for a run resuming from it.
struct SavedBatch {
  int64_t global_batch_size = 0;
  int world_size = 1;
};

/// What resolution may know beyond the configs themselves.
struct ResolveContext {
  int world_size = 1;
  std::optional<int64_t> hidden_size;        ///< once the model is known
  std::optional<int64_t> total_train_steps;  ///< once the data size is known
  /// Resuming: the saved global batch is kept by changing gradient_accumulation_steps (even
  /// when given) where it divides evenly at this world size; else a warning names the global
  /// batch the run continues with.
  std::optional<SavedBatch> resumed = std::nullopt;
};

/// Resolves "auto" values with HF Trainer's semantics and reconciles both configs, in place:
/// afterwards `args` and `ds` agree on batch sizes, optimizer hyper-parameters, clipping and
/// precision. The one place the micro batch and the accumulation are decided. A written DeepSpeed
/// value overrides a defaulted argument; one that contradicts an explicitly given argument is a
/// ConfigError naming both. May be called again with more context (model, run length) to resolve
/// what remained "auto".
void resolve_config(DeepSpeedConfig& ds, TrainingArguments& args, const ResolveContext& context);

/// The JSON paths that are still "auto" (empty when everything is resolved).
std::vector<std::string> unresolved_keys(const DeepSpeedConfig& ds);

/// Throws ConfigError listing every value still "auto" and what would resolve it.
void check_resolved(const DeepSpeedConfig& ds);

/// The effective warmup step count: warmup_steps if > 0 (steps_for's rule), else
/// ceil(warmup_ratio * total).
int64_t warmup_steps_for(const TrainingArguments& args, int64_t total_train_steps);

/// gradient_checkpointing_keep as EngineOptions::recompute_keep_bytes (kAutoKeep for "auto").
/// Throws ConfigError naming the option for anything but auto, none or a number ≥ 0.
int64_t recompute_keep_bytes_for(const TrainingArguments& args);

/// A step interval as HF reads logging_steps, save_steps and eval_steps: `every` itself from 1
/// up, below 1 a fraction of the run, ceil(every * total), at least 1.
int64_t steps_for(double every, int64_t total_train_steps);

/// One line per setting, for logs and `zerotrain config`.
std::string describe(const DeepSpeedConfig& ds);

/// The config as DeepSpeed JSON (what a resolved config amounts to; values still "auto" are
/// written as "auto"). `optimizer` and `scheduler` appear only when the config had them.
std::string deepspeed_config_json(const DeepSpeedConfig& ds);

/// Every training option by its name (aliases left out) with its value, as one JSON object.
std::string training_arguments_json(const TrainingArguments& args);

}  // namespace zt
