// The Trainer's set-up: arguments, the output folder and its lock, data, batches and steps,
// the model with its method and engine, resuming. The other parts: checkpointing.cpp,
// host_batches.cpp, loop.cpp (trainer_impl.hpp holds the state they share).
#include "zerotrain/trainer.hpp"

#include <torch/cuda.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "config/quantization.hpp"
#include "data/record_layouts.hpp"
#include "data/stats.hpp"
#include "model/blocks.hpp"
#include "model/families/moe.hpp"
#include "model/moe.hpp"
#include "model/quantized_weights.hpp"
#include "peft/init_sources.hpp"
#include "peft/pissa.hpp"
#include "train/objective.hpp"
#include "train/reporting.hpp"
#include "train/resume_check.hpp"
#include "train/tensorboard.hpp"
#include "train/trainer_impl.hpp"
#include "util/capacity.hpp"
#include "util/device_stats.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "util/log_scope.hpp"
#include "util/rng.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/schedule.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {

using comm::on_every_rank;
namespace fs = std::filesystem;

std::shared_ptr<Communicator> join_training_job(const TrainingArguments& args) {
  return join_training_job(args, launch_env_from_environment());
}

std::shared_ptr<Communicator> join_training_job(const TrainingArguments& args,
                                                const LaunchEnv& env) {
  CommOptions options;
  const bool cuda_present = torch::cuda::is_available();
  if (args.device == "cuda" && !cuda_present) {
    throw ConfigError(
        "device cuda: no CUDA device is usable here (no GPU, or a CPU-only LibTorch); use "
        "--device cpu");
  }
  if (args.device == "cuda" || (args.device == "auto" && cuda_present)) {
    const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
    if (env.local_rank >= gpus) {
      throw ConfigError(
          fmt::format("local rank {} needs GPU {}, but this machine shows {} GPU(s); start at "
                      "most {} ranks per machine (--nproc_per_node)",
                      env.local_rank, env.local_rank, gpus, gpus));
    }
    options.device = at::Device(at::kCUDA, static_cast<at::DeviceIndex>(env.local_rank));
  }
  options.timeout = std::chrono::seconds(args.ddp_timeout);
  options.rendezvous_timeout = std::chrono::seconds(args.rendezvous_timeout);
  return std::shared_ptr<Communicator>(create_communicator(env, options));
}

namespace {

// The chat template kwargs the options give: chat_template_kwargs (a JSON object) with
// LLaMA-Factory's enable_thinking set in it; "" when neither is given.
std::string template_kwargs(const TrainingArguments& args) {
  if (args.chat_template_kwargs.empty() && !args.enable_thinking) return "";
  rapidjson::Document doc(rapidjson::kObjectType);
  if (!args.chat_template_kwargs.empty()) {
    doc = json::parse(args.chat_template_kwargs, "chat_template_kwargs");
    if (!doc.IsObject()) {
      throw ConfigError(fmt::format(
          "chat_template_kwargs: expected a JSON object (such as {{\"enable_thinking\": false}}), "
          "found {}",
          args.chat_template_kwargs));
    }
  }
  if (args.enable_thinking) {
    doc.RemoveMember("enable_thinking");
    doc.AddMember("enable_thinking", *args.enable_thinking, doc.GetAllocator());
  }
  return json::dump(doc);
}

}  // namespace

void Trainer::Impl::load_data() {
  if (objective->load_own_data()) return;
  DatasetStats train_stats, eval_stats;
  DataOptions options = data_options_for(args);
  options.token_id_limit = model_config.vocab_size;  // pre-tokenized ids index the embedding
  const std::string cache_dir =
      args.cache_dir.empty() ? args.output_dir + "/.cache" : args.cache_dir;
  auto load = [&](const std::string& path, Dataset& into, const char* what) {
    DatasetStats& stats = what == std::string("training") ? train_stats : eval_stats;
    // Rank 0 tokenizes (or finds the cache), a phase that stops on request with its progress
    // in the file's bytes; the others read what it wrote.
    const std::string phase = fmt::format("tokenizing {} data '{}'", what, path);
    std::error_code size_error;
    const uintmax_t bytes = fs::file_size(path, size_error);
    train::PhaseMeter meter =
        phase_meter(phase, "MiB", size_error ? 0.0 : static_cast<double>(bytes), 1 << 20);
    DataOptions tokenizing = options;
    tokenizing.on_progress = [&](const TokenizeProgress& p) {
      meter.update(static_cast<double>(p.bytes));
      poll_stop();
    };
    run_phase(phase, rank == 0 ? &meter : nullptr, [&] {
      if (rank != 0) return;
      poll_stop();
      into = load_or_tokenize(path, *tokenizer, tokenizing, cache_dir, &stats);
    });
    meter.finish();
    on_every_rank(*comm, fmt::format("reading the tokenized {} data", what), [&] {
      if (rank != 0)
        into = load_dataset(dataset_cache_path(cache_dir, path, *tokenizer, options), &stats,
                            options.token_id_limit);
    });
    if (rank == 0) {
      // Counted in the data's own units, each drop under its cause.
      log::info(
          "{} data '{}': {}{}{}", what, path, data::kept_summary(stats, options),
          stats.skipped_lines ? fmt::format(", {} bad lines skipped", stats.skipped_lines) : "",
          stats.dropped_examples
              ? fmt::format("; {} dropped: {}", data::dropped_count(stats, options),
                            data::drop_causes(stats, options))
              : "");
    }
  };
  if (!args.train_file.empty()) {
    load(args.train_file, train_data, "training");
    has_train = true;
    // Every rank read the stats (from rank 0's cache).
    templated_rows = train_stats.templated_examples;
    train_rows = train_stats.examples;
    train_samples = objective->samples_of(train_data, args.train_file);
    objective->index_training_data();
  }
  if (!args.eval_file.empty()) {
    load(args.eval_file, eval_data, "evaluation");
    has_eval = true;
    eval_samples = objective->samples_of(eval_data, args.eval_file);
  }
}

