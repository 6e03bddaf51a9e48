// The TrainingArguments fields of transformers 4.40–5.x (and TRL SFTConfig's pad_token,
// padding_free, eos_token) that are not zerotrain options.
#include "config/hf_compat.hpp"

#include <cmath>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

namespace zt::config {
namespace {

using K = ValueKind;

// Sorted by name. Notes complete "NAME has no effect in zerotrain: ..." (or, for a refused
// value, "... zerotrain cannot honour it: ...").
const std::vector<ForeignOption>& table() {
  static const std::vector<ForeignOption> t = {
      {"accelerator_config", K::kValue, nullptr, "zerotrain does not use Accelerate"},
      {"adafactor", K::kFlag, "false",
       "Adafactor is not implemented; use optim adamw_torch or sgd"},
      {"auto_find_batch_size", K::kFlag, "false",
       "the batch size is fixed; choose per_device_train_batch_size yourself"},
      {"average_tokens_across_devices", K::kFlag, nullptr,
       "zerotrain always normalizes the loss by the tokens of the whole global batch (all ranks)"},
      {"batch_eval_metrics", K::kFlag, nullptr, "evaluation reports eval_loss only"},
      {"bf16_full_eval", K::kFlag, nullptr, "evaluation runs in the training precision"},
      {"dataloader_in_order", K::kFlag, nullptr,
       "there are no dataloader workers; batches come in the sampler's order"},
      {"dataloader_multiprocessing_context", K::kValue, nullptr, "there are no dataloader workers"},
      {"dataloader_num_workers", K::kValue, nullptr,
       "data is tokenized once into a cache and batches are collated in the training process"},
      {"dataloader_persistent_workers", K::kFlag, nullptr, "there are no dataloader workers"},
      {"dataloader_pin_memory", K::kFlag, nullptr,
       "batches are small token tensors copied directly"},
      {"dataloader_prefetch_factor", K::kValue, nullptr, "there are no dataloader workers"},
      {"ddp_backend", K::kValue, nullptr,
       "the backend follows the device: NCCL on GPUs, Gloo on CPUs"},
      {"ddp_broadcast_buffers", K::kFlag, nullptr,
       "zerotrain does not wrap the model in DistributedDataParallel"},
      {"ddp_bucket_cap_mb", K::kValue, nullptr,
       "buckets come from the DeepSpeed config's reduce_bucket_size"},
      {"ddp_find_unused_parameters", K::kFlag, nullptr,
       "parameters without a gradient are handled by the ZeRO engine itself"},
      {"ddp_static_graph", K::kFlag, nullptr,
       "zerotrain does not wrap the model in DistributedDataParallel"},
      {"debug", K::kList, nullptr, "no debug modes"},
      {"dispatch_batches", K::kFlag, nullptr, "every rank collates its own micro-batches"},
      {"do_predict", K::kFlag, nullptr, "there is no prediction step"},
      {"enable_jit_checkpoint", K::kFlag, nullptr,
       "zerotrain train saves a checkpoint on SIGTERM and SIGUSR1 before it stops (hosts call "
       "Trainer::preempt)"},
      {"eos_token", K::kValue, "none|",
       "TRL's eos_token: zerotrain ends text records and text completions with the tokenizer's "
       "own eos (tokenizer_config.json's eos_token); change it there"},
      {"eval_accumulation_steps", K::kValue, nullptr,
       "evaluation keeps only loss sums, never logits"},
      {"eval_do_concat_batches", K::kFlag, nullptr, "evaluation keeps only loss sums"},
      {"eval_use_gather_object", K::kFlag, nullptr, "evaluation keeps only loss sums"},
      {"fp16_backend", K::kValue, nullptr, "fp16 runs DeepSpeed's loss scaler"},
      {"fp16_full_eval", K::kFlag, nullptr, "evaluation runs in the training precision"},
      {"fp16_opt_level", K::kValue, nullptr, "there is no apex; fp16 runs DeepSpeed's loss scaler"},
      {"fsdp", K::kList, "|[]|none|false",
       "zerotrain shards with ZeRO; give a DeepSpeed config (--deepspeed) instead of FSDP"},
      {"fsdp_config", K::kValue, "none|{}|",
       "zerotrain shards with ZeRO; give a DeepSpeed config (--deepspeed) instead of FSDP"},
      {"fsdp_min_num_params", K::kValue, "0",
       "zerotrain shards with ZeRO; give a DeepSpeed config (--deepspeed) instead of FSDP"},
      {"fsdp_transformer_layer_cls_to_wrap", K::kValue, "none|",
       "zerotrain shards with ZeRO; give a DeepSpeed config (--deepspeed) instead of FSDP"},
      {"full_determinism", K::kFlag, nullptr,
       "runs are deterministic for a seed on the CPU; GPU kernels keep their own order"},
      {"gradient_checkpointing_kwargs", K::kValue, nullptr,
       "checkpointing is zerotrain's own (non-reentrant, per decoder layer)"},
      {"half_precision_backend", K::kValue, nullptr,
       "fp16/bf16 run DeepSpeed's mixed-precision scheme"},
      {"hub_always_push", K::kFlag, nullptr, "nothing is pushed to the Hub"},
      {"hub_model_id", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"hub_private_repo", K::kFlag, nullptr, "nothing is pushed to the Hub"},
      {"hub_revision", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"hub_strategy", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"hub_token", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"include_for_metrics", K::kList, nullptr, "evaluation reports eval_loss only"},
      {"include_inputs_for_metrics", K::kFlag, nullptr, "evaluation reports eval_loss only"},
      {"include_num_input_tokens_seen", K::kFlag, nullptr,
       "trainer_state.json always counts num_input_tokens_seen"},
      {"include_tokens_per_second", K::kFlag, nullptr, "every log record has tokens_per_second"},
      {"jit_mode_eval", K::kFlag, nullptr, "evaluation runs the training model"},
      {"label_names", K::kList, nullptr, "batches carry labels under the one name the model reads"},
      {"label_smoothing_factor", K::kValue, "0", "the loss is plain cross-entropy"},
      {"length_column_name", K::kValue, nullptr, "lengths come from the tokenized examples"},
      {"liger_kernel_config", K::kValue, nullptr,
       "zerotrain runs its own fused RMSNorm and AdamW kernels and a chunked loss"},
      {"log_level", K::kValue, nullptr, "rank 0 logs at info level through the log sink"},
      {"log_level_replica", K::kValue, nullptr, "ranks other than 0 log warnings and errors only"},
      {"log_on_each_node", K::kFlag, nullptr, "rank 0 logs for the job"},
      {"logging_nan_inf_filter", K::kFlag, nullptr,
       "logged losses are the steps' own, inf and nan included"},
      {"lr_scheduler_kwargs", K::kValue, "none|{}|", "the schedules take no extra arguments"},
      {"mp_parameters", K::kValue, nullptr, "there is no SageMaker model parallelism"},
      {"neftune_noise_alpha", K::kValue, "none|0", "NEFTune embedding noise is not implemented"},
      {"optim_args", K::kValue, "none|",
       "optimizer settings come from adam_* / weight_decay or the DeepSpeed config"},
      {"optim_target_modules", K::kList, "none|[]|",
       "the optimizer updates every trainable parameter"},
      {"pad_token", K::kValue, nullptr,
       "TRL's pad_token: padding is never trained nor attended to, so its id changes nothing; "
       "zerotrain pads with the tokenizer's pad token, else its eos"},
      {"padding_free", K::kFlag, nullptr,
       "TRL's padding_free: padding changes no loss (it is never trained nor attended to); "
       "packing (zerotrain's packing option) lays examples end to end, and on the GPU attention "
       "then runs over each document without padding"},
      {"parallelism_config", K::kValue, "none|{}|",
       "an empty one asks for nothing; its sp_size is sequence_parallel_size "
       "(docs/long_context.md)"},
      {"past_index", K::kValue, nullptr, "the decoders keep no past state in training"},
      {"prediction_loss_only", K::kFlag, nullptr, "evaluation reports eval_loss only"},
      {"project", K::kValue, nullptr,
       "metrics go to trainer_log.jsonl (and TensorBoard with report_to)"},
      {"push_to_hub", K::kFlag, "false",
       "nothing is pushed to the Hub; upload output_dir yourself"},
      {"push_to_hub_model_id", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"push_to_hub_organization", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"push_to_hub_token", K::kValue, nullptr, "nothing is pushed to the Hub"},
      {"ray_scope", K::kValue, nullptr, "there is no hyper-parameter search"},
      {"remove_unused_columns", K::kFlag, nullptr,
       "examples are tokenized into ids and labels only"},
      {"restore_callback_states_from_checkpoint", K::kFlag, nullptr,
       "there are no stateful callbacks"},
      {"save_on_each_node", K::kFlag, nullptr,
       "rank 0 writes the shared files; each rank writes its optimizer shard"},
      {"save_only_model", K::kFlag, nullptr,
       "checkpoints always hold the sharded optimizer state, so they resume"},
      {"save_safetensors", K::kFlag, nullptr,
       "everything is written as safetensors (never pickle)"},
      {"skip_memory_metrics", K::kFlag, nullptr, "peak GPU memory is logged on CUDA"},
      {"split_batches", K::kFlag, nullptr, "every rank collates its own micro-batches"},
      {"torch_compile", K::kFlag, nullptr,
       "zerotrain runs its own fused kernels without torch.compile"},
      {"torch_compile_backend", K::kValue, nullptr,
       "zerotrain runs its own fused kernels without torch.compile"},
      {"torch_compile_mode", K::kValue, nullptr,
       "zerotrain runs its own fused kernels without torch.compile"},
      {"torch_empty_cache_steps", K::kValue, nullptr,
       "the engine's buffers live for the whole run"},
      {"torchdynamo", K::kValue, nullptr,
       "zerotrain runs its own fused kernels without torch.compile"},
      {"tp_size", K::kValue, "0|1|none",
       "zerotrain has no tensor parallelism (ZeRO shards data-parallel ranks)"},
      {"tpu_metrics_debug", K::kFlag, nullptr, "there are no TPUs"},
      {"tpu_num_cores", K::kValue, nullptr, "there are no TPUs"},
      {"trackio_bucket_id", K::kValue, nullptr,
       "metrics go to trainer_log.jsonl (and TensorBoard with report_to)"},
      {"trackio_space_id", K::kValue, nullptr,
       "metrics go to trainer_log.jsonl (and TensorBoard with report_to)"},
      {"trackio_static_space_id", K::kValue, nullptr,
       "metrics go to trainer_log.jsonl (and TensorBoard with report_to)"},
      {"use_cache", K::kFlag, nullptr,
       "training keeps no key/value cache (prefix tuning feeds its prefix to every layer itself)"},
      {"use_ipex", K::kFlag, nullptr, "there is no IPEX"},
      {"use_legacy_prediction_loop", K::kFlag, nullptr, "there is no prediction loop"},
      {"use_liger_kernel", K::kFlag, nullptr,
       "zerotrain runs its own fused RMSNorm and AdamW kernels and a chunked loss"},
      {"use_mps_device", K::kFlag, "false", "there is no MPS device"},
  };
  return t;
}

// LLaMA-Factory's own arguments (its hparams: data, model and fine-tuning arguments) that its
// example configs carry and zerotrain has no use for. Sorted by name; notes as above.
const std::vector<ForeignOption>& llamafactory_table() {
  static const std::vector<ForeignOption> t = {
      {"buffer_size", K::kValue, nullptr, "datasets are read whole, never streamed"},
      {"eval_on_each_dataset", K::kFlag, "false",
       "the datasets of eval_dataset are evaluated together as one set"},
      {"ignore_pad_token_for_loss", K::kFlag, "true", "padding never counts in the loss"},
      {"interleave_probs", K::kValue, "none|",
       "datasets are concatenated in the order given (mix_strategy concat)"},
      {"mask_history", K::kFlag, "false", "every assistant reply of a conversation trains"},
      {"mix_strategy", K::kValue, "concat",
       "datasets are concatenated in the order given; interleaving is not implemented"},
      {"overwrite_cache", K::kFlag, nullptr,
       "the tokenized-data cache is keyed by the data's content, the tokenizer and the options, "
       "so it is never stale"},
      {"plot_loss", K::kFlag, nullptr, "output_dir/loss.svg is written at the end of every run"},
      {"preprocessing_batch_size", K::kValue, nullptr,
       "records are tokenized in batches of 8,192 on the host's worker threads"},
      {"preprocessing_num_workers", K::kValue, nullptr,
       "records are tokenized on the host's worker threads (ZT_CPU_THREADS)"},
      {"quantization_method", K::kValue, "bnb|bitsandbytes|none",
       "4-bit bases are bitsandbytes' NF4 / FP4 (quantization_bit 4); HQQ and EETQ are not "
       "implemented"},
      {"streaming", K::kFlag, "false", "datasets are read whole and tokenized into a cache"},
      {"tokenized_path", K::kValue, "none|",
       "tokenized data is cached under cache_dir, keyed by content; there is no separate "
       "preprocessing run"},
      {"trust_remote_code", K::kFlag, nullptr,
       "zerotrain runs no code from a model folder: its decoders are its own"},
  };
  return t;
}

}  // namespace

const ForeignOption* find_foreign_option(std::string_view name) {
  for (const auto* t : {&table(), &llamafactory_table()}) {
    for (const ForeignOption& o : *t) {
      if (name == o.name) return &o;
    }
  }
  return nullptr;
}

std::string canonical_value(std::string_view text) {
  const std::string s(text);
  if (s == "True" || s == "true" || s == "TRUE" || s == "yes") return "true";
  if (s == "False" || s == "false" || s == "FALSE" || s == "no") return "false";
  if (s == "None" || s == "none" || s == "null") return "none";
  if (s == "[]" || s == "{}") return s;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d)) return fmt::format("{:g}", d);
  return s;
}

bool is_neutral(const ForeignOption& option, const std::string& canonical) {
  if (option.neutral == nullptr) return true;
  std::string_view list(option.neutral);
  while (true) {
    const size_t bar = list.find('|');
    if (list.substr(0, bar) == canonical) return true;
    if (bar == std::string_view::npos) return false;
    list.remove_prefix(bar + 1);
  }
}

}  // namespace zt::config
