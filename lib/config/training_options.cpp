// The TrainingArguments option table (see training_options.hpp).
#include "config/training_options.hpp"

#include <fmt/format.h>

#include "util/limits.hpp"

namespace zt::config {

bool Range::contains(double v) const {
  const bool above_min = ends == kOpenBelow ? v > min : v >= min;
  const bool below_max = ends == kOpenAbove ? v < max : v <= max;
  return above_min && below_max;
}

std::string Range::describe(bool integer) const {
  const char* kind = integer ? "an integer" : "a number";
  if (max >= 1e308) return fmt::format("{} >= {}", kind, min);
  if (ends == kClosed) return fmt::format("{} from {} to {}", kind, min, max);
  return fmt::format("{} {} {} and {} {}", kind, ends == kOpenBelow ? ">" : ">=", min,
                     ends == kOpenAbove ? "<" : "<=", max);
}

namespace {

// The upper ends of the ranges: far beyond any real run, low enough that nothing derived from
// them (tokens per step, steps × batch, deadlines in nanoseconds) overflows or is allocated
// before the memory check sees it.
constexpr double kLengthMax = 1 << 20;  // tokens per sequence; hidden sizes
constexpr double kBatchMax = 1 << 16;   // examples per micro-batch; accumulation steps
constexpr double kWidthMax = 1 << 16;   // LoRA rank, virtual tokens, layers
constexpr double kStepsMax = static_cast<double>(limits::kMaxSteps);
constexpr double kSeedMax = 4294967295;  // 2^32 - 1, as HF's set_seed (numpy) takes
constexpr double kSecondsMax = 1e9;      // timeouts: about 31 years

// Run and data.
std::vector<Option> run_and_data() {
  return {
      {"model_name_or_path",
       &Args::model_name_or_path,
       {},
       -1e308,
       "HF model folder (config.json + safetensors)"},
      {"model_config",
       &Args::model_config,
       {},
       -1e308,
       "a model without weights: config.json path or inline JSON (random init)"},
      {"output_dir",
       &Args::output_dir,
       {},
       -1e308,
       "where checkpoints, logs and the final model go"},
      {"overwrite_output_dir",
       &Args::overwrite_output_dir,
       {},
       -1e308,
       "allow a new run into an output_dir holding checkpoints"},
      {"resume_from_checkpoint",
       &Args::resume_from_checkpoint,
       {},
       -1e308,
       "a checkpoint folder, or True for the newest in output_dir"},
      {"train_file", &Args::train_file, {}, -1e308, "JSONL training data"},
      {"eval_file", &Args::eval_file, {}, -1e308, "JSONL evaluation data"},
      {"template",
       &Args::template_name,
       {},
       -1e308,
       "prompt / chat template: auto (the model's own chat format, else alpaca_zh) or a name from "
       "docs/data.md"},
      {"max_length", &Args::max_length, {}, {1, kLengthMax}, "tokens per example after truncation"},
      {"model_max_length", &Args::max_length, {}, {1, kLengthMax}, "alias of max_length"},
      {"train_on_prompt",
       &Args::train_on_prompt,
       {},
       -1e308,
       "compute the loss on prompt tokens too"},
      {"skip_bad_lines",
       &Args::skip_bad_lines,
       {},
       -1e308,
       "skip (and count) malformed JSONL lines instead of failing"},
      {"group_by_length",
       &Args::group_by_length,
       {},
       -1e308,
       "batch examples of similar length (HF LengthGroupedSampler)"},
      {"train_sampling_strategy",
       &Args::train_sampling_strategy,
       {"random", "sequential", "group_by_length"},
       -1e308,
       "transformers 5's sampler: random order, the file's order, or grouped by length"},
      {"packing",
       &Args::packing,
       {},
       -1e308,
       "pack examples into max_length sequences (no attention across them)"},
      {"cache_dir",
       &Args::cache_dir,
       {},
       -1e308,
       "tokenized-data cache (default: output_dir/.cache)"},
      {"device",
       &Args::device,
       {"auto", "cpu", "cuda"},
       -1e308,
       "auto: one GPU per rank when CUDA is present, else CPU"},
      {"use_cpu", &Args::use_cpu, {}, -1e308, "train on the CPU (device cpu)"},
      {"no_cuda", &Args::use_cpu, {}, -1e308, "alias of use_cpu"},
      {"torch_dtype",
       &Args::torch_dtype,
       {"auto", "float32", "bfloat16", "float16", "None"},
       -1e308,
       "bfloat16 / float16 turn on bf16 / fp16"},
      {"tf32", &Args::tf32, {}, -1e308, "TF32 for fp32 matmuls on GPUs (default: LibTorch's, off)"},
      {"do_train",
       &Args::do_train,
       {},
       -1e308,
       "accepted (training runs when train_file is given)"},
      {"do_eval", &Args::do_eval, {}, -1e308, "accepted (evaluation runs when eval_file is given)"},
  };
}

// Batches and optimization.
std::vector<Option> batches_and_optimization() {
  return {
      {"per_device_train_batch_size",
       &Args::per_device_train_batch_size,
       {},
       {1, kBatchMax},
       "micro-batch per rank"},
      {"per_gpu_train_batch_size",
       &Args::per_device_train_batch_size,
       {},
       {1, kBatchMax},
       "alias of per_device_train_batch_size"},
      {"per_device_eval_batch_size",
       &Args::per_device_eval_batch_size,
       {},
       {1, kBatchMax},
       "evaluation batch per rank"},
      {"per_gpu_eval_batch_size",
       &Args::per_device_eval_batch_size,
       {},
       {1, kBatchMax},
       "alias of per_device_eval_batch_size"},
      {"gradient_accumulation_steps",
       &Args::gradient_accumulation_steps,
       {},
       {1, kBatchMax},
       "micro-batches per optimizer step"},
      {"learning_rate", &Args::learning_rate, {}, {0, 100}, "peak learning rate"},
      {"weight_decay",
       &Args::weight_decay,
       {},
       {0, 100},
       "AdamW weight decay (not on biases and norms)"},
      {"adam_beta1", &Args::adam_beta1, {}, {0, 1, Range::kOpenAbove}, ""},
      {"adam_beta2", &Args::adam_beta2, {}, {0, 1, Range::kOpenAbove}, ""},
      {"adam_epsilon", &Args::adam_epsilon, {}, {0, 1, Range::kOpenBelow}, ""},
      {"max_grad_norm", &Args::max_grad_norm, {}, {0, 1e9}, "gradient clipping (0: none)"},
      {"num_train_epochs", &Args::num_train_epochs, {}, {0, 1e6}, "epochs (fractions allowed)"},
      {"max_steps",
       &Args::max_steps,
       {},
       {-1, kStepsMax},
       "optimizer steps; overrides num_train_epochs when > 0"},
      {"warmup_steps",
       &Args::warmup_steps,
       {},
       {0, kStepsMax},
       "steps, or below 1 a fraction of all steps (transformers 5)"},
      {"warmup_ratio",
       &Args::warmup_ratio,
       {},
       {0, 1},
       "warmup as a fraction of all steps (when warmup_steps is 0)"},
      {"lr_scheduler_type",
       &Args::lr_scheduler_type,
       {"linear", "cosine", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt"},
       -1e308,
       ""},
      {"optim", &Args::optim, {"adamw_torch", "adamw_torch_fused", "adamw_hf", "sgd"}, -1e308, ""},
      {"fp16", &Args::fp16, {}, -1e308, "fp16 mixed precision with dynamic loss scaling"},
      {"bf16", &Args::bf16, {}, -1e308, "bf16 mixed precision"},
      {"seed", &Args::seed, {}, {0, kSeedMax}, "seed of initialization, adapters and dropout"},
      {"data_seed", &Args::data_seed, {}, {0, kSeedMax}, "seed of data shuffling (default: seed)"},
      {"gradient_checkpointing",
       &Args::gradient_checkpointing,
       {},
       -1e308,
       "recompute activations in backward"},
      {"gradient_checkpointing_keep",
       &Args::gradient_checkpointing_keep,
       {},
       -1e308,
       "what a recomputed layer keeps from its first pass to skip products: auto (what the GPU "
       "has left after the first step), none, or a budget in GiB"},
      {"update_in_backward",
       &Args::update_in_backward,
       {},
       -1e308,
       "update each parameter as its gradient completes, where the math allows (one rank, no "
       "clipping or accumulation, not fp16)"},
      {"dataloader_drop_last",
       &Args::dataloader_drop_last,
       {},
       -1e308,
       "drop the last incomplete batch"},
      {"deepspeed", &Args::deepspeed, {}, -1e308, "DeepSpeed config: a JSON file or inline JSON"},
  };
}

// Logging, evaluation, saving.
std::vector<Option> logging_evaluation_saving() {
  return {
      {"logging_steps",
       &Args::logging_steps,
       {},
       {0, kStepsMax, Range::kOpenBelow},
       "log every N optimizer steps (below 1: a fraction of all steps)"},
      {"logging_strategy", &Args::logging_strategy, {"no", "steps", "epoch"}, -1e308, ""},
      {"logging_first_step", &Args::logging_first_step, {}, -1e308, ""},
      {"logging_dir",
       &Args::logging_dir,
       {},
       -1e308,
       "TensorBoard folder (default: output_dir/runs/<date>_<host>)"},
      {"eval_strategy", &Args::eval_strategy, {"no", "steps", "epoch"}, -1e308, ""},
      {"evaluation_strategy",
       &Args::eval_strategy,
       {"no", "steps", "epoch"},
       -1e308,
       "alias of eval_strategy"},
      {"eval_steps",
       &Args::eval_steps,
       {},
       {0, kStepsMax, Range::kOpenBelow},
       "evaluate every N steps (below 1: a fraction; default: logging_steps)"},
      {"eval_delay",
       &Args::eval_delay,
       {},
       {0, kStepsMax},
       "no evaluation before this many steps (epochs with eval_strategy epoch)"},
      {"eval_on_start", &Args::eval_on_start, {}, -1e308, "evaluate once before training"},
      {"save_strategy", &Args::save_strategy, {"no", "steps", "epoch"}, -1e308, ""},
      {"save_steps",
       &Args::save_steps,
       {},
       {0, kStepsMax, Range::kOpenBelow},
       "checkpoint every N optimizer steps (below 1: a fraction of all steps)"},
      {"save_total_limit",
       &Args::save_total_limit,
       {},
       {1, kStepsMax},
       "keep at most N checkpoints (the best one too)"},
      {"load_best_model_at_end",
       &Args::load_best_model_at_end,
       {},
       -1e308,
       "save the best checkpoint's weights as the final model"},
      {"metric_for_best_model", &Args::metric_for_best_model, {"eval_loss", "loss"}, -1e308, ""},
      {"greater_is_better",
       &Args::greater_is_better,
       {},
       -1e308,
       "default false: the metrics are losses"},
      {"ignore_data_skip",
       &Args::ignore_data_skip,
       {},
       -1e308,
       "on resume, start the saved epoch from its beginning"},
      {"ddp_timeout",
       &Args::ddp_timeout,
       {},
       {1, kSecondsMax},
       "seconds every collective may take"},
      {"rendezvous_timeout",
       &Args::rendezvous_timeout,
       {},
       {1, kSecondsMax},
       "seconds start-up may take"},
      {"report_to",
       &Args::report_to,
       {},
       -1e308,
       "none, tensorboard or all (metrics always go to the log and trainer_log.jsonl)"},
      {"run_name", &Args::run_name, {}, -1e308, "accepted"},
      {"disable_tqdm",
       &Args::disable_tqdm,
       {},
       -1e308,
       "plain log lines instead of a live progress line"},
  };
}

// Fine-tuning method.
std::vector<Option> fine_tuning_method() {
  return {
      {"finetuning_type",
       &Args::finetuning_type,
       {"full", "lora", "ptuning", "prefix", "ptuning_v2", "freeze"},
       -1e308,
       ""},
      {"lora_r", &Args::lora_r, {}, {1, kWidthMax}, "LoRA rank"},
      {"lora_rank", &Args::lora_r, {}, {1, kWidthMax}, "alias of lora_r"},
      {"lora_alpha", &Args::lora_alpha, {}, {0, 1e6}, ""},
      {"lora_dropout", &Args::lora_dropout, {}, {0, 1, Range::kOpenAbove}, ""},
      {"lora_target_modules",
       &Args::lora_target_modules,
       {},
       -1e308,
       "comma list, a regex, or all-linear"},
      {"lora_target", &Args::lora_target_modules, {}, -1e308, "alias of lora_target_modules"},
      {"lora_bias", &Args::lora_bias, {"none", "all", "lora_only"}, -1e308, ""},
      {"lora_modules_to_save",
       &Args::lora_modules_to_save,
       {},
       -1e308,
       "comma list of modules trained in full"},
      {"use_rslora", &Args::use_rslora, {}, -1e308, "scale by alpha/sqrt(r)"},
      {"adapter_name_or_path",
       &Args::adapter_name_or_path,
       {},
       -1e308,
       "continue from a PEFT LoRA adapter folder"},
      {"num_virtual_tokens",
       &Args::num_virtual_tokens,
       {},
       {1, kWidthMax},
       "P-Tuning / prefix length"},
      {"encoder_reparameterization_type",
       &Args::encoder_reparameterization_type,
       {"MLP", "LSTM"},
       -1e308,
       ""},
      {"encoder_hidden_size",
       &Args::encoder_hidden_size,
       {},
       {0, kLengthMax},
       "0: the model's hidden size"},
      {"pre_seq_len",
       &Args::pre_seq_len,
       {},
       {1, kWidthMax},
       "prefix length (prefix / ptuning_v2 only)"},
      {"prefix_projection", &Args::prefix_projection, {}, -1e308, ""},
      {"freeze_trainable_layers",
       &Args::freeze_trainable_layers,
       {},
       {-kWidthMax, kWidthMax},
       "last N layers train; negative: first N"},
      {"freeze_trainable_modules",
       &Args::freeze_trainable_modules,
       {},
       -1e308,
       "all, or layer modules (mlp, self_attn, ...)"},
      {"freeze_module_name",
       &Args::freeze_module_name,
       {},
       -1e308,
       "comma list of name substrings that train"},
      {"freeze_extra_modules",
       &Args::freeze_extra_modules,
       {},
       -1e308,
       "also train these (embed_tokens, lm_head, norm)"},
  };
}

// A 4-bit base (QLoRA): LLaMA-Factory's names, then transformers' BitsAndBytesConfig's.
std::vector<Option> quantization() {
  return {
      {"quantization_bit", &Args::quantization_bit, {}, {0, 8}, "4: a 4-bit base (QLoRA)"},
      {"quantization_type", &Args::quantization_type, {"nf4", "fp4"}, -1e308, "default nf4"},
      {"double_quantization",
       &Args::double_quantization,
       {},
       -1e308,
       "the absmax in 8-bit codes (default true)"},
      {"load_in_4bit", &Args::load_in_4bit, {}, -1e308, "transformers' name for a 4-bit base"},
      {"load_in_8bit", &Args::load_in_8bit, {}, -1e308, "refused: no 8-bit base"},
      {"bnb_4bit_quant_type", &Args::bnb_4bit_quant_type, {"nf4", "fp4"}, -1e308, "default fp4"},
      {"bnb_4bit_use_double_quant", &Args::bnb_4bit_use_double_quant, {}, -1e308, "default false"},
      {"bnb_4bit_compute_dtype",
       &Args::bnb_4bit_compute_dtype,
       {},
       -1e308,
       "accepted when it is the run's dtype"},
      {"bnb_4bit_quant_storage",
       &Args::bnb_4bit_quant_storage,
       {},
       -1e308,
       "accepted; the codes are kept as bytes"},
  };
}

// ChatGLM-Finetuning's train.py flags: aliases with its meanings (docs/chatglm.md).
std::vector<Option> chatglm_finetuning() {
  return {
      {"train_path", &Args::train_file, {}, -1e308, "ChatGLM-Finetuning: alias of train_file"},
      {"max_len",
       &Args::max_length,
       {},
       {1, kLengthMax},
       "ChatGLM-Finetuning: alias of max_length"},
      {"max_src_len",
       &Args::max_source_length,
       {},
       {1, kLengthMax},
       "ChatGLM-Finetuning: source tokens kept (--mode layouts)"},
      {"is_skip",
       &Args::skip_truncated,
       {},
       -1e308,
       "ChatGLM-Finetuning: drop examples truncation cut"},
      {"mode",
       &Args::glm_prompt_layout,
       {"glm", "glm2", "glm3"},
       -1e308,
       "ChatGLM-Finetuning: data_set.py's layout of instruction records"},
      {"train_type",
       &Args::train_type,
       {"lora", "freeze", "ptuning", "all"},
       -1e308,
       "ChatGLM-Finetuning: the method (ptuning = P-Tuning v2 = prefix, all = full)"},
      {"ds_file", &Args::deepspeed, {}, -1e308, "ChatGLM-Finetuning: alias of deepspeed"},
      {"show_loss_step",
       &Args::logging_steps,
       {},
       {0, kStepsMax, Range::kOpenBelow},
       "ChatGLM-Finetuning: alias of logging_steps"},
      {"lora_dim", &Args::lora_r, {}, {1, kWidthMax}, "ChatGLM-Finetuning: alias of lora_r"},
      {"lora_module_name",
       &Args::lora_target_modules,
       {},
       -1e308,
       "ChatGLM-Finetuning: alias of lora_target_modules"},
      {"save_model_step",
       &Args::save_steps,
       {},
       {0, kStepsMax, Range::kOpenBelow},
       "ChatGLM-Finetuning: alias of save_steps"},
      {"warmup_min_lr_ratio",
       &Args::warmup_min_lr_ratio,
       {},
       {0, 1},
       "a DeepSpeed scheduler's auto warmup_min_lr as a fraction of learning_rate"},
  };
}

}  // namespace

const std::vector<Option>& options() {
  static const std::vector<Option> table = [] {
    std::vector<Option> all;
    for (auto group : {run_and_data, batches_and_optimization, logging_evaluation_saving,
                       fine_tuning_method, quantization, chatglm_finetuning}) {
      std::vector<Option> part = group();
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }();
  return table;
}

const Option* find_option(std::string_view name) {
  for (const Option& o : options()) {
    if (name == o.name) return &o;
  }
  return nullptr;
}

}  // namespace zt::config