void Trainer::Impl::plan_batches() {
  ResolveContext context{data_world, model_config.hidden_size, std::nullopt};
  if (run_dir.resume) {
    const train::TrainerState saved = train::read_trainer_state(*run_dir.resume);
    context.resumed = SavedBatch{saved.global_batch_size, saved.world_size};
  }
  {
    // Every rank resolves the same configs; rank 0 says what it decided.
    std::optional<log::ThreadLogFloor> quiet;
    if (rank != 0) quiet.emplace(LogLevel::kError);
    resolve_config(ds, args, context);
  }
  // The data's ranks: with sequence parallelism every group shares its batches.
  batch =
      GlobalBatch{args.per_device_train_batch_size, args.gradient_accumulation_steps, data_world};
  objective->check_global_batch();
  if (has_train) {
    steps_per_epoch = objective->steps_per_epoch(args.dataloader_drop_last);
    if (steps_per_epoch == 0) {
      throw ConfigError(
          fmt::format("'{}' has {} {}, fewer than one global batch of {} (micro batch {} × "
                      "accumulation {} × {} ranks) with dataloader_drop_last; use a smaller batch",
                      args.train_file, train_samples, sample_name(), batch.size(),
                      batch.micro_batch, batch.accumulation, data_world));
    }
    if (rank == 0 && train_samples > 0 && batch.size() > static_cast<int64_t>(2 * train_samples)) {
      log::warn(
          "one optimizer step takes {} {} (micro batch {} × accumulation {} × {} ranks), "
          "more than twice the {} of '{}': each step repeats them about {} times; lower "
          "gradient_accumulation_steps or per_device_train_batch_size",
          batch.size(), sample_name(), batch.micro_batch, batch.accumulation, data_world,
          train_samples, args.train_file, batch.size() / static_cast<int64_t>(train_samples));
    }
    total_steps = args.max_steps > 0
                      ? args.max_steps
                      : static_cast<int64_t>(std::ceil(args.num_train_epochs *
                                                       static_cast<double>(steps_per_epoch)));
    if (total_steps <= 0)
      throw ConfigError("num_train_epochs and max_steps leave no step to train");
  } else if (args.max_steps > 0) {
    total_steps = args.max_steps;  // a host that brings its own batches (train_step)
  }
  resolve_config(
      ds, args,
      ResolveContext{data_world, model_config.hidden_size,
                     total_steps > 0 ? std::optional<int64_t>(total_steps) : std::nullopt});
  check_resolved(ds);
  // HF's Trainer: a step interval below 1 is a fraction of the run, ceil(max_steps · ratio).
  const double log_given = args.logging_steps,
               eval_given = args.eval_steps.value_or(args.logging_steps);
  const bool fraction = log_given < 1 || eval_given < 1 || args.save_steps < 1 ||
                        (args.warmup_steps > 0 && args.warmup_steps < 1);
  if (total_steps == 0 && fraction) {
    throw ConfigError(
        "a step interval below 1 (a fraction of the run in logging_steps, eval_steps, save_steps "
        "or "
        "warmup_steps) needs the run's length: give train_file or max_steps");
  }
  log_every = steps_for(log_given, total_steps);
  eval_every = steps_for(eval_given, total_steps);
  save_every = steps_for(args.save_steps, total_steps);
  data_seed = static_cast<uint64_t>(args.data_seed.value_or(args.seed));
}

void Trainer::Impl::check_options() {
  // What the options decide alone, said before any data is read or tokenized. The precision
  // is not resolved yet: a DeepSpeed value left out or "auto" follows the arguments, as
  // resolve_precision decides it later.
  const auto enabled = [](const Auto<bool>& written, bool argument) {
    return written.is_set() ? written.value() : argument;
  };
  const bool fp16 = enabled(ds.fp16.enabled, args.fp16) && comm->device().is_cuda();
  const at::ScalarType compute = enabled(ds.bf16.enabled, args.bf16) ? at::kBFloat16
                                 : fp16                              ? at::kHalf
                                                                     : at::kFloat;
  config::quantization_of(args, compute);
  const std::optional<QuantizationConfig> saved = model::saved_quantization(model_config);
  if (saved) config::saved_quantization_for(args, *saved, model_dir);
  const PeftConfig method = peft_config_for(args);
  if (peft::pissa_iterations(method.lora.init_lora_weights) &&
      method.type == FinetuningType::kLora) {
    if (!args.adapter_name_or_path.empty()) {
      throw ConfigError(fmt::format(
          "pissa_init: decomposes the base for a new adapter, but adapter_name_or_path '{}' "
          "continues one; drop pissa_init to continue it",
          args.adapter_name_or_path));
    }
    if (saved) {
      throw ConfigError(fmt::format(
          "pissa_init: '{}' holds 4-bit weights, and PiSSA decomposes full-precision ones; "
          "start from the full-precision model (zerotrain quantizes the residual itself with "
          "--quantization_bit 4)",
          model_dir));
    }
  }
  check_sequence_parallel();
  // The stage's own checks (its loss's options; what it does not run with yet).
  objective = train::make_objective(*this);
}

void Trainer::Impl::check_sequence_parallel() {
  int64_t size = args.sequence_parallel_size;
  if (ds.sequence_parallel_size > 1) {
    if (size > 1 && size != ds.sequence_parallel_size) {
      throw ConfigError(fmt::format(
          "{}: sequence_parallel_size {} and the argument sequence_parallel_size {} differ; give "
          "one of them",
          ds.source, ds.sequence_parallel_size, size));
    }
    size = ds.sequence_parallel_size;
  }
  sequence_parallel = size;
  data_world = world;
  data_rank = rank;
  if (size == 1) return;
  const auto refuse = [&](const std::string& why) {
    throw ConfigError(fmt::format("sequence_parallel_size {}: {}", size, why));
  };
  if (world % size != 0) {
    refuse(fmt::format("it does not divide the {} ranks of this job; give a divisor of {}", world,
                       world));
  }
  const ModelConfig& c = model_config;
  if (c.num_attention_heads % size != 0) {
    refuse(
        fmt::format("it does not divide the model's {} attention heads (num_attention_heads), "
                    "which the ranks of a group share; give a divisor of {}",
                    c.num_attention_heads, c.num_attention_heads));
  }
  if (c.num_key_value_heads % size != 0 && size % c.num_key_value_heads != 0) {
    refuse(
        fmt::format("the model's {} key/value heads (num_key_value_heads) and the degree must "
                    "divide one another",
                    c.num_key_value_heads));
  }
  if (args.stage == "grpo") {
    refuse(
        "stage grpo does not train with sequence parallelism yet (sft, pt, dpo and kto do): its "
        "generation runs whole on each rank; use sequence_parallel_size 1");
  }
  const PeftConfig method = peft_config_for(args);
  if (method.type == FinetuningType::kPTuning || method.type == FinetuningType::kPrefix) {
    refuse(
        fmt::format("finetuning_type {} adds virtual tokens or prefixes to every sequence, "
                    "which sequence parallelism does not split; use lora, freeze or full",
                    args.finetuning_type));
  }
  if (args.expert_parallel_size > 1) {
    refuse(
        "expert parallelism (expert_parallel_size > 1) and sequence parallelism do not "
        "combine yet; give one of them");
  }
  if (model::decoder_spec(c).router_aux_coef) {
    refuse(
        "a mixture of experts' load-balancing loss (output_router_logits, moe_aux_loss_coef) "
        "is one over the whole batch's tokens, which no rank holds; train without it");
  }
  data_world = static_cast<int>(world / size);
  data_rank = static_cast<int>(rank / size);
}

void Trainer::Impl::check_machine_fits() const {
  // Lower bounds, said before a byte is allocated: anything above the machine's whole memory is
  // a config's mistake (or a corrupt file). The weights each rank holds in the compute dtype
  // (ZeRO-3 divides them), then one micro-batch's hidden states at each layer's boundary.
  const ModelConfig& c = model_config;
  const double params = static_cast<double>(c.parameter_count());
  const double element = ds.bf16.enabled.value() || ds.fp16.enabled.value() ? 2.0 : 4.0;
  const double per_rank =
      params * element / (ds.zero.stage == 3 ? static_cast<double>(world) : 1.0);
  const at::Device device = comm->device();
  const int cuda = device.is_cuda() ? (device.has_index() ? device.index() : 0) : -1;
  capacity::check_fits(
      per_rank, cuda,
      fmt::format("{}: a model of {:.3g} parameters (vocab_size {}, hidden_size {}, "
                  "intermediate_size {}, num_hidden_layers {}) per rank for its weights alone",
                  c.source, params, c.vocab_size, c.hidden_size, c.intermediate_size,
                  c.num_hidden_layers),
      "check the config's sizes");
  const bool eval_wider =
      args.per_device_eval_batch_size > args.per_device_train_batch_size && !args.eval_file.empty();
  const int64_t rows =
      eval_wider ? args.per_device_eval_batch_size : args.per_device_train_batch_size;
  // With sequence parallelism a rank holds 1/size of each sequence's positions.
  const double tokens = static_cast<double>(rows) * static_cast<double>(args.max_length) /
                        static_cast<double>(sequence_parallel);
  capacity::check_fits(
      tokens * static_cast<double>(c.hidden_size) * element *
          static_cast<double>(c.num_hidden_layers),
      cuda,
      fmt::format("a micro-batch of per_device_{}_batch_size {} × max_length {} tokens",
                  eval_wider ? "eval" : "train", rows, args.max_length),
      "lower the batch size (raise gradient_accumulation_steps to keep the global batch) or "
      "max_length");
}

namespace {

// Expert parallelism's share for this rank (expert_parallel_size), checked against the world;
// decoder_spec checks it against the experts.
ModelConfig::ExpertShard expert_shard_for(const TrainingArguments& args, int rank, int world) {
  ModelConfig::ExpertShard shard;
  const int64_t size = args.expert_parallel_size;
  if (size == 1) return shard;
  if (world % size != 0) {
    throw ConfigError(fmt::format(
        "expert_parallel_size {} does not divide the {} ranks of this job; give a divisor of {}",
        size, world, world));
  }
  shard.size = size;
  shard.rank = rank % size;
  return shard;
}

// How an expert-parallel job's experts split (EngineOptions::local_split): rank r holds block
// r mod size of every expert tensor; its group — the ranks whose blocks make the whole — is the
// `size` ranks from r − (r mod size), and its peers — the ranks holding the same block — are
// every size-th rank from r mod size, over whom the experts' gradients are summed.
EngineOptions::LocalSplit expert_split(const ModelConfig::ExpertShard& shard, int rank, int world) {
  EngineOptions::LocalSplit split;
  split.blocks = shard.size;
  split.index = shard.rank;
  for (int64_t j = 0; j < shard.size; ++j) {
    split.holders.push_back(static_cast<int>(rank - shard.rank + j));
  }
  for (int q = static_cast<int>(shard.rank); q < world; q += static_cast<int>(shard.size)) {
    split.peers.push_back(q);
  }
  return split;
}

// Expert parallelism trains the experts' own tensors (full and freeze fine-tuning), not adapters
// on them: an adapter's factors over a rank's experts are not one block of the whole factor
// (PEFT's lora_B holds every expert's columns interleaved), so they would not save as PEFT's.
void check_expert_training(CausalLM& model, const TrainingArguments& args) {
  for (const auto& item : model.named_parameters(true)) {
    if (item.value().requires_grad() && item.key().find(".experts.") != std::string::npos &&
        !model::is_expert_tensor(item.key())) {
      throw ConfigError(fmt::format(
          "expert_parallel_size {}: '{}' is an adapter on the experts, which expert parallelism "
          "does not train (it trains the experts themselves under full or freeze fine-tuning, "
          "and adapters beside them: attention, routers, dense layers, shared experts); drop the "
          "experts from lora_target / lora_target_parameters, or set expert_parallel_size 1",
          args.expert_parallel_size, item.key()));
    }
  }
}

// The counts a run states are the whole model's: under expert parallelism the other ranks'
// experts (as many as this rank's, trained or frozen as its own are) are added to this rank's.
void add_other_ranks_experts(CausalLM& model, int64_t shard_size, ParameterCount& counts) {
  const auto quantized = model::quantized_weights(model);
  for (const auto& item : model.named_parameters(true)) {
    if (!model::is_expert_tensor(item.key())) continue;
    const auto four_bit = quantized.find(item.key());
    const int64_t values =
        (four_bit == quantized.end() ? item.value().numel() : four_bit->second->numel()) *
        (shard_size - 1);
    counts.all += values;
    if (item.value().requires_grad()) counts.trainable += values;
  }
}

}  // namespace

void Trainer::Impl::build_model_and_engine() {
  std::shared_ptr<ParameterSource> base;
  bool prequantized = false;  // the folder holds bitsandbytes' 4-bit weights
  on_every_rank(*comm, "building the model", [&] {
    // The dtype the engine computes in (fp16 on a CPU computes in fp32).
    const bool fp16 = ds.fp16.enabled.value() && comm->device().is_cuda();
    const at::ScalarType compute = ds.bf16.enabled.value() ? at::kBFloat16
                                   : fp16                  ? at::kHalf
                                                           : at::kFloat;
    model_config.quantization = config::quantization_of(args, compute);
    if (const std::optional<QuantizationConfig> saved = model::saved_quantization(model_config)) {
      model_config.quantization = config::saved_quantization_for(args, *saved, model_dir);
      prequantized = true;
    }
    model_config.expert_shard = expert_shard_for(args, rank, world);
    model = std::make_shared<CausalLM>(model_config, at::TensorOptions(), /*allocate=*/false);
    if (!model_dir.empty()) check_checkpoint(*model, model_dir);  // before adapters join the model
    peft = peft_config_for(args);
    peft.base_model_name_or_path = args.model_name_or_path;
    adapter_method = peft.type == FinetuningType::kLora || peft.type == FinetuningType::kPTuning ||
                     peft.type == FinetuningType::kPrefix;
    parameters = apply_peft_from_args(*model, args, static_cast<uint64_t>(args.seed));
    if (model_config.expert_shard.size > 1) {
      check_expert_training(*model, args);
      add_other_ranks_experts(*model, model_config.expert_shard.size, parameters);
    }
    non_embedding_parameters = parameters.all - model_config.vocab_size * model_config.hidden_size;
    // Under expert parallelism each rank reads its share of the experts (below quantization).
    const ModelConfig::ExpertShard shard = model_config.expert_shard;
    if (prequantized) {
      base =
          model::prequantized_source(model_dir, model::quantized_weights(*model),
                                     [shard](std::shared_ptr<ParameterSource> dense) {
                                       return model::expert_shard_source(std::move(dense), shard);
                                     });
    } else if (!model_dir.empty()) {
      base = model::expert_shard_source(checkpoint_source(model_dir), shard);
    } else {
      base = model::expert_shard_source(
          random_source(model_config, static_cast<uint64_t>(args.seed)), shard);
    }
    if (shard.size > 1) model->set_expert_communicator(comm);
    if (sequence_parallel > 1) model->set_sequence_parallel(comm, sequence_parallel);
    // tiled_mlp_num_shards alone asks for tiles too.
    if (args.tiled_mlp || args.tiled_mlp_num_shards) {
      model->set_tiled_mlp(true, args.tiled_mlp_num_shards.value_or(0));
    }
  });
  // Collective from here: every rank builds its engine (and reads its slices of the weights).
  EngineOptions eo;
  eo.device = comm->device();
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.activation_checkpointing = args.gradient_checkpointing;
  static_assert(EngineOptions::kAutoKeep == -1, "recompute_keep_bytes_for's auto");
  eo.recompute_keep_bytes = recompute_keep_bytes_for(args);
  eo.offload_activations = args.use_unsloth_gc;
  eo.units_per_checkpoint = args.recompute_num_layers;
  eo.update_in_backward = args.update_in_backward;
  try {  // the launcher's ranks per node (MPI's and Slurm's too) for qgZ's two hops
    eo.ranks_per_node = launch_env_from_environment().local_world_size;
  } catch (const ConfigError&) {
    // A host's own communicator beside malformed launcher variables: the engine reads
    // LOCAL_WORLD_SIZE itself.
  }
  eo.total_train_steps = total_steps;  // 0 when unknown: schedules that need it say so
  eo.learning_rate = learning_rate_schedule(ds, args, total_steps);
  // A new adapter's starts that depend on the base: PiSSA's under the quantization (the residual
  // is what gets quantized), DoRA's magnitudes over it (the norms of the weights trained over).
  const bool new_adapter = peft.type == FinetuningType::kLora && args.adapter_name_or_path.empty();
  if (new_adapter) {
    base = peft::pissa_source(base, *model, peft.lora, static_cast<uint64_t>(args.seed),
                              comm->device(), /*factors=*/true);
  }
  if (auto quantized = model::quantized_weights(*model); !quantized.empty() && !prequantized) {
    base = model::quantizing_source(*base, std::move(quantized), base);
  }
  if (new_adapter) base = peft::dora_source(base, *model, peft.lora);
  eo.source = with_adapter_values(base, *model);
  // Each rank's experts are its own: read by each, kept whole by each (ZeRO-3 too), trained
  // with their gradients summed over the ranks holding the same experts.
  if (model_config.expert_shard.size > 1) {
    eo.rank_local = model::is_expert_tensor;
    eo.local_split = expert_split(model_config.expert_shard, rank, world);
  }
  build_engine(eo, /*quantizing=*/!prequantized && !model::quantized_weights(*model).empty());
  const bool continued = !args.adapter_name_or_path.empty();
  const bool starts_as_base = adapter_method && adapter_starts_as_base(peft, continued);
  // The reference: the model as it starts. A new LoRA or DoRA adapter starts as the base (B is
  // zero), so the model with its adapters off is it, at any step. Every other start — PiSSA's
  // factors over the residual, a continued adapter, a prompt encoder's first table, full and
  // freeze fine-tuning without a precomputed table — is a frozen copy of the trainable weights
  // as they start, sharded as the policy is and swapped in for each reference forward.
  const bool precomputed = objective->precomputes_reference(adapter_method);
  if (objective->uses_reference() && (adapter_method ? !starts_as_base : !precomputed)) {
    std::unique_ptr<ParameterSnapshot>& reference_weights = objective->reference_weights;
    reference_weights = std::make_unique<ParameterSnapshot>(engine->parameter_snapshot(*eo.source));
    if (rank == 0) {
      log::info(
          "reference: a frozen copy of the trainable weights as they start ({}), {:.2f} GiB on "
          "rank 0 (ZeRO stage {}), swapped in for each reference forward",
          adapter_method ? adapter_start_description(peft, continued) : "the whole model",
          static_cast<double>(reference_weights->bytes()) / (1 << 30), engine->stage());
    }
  }
}

void Trainer::Impl::build_engine(EngineOptions eo, bool quantizing) {
  // Each rank reads (and quantizes) its own slices without a collective: a stop seen at one
  // weight ends this rank's build there, and run_phase's agreement every rank's.
  const std::string phase =
      quantizing ? "loading and quantizing the weights" : "loading the weights";
  train::PhaseMeter meter = phase_meter(phase, "M values", 0.0, 1e6);
  eo.on_load_progress = [&](int64_t done, int64_t total) {
    meter.set_total(static_cast<double>(total));
    meter.update(static_cast<double>(done));
    poll_stop();
  };
  run_phase(phase, &meter, [&] {
    poll_stop();
    engine = std::make_unique<Engine>(model, ds, comm, std::move(eo));
  });
  meter.finish();
}

void Trainer::Impl::restore(const std::string& dir) {
  train::TrainerState saved = train::read_trainer_state(dir);
  if (const std::string engine_save = checkpoint_save_id(dir);
      !saved.save_id.empty() && saved.save_id != engine_save) {
    throw IoError(fmt::format(
        "checkpoint '{}': zerotrain_state.json belongs to save {} but layout.json to save {}: "
        "the checkpoint mixes pieces of different saves; resume from an intact checkpoint",
        dir, saved.save_id, engine_save.empty() ? "none" : engine_save));
  }
  load_engine_state(*engine, dir);
  read_rng_state(dir);
  objective->read_state(dir);
  // The history up to the checkpoint's step, without a final summary (a checkpoint written
  // after it): this run logs its own. Its last evaluation is not repeated at that step.
  state.log_history = saved.log_history;
  state.log_history.erase(
      std::remove_if(state.log_history.begin(), state.log_history.end(),
                     [](const LogRecord& r) { return r.train_loss.has_value(); }),
      state.log_history.end());
  for (const LogRecord& r : state.log_history) {
    if (r.eval_loss) last_eval = {r.eval_loss, r.step};
  }
  state.train_loss_sum = saved.train_loss_sum;
  state.train_loss_steps = saved.train_loss_steps;
  open_window.reset();
  state.best_metric = saved.best_metric;
  state.best_model_checkpoint = saved.best_model_checkpoint;
  state.best_global_step = saved.best_global_step;
  state.total_flos = saved.total_flos;
  state.tokens_seen = saved.tokens_seen;
  if (!saved.run_id.empty()) state.run_id = saved.run_id;
  state.global_step = engine->global_step();
  // The data position by samples consumed: the same step of the epoch when the global batch is
  // kept, the nearest earlier one otherwise.
  state.epoch_index = saved.epoch_index;
  state.steps_in_epoch =
      args.ignore_data_skip ? 0 : saved.steps_in_epoch * saved.global_batch_size / batch.size();
  if (state.steps_in_epoch >= steps_per_epoch) {
    ++state.epoch_index;
    state.steps_in_epoch = 0;
  }
  state.epoch = epoch_progress();
  if (saved.data_seed != static_cast<int64_t>(data_seed) && rank == 0) {
    log::warn(
        "resuming with data_seed {} but the checkpoint was made with {}: the data order changes",
        data_seed, saved.data_seed);
  }
  if (rank == 0) {
    log::info("resumed from '{}' at step {} (epoch {}, step {} of it)", dir, state.global_step,
              state.epoch_index, state.steps_in_epoch);
  }
}

void Trainer::Impl::announce() const {
  if (rank != 0) return;
  const char* precision = ds.bf16.enabled.value()   ? "bf16"
                          : ds.fp16.enabled.value() ? "fp16"
                                                    : "fp32";
  log::info("***** Running training *****");
  log::info("  world size = {} ({}), ZeRO stage {}, {}{}{}", world, comm->device().str(),
            ds.zero.stage, precision,
            ds.zero.offload_optimizer.device != OffloadDevice::kNone ? ", optimizer offloaded" : "",
            args.gradient_checkpointing ? ", gradient checkpointing" : "");
  if (sequence_parallel > 1) {
    log::info(
        "  sequence parallelism: groups of {} ranks share each sequence ({} data-parallel "
        "group{})",
        sequence_parallel, data_world, data_world == 1 ? "" : "s");
  }
  // HF's header: with max_steps the epochs follow from the steps.
  log::info("  num {} = {}, num epochs = {}", sample_name(), train_samples,
            args.max_steps > 0
                ? fmt::format("{:.2f} (from max_steps {})",
                              static_cast<double>(total_steps) /
                                  static_cast<double>(std::max<int64_t>(1, steps_per_epoch)),
                              args.max_steps)
                : fmt::format("{:g}", args.num_train_epochs));
  log::info("  batch size per device = {}, gradient accumulation steps = {}, total batch size = {}",
            batch.micro_batch, batch.accumulation, batch.size());
  log::info("  total optimization steps = {} ({} per epoch)", total_steps, steps_per_epoch);
  log::info("  fine-tuning: {} — {}",
            describe_method(peft, model_config.quantization,
                            /*continued=*/!args.adapter_name_or_path.empty()),
            parameters.line());
  if (train_rows > 0 && templated_rows == 0) {
    log::info(
        "  template: none applied: every training record is plain text or token ids (template "
        "{} formats messages and instructions only); `zerotrain verify` sends prompts as they "
        "are",
        args.template_name);
  } else if (templated_rows < train_rows) {
    log::info(
        "  template: {} ({}), applied to {} of the {} training sequences; the others are "
        "plain text or token ids",
        args.template_name, template_source, templated_rows, train_rows);
  } else {
    log::info("  template: {} ({})", args.template_name, template_source);
  }
}

Trainer::Trainer(TrainingArguments args, std::shared_ptr<Communicator> comm,
                 TrainerCallbacks callbacks)
    : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.args = std::move(args);
  I.comm = std::move(comm);
  I.callbacks = std::move(callbacks);
  if (!I.callbacks.stop) I.callbacks.stop = std::make_shared<StopRequest>();
  I.requests.asked = I.callbacks.stop;
  check_training_arguments(I.args);
  I.rank = I.comm->rank();
  I.world = I.comm->world_size();
  if (I.rank == 0) {
    for (const auto& [name, line] : I.args.ignored) log::warn("{}", line);
  }
  if (I.args.tf32) compat::set_allow_tf32(*I.args.tf32);
  try {
    I.start();
  } catch (...) {
    // A run that never started leaves nothing behind: no lock file, no folder it created.
    I.abandon_output_dir();
    throw;
  }
}

void Trainer::Impl::start() {
  Impl& I = *this;
  on_every_rank(*I.comm, "checking the arguments, output_dir and model", [&] {
    I.check_output_dir();
    if (I.rank == 0) I.lock_output_dir();
    // LLaMA-Factory's datasets (dataset, val_size, ...) become the JSONL files train_file and
    // eval_file name: every rank reads them the same way, rank 0 writes them (into the cache
    // folder the others read the tokenized data from).
    for (const std::string& line : prepare_datasets(I.args, /*write=*/I.rank == 0)) {
      if (I.rank == 0) log::info("{}", line);
    }
    I.ds = deepspeed_config_for(I.args);
    if (!I.args.model_name_or_path.empty()) {
      I.model_dir = I.args.model_name_or_path;
      I.model_config = load_model_config(I.model_dir);
    } else if (!I.args.model_config.empty()) {
      const std::string& c = I.args.model_config;
      I.model_config =
          c.front() == '{' ? parse_model_config(c, "model_config") : load_model_config(c);
    } else {
      throw ConfigError(
          "no model: give --model_name_or_path DIR (an HF model folder) or --model_config "
          "(a config.json path or inline JSON, for random weights)");
    }
    if (I.args.moe_aux_loss_coef.value_or(0.0) > 0.0 &&
        !model::moe::set_router_aux(I.model_config, *I.args.moe_aux_loss_coef) && I.rank == 0) {
      // LLaMA-Factory passes it on only to the mixtures it knows, silently; said here.
      log::warn(
          "moe_aux_loss_coef: model_type {} has no load-balancing loss (no mixture of "
          "experts, or one balanced otherwise, as GLM-4.5's); the option does nothing",
          I.model_config.model_type);
    }
    {
      // Every rank reads the same tokenizer files: what loading them warns about is said once,
      // by rank 0 (errors still come from every rank; other threads are not quieted).
      std::optional<log::ThreadLogFloor> quiet;
      if (I.rank != 0) quiet.emplace(LogLevel::kError);
      I.tokenizer = load_tokenizer(I.model_dir, I.model_config.vocab_size);
    }
    // A family's record layout (`mode`) lays out instruction records itself; the template is
    // then that layout's prompt (what `zerotrain verify` asks with, and chat records' format).
    if (const std::string layout = data::record_layout_template(I.args.glm_prompt_layout);
        !layout.empty() && !I.args.is_given("template")) {
      I.args.template_name = layout;
    }
    I.args.template_name =
        resolve_template(I.args.template_name, I.model_dir, *I.tokenizer, &I.template_source,
                         template_kwargs(I.args),
                         I.args.enable_thinking ? "enable_thinking" : "chat_template_kwargs");
    // A resumed run keeps what its checkpoint's model and data are: a recorded option not
    // given is taken from the checkpoint, one given otherwise is refused (resume_check.hpp).
    if (I.run_dir.resume) {
      for (const std::string& line : train::reconcile_resumed_arguments(
               I.args, *I.run_dir.resume, train::ResumeDifferences::kTakeRecorded)) {
        if (I.rank == 0) log::info("{}", line);
      }
    }
    I.pad_id =
        I.tokenizer->pad_id() >= 0 ? I.tokenizer->pad_id() : std::max(0, I.tokenizer->eos_id());
    I.check_options();
  });
  I.load_data();
  on_every_rank(*I.comm, "planning batches and steps", [&] {
    I.plan_batches();
    I.check_machine_fits();
  });
  I.build_model_and_engine();
  I.state.world_size = I.world;
  I.state.finetuning_type = I.args.finetuning_type;
  I.state.max_steps = I.total_steps;
  I.state.logging_steps = I.log_every;
  I.state.eval_steps = I.eval_every;
  I.state.save_steps = I.save_every;
  I.state.train_batch_size = I.batch.micro_batch;
  I.state.num_train_epochs = I.args.num_train_epochs;
  I.state.global_batch_size = I.batch.size();
  I.state.gradient_accumulation_steps = I.batch.accumulation;
  I.state.data_seed = static_cast<int64_t>(I.data_seed);
  I.state.run_id = train::new_run_id();  // a resumed run takes its checkpoint's (restore)
  // HF's set_seed: the random stream dropout draws from starts at `seed` (a resumed run then
  // continues the saved stream instead).
  at::manual_seed(static_cast<uint64_t>(I.args.seed));
  if (I.run_dir.resume) I.restore(*I.run_dir.resume);
}

Trainer::~Trainer() = default;

const TrainingArguments& Trainer::arguments() const {
  return impl_->args;
}

void Trainer::set_callbacks(TrainerCallbacks callbacks) {
  // A null stop keeps the run's request, unwritten: cancel() and preempt() may read it from
  // another thread meanwhile (zt_trainer_request_stop).
  if (callbacks.stop) {
    impl_->requests.asked = callbacks.stop;
  } else {
    callbacks.stop = impl_->requests.asked;
  }
  impl_->callbacks = std::move(callbacks);
}

static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
              "StopRequest is written from signal handlers");

void StopRequest::preempt(int signal) noexcept {
  preempt_.store(signal > 0 ? signal : SIGTERM);
}

void Trainer::cancel() {
  impl_->requests.asked->cancel();
}

void Trainer::preempt(int signal) {
  impl_->requests.asked->preempt(signal);
}

int Trainer::preempted_by() const {
  return impl_->requests.stop_signal;
}

int Trainer::rank() const {
  return impl_->rank;
}
int Trainer::world_size() const {
  return impl_->world;
}

}  // namespace zt
