// The Trainer: set-up (arguments, output folder, model, data, method, engine, resume), the
// training loop, evaluation, checkpoints and the final model.
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

#include "train/reporting.hpp"
#include "train/tensorboard.hpp"
#include "util/device_stats.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
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
#include "zerotrain/tokenizer.hpp"

namespace zt {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs `fn` on this rank and lets every rank learn whether all succeeded: the failing ranks
// rethrow their own error, the others throw a DistributedError naming them, so no rank is left
// waiting in a later collective.
template <typename Fn>
void on_every_rank(Communicator& comm, const std::string& what, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  at::Tensor flags =
      at::zeros({comm.world_size()}, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  if (error) flags[comm.rank()] = 1.0;
  comm.all_reduce(flags)->wait();
  if (error) std::rethrow_exception(error);
  at::Tensor host = flags.cpu();
  std::vector<int> failed;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (host[r].item<float>() != 0.0f) failed.push_back(r);
  }
  if (!failed.empty()) {
    throw DistributedError(
        fmt::format("{} failed on rank(s) {}; see the error there", what, fmt::join(failed, ", ")));
  }
}

bool is_true_text(const std::string& s) {
  return s == "True" || s == "true" || s == "1";
}
bool is_false_text(const std::string& s) {
  return s.empty() || s == "False" || s == "false" || s == "0";
}

}  // namespace

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

struct Trainer::Impl {
  TrainingArguments args;
  std::shared_ptr<Communicator> comm;
  TrainerCallbacks callbacks;
  int rank = 0, world = 1;
  DeepSpeedConfig ds;
  ModelConfig model_config;
  std::string model_dir;
  std::shared_ptr<Tokenizer> tokenizer;
  std::string template_source;  ///< why args.template_name (resolved from "auto") was chosen
  int32_t pad_id = 0;
  Dataset train_data, eval_data;
  bool has_train = false, has_eval = false;
  std::vector<int64_t> train_targets;  ///< per training example: labels that count
  std::vector<int64_t> train_lengths;
  std::shared_ptr<CausalLM> model;
  PeftConfig peft;
  bool adapter_method = false;
  ParameterCount parameters;
  int64_t non_embedding_parameters = 0;  ///< HF's total_flos counts 6 × these per token
  std::unique_ptr<Engine> engine;
  GlobalBatch batch;
  int64_t steps_per_epoch = 0, total_steps = 0;
  int64_t log_every = 0, eval_every = 0,
          save_every = 0;  ///< logging/eval/save_steps, ratios resolved
  uint64_t data_seed = 0;
  train::TrainerState state;
  std::optional<std::string> resume_dir;
  std::vector<std::string> superseded;  ///< checkpoints newer than resume_dir, removed at start
  /// Rank 0's exclusive lock on output_dir for the whole run: a second run into the same folder
  /// is refused at once (the kernel drops the lock with the process, kill -9 included).
  std::optional<files::FileLock> output_lock;
  void lock_output_dir();
  int stop_signal = 0;  ///< SIGTERM / SIGUSR1 asked to save and stop (preempt)
  std::atomic<int> preempt_requested{0};
  std::optional<double> last_eval_loss;
  std::unique_ptr<train::TensorBoardWriter> tensorboard;  ///< rank 0, with report_to tensorboard
  int64_t last_eval_step = -1;
  std::atomic<bool> cancel_requested{false};

  void check_output_dir();
  void load_data();
  void plan_batches();
  void build_model_and_engine();
  void check_machine_fits() const;
  void restore(const std::string& dir);
  void announce() const;

  void check_cancel();
  LossSum forward(const Batch& b);
  double run_evaluation();
  void log(const LogRecord& record);
  void report_to_tensorboard(const LogRecord& record);
  void save_checkpoint();
  /// Rank 0, before a save: an IoError when the file system clearly lacks room for it.
  void check_disk_space(const std::string& what) const;
  void write_checkpoint(CheckpointWriter& writer, bool in_run);
  LossSum forward_tokens(const at::Tensor& ids, const at::Tensor& labels) {
    return model->loss(ids.to(comm->device()), labels, {}, 1024);
  }
  double step_divisor = 0.0;   ///< train_step's fixed gradient scale (its first window's size)
  double window_tokens = 0.0;  ///< train_step: counted tokens of the open window, all ranks
  /// The weights a user loads directly (adapter tensors or the whole model), gathered where the
  /// stage shards them; empty when none are written (ZeRO-3 without 16-bit gathering).
  /// Collective.
  std::vector<std::pair<std::string, at::Tensor>> user_weights(bool& available);
  void write_user_files(const std::string& dir, bool available,
                        const std::vector<std::pair<std::string, at::Tensor>>& weights);
  void write_rng_state(const std::string& dir) const;
  /// training_args.json: the resolved arguments and DeepSpeed config, and zerotrain's version
  /// (HF's training_args.bin is a pickle; this is its safe equivalent). Rank 0.
  void write_run_settings(const std::string& dir) const {
    const std::string text = fmt::format(
        R"({{"zerotrain_version": "{}", "training_arguments": {}, "deepspeed_config": {}}})",
        ZT_VERSION_STRING, training_arguments_json(args), deepspeed_config_json(ds));
    files::write_atomic(dir + "/training_args.json",
                        json::dump(json::parse(text, "training_args.json"), true) + "\n");
  }
  void read_rng_state(const std::string& dir) const;
  double epoch_progress() const {
    return static_cast<double>(state.epoch_index) +
           static_cast<double>(state.steps_in_epoch) /
               static_cast<double>(std::max<int64_t>(1, steps_per_epoch));
  }
  // Collective on CUDA: the largest peak allocation of any rank since the last call, in GiB.
  std::optional<double> window_peak_memory_gib() {
    const at::Device device = comm->device();
    if (!device.is_cuda()) return std::nullopt;
    const int index = device.has_index() ? device.index() : 0;
    at::Tensor peak = at::full({}, device_stats::peak_allocated(index),
                               at::TensorOptions().dtype(at::kLong).device(device));
    comm->all_reduce(peak, ReduceOp::kMax)->wait();
    device_stats::reset_peak(index);
    return static_cast<double>(peak.item<int64_t>()) / (1024.0 * 1024.0 * 1024.0);
  }
};

void Trainer::Impl::check_output_dir() {
  const std::string& out = args.output_dir;
  if (out.empty()) {
    throw ConfigError(
        "output_dir is empty: give the folder for checkpoints, logs and the model (--output_dir "
        "DIR)");
  }
  std::error_code ec;
  const fs::path where = fs::weakly_canonical(fs::absolute(out), ec);
  if (!ec && where == where.root_path()) {
    throw ConfigError(fmt::format(
        "output_dir '{}' is the root of the file system; give the run a folder of its own", out));
  }
  if (fs::exists(out, ec) && !fs::is_directory(out, ec)) {
    throw ConfigError(
        fmt::format("output_dir '{}' exists and is not a folder; choose another output_dir", out));
  }
  const std::string& r = args.resume_from_checkpoint;
  const bool from_latest = is_true_text(r);
  if (from_latest) {
    resume_dir = latest_checkpoint(args.output_dir);
    if (!resume_dir) {
      throw ConfigError(
          fmt::format("resume_from_checkpoint True: '{}' holds no checkpoint to resume from; "
                      "start without it or name a checkpoint folder",
                      args.output_dir));
    }
  } else if (!is_false_text(r)) {
    if (!fs::is_directory(r)) {
      throw IoError(fmt::format(
          "resume_from_checkpoint '{}' is not a folder; name a checkpoint-<step> folder "
          "or pass True for the newest in output_dir",
          r));
    }
    fs::path dir = fs::path(r).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();  // "checkpoint-4/"
    resume_dir = dir.string();
  }
  if (resume_dir) {
    // Checkpoints after the one resumed from would be overwritten step by step (or stop the run
    // at its first save): refuse now, or with overwrite_output_dir remove them when training
    // starts.
    const int64_t from = train::read_trainer_state(*resume_dir).global_step;
    std::vector<std::string> newer;
    for (const CheckpointInfo& c : list_checkpoints(args.output_dir)) {
      std::error_code ec;
      if (c.step > from && !fs::equivalent(c.path, *resume_dir, ec)) newer.push_back(c.path);
    }
    if (!newer.empty() && from_latest && rank == 0) {
      // Renamed into place by a save that was killed before it could update `latest`: that save
      // never committed, and the resumed run makes those steps again.
      log::warn(
          "'{}/latest' names {}; the newer {} were left by a save that did not finish and are "
          "removed when "
          "training starts",
          out, fs::path(*resume_dir).filename().string(), fmt::join(newer, ", "));
    }
    if (!newer.empty() && !from_latest && !args.overwrite_output_dir) {
      std::vector<std::string> names;
      for (const std::string& n : newer) names.push_back(fs::path(n).filename().string());
      throw ConfigError(
          fmt::format("resume_from_checkpoint '{}' is step {}, but output_dir '{}' holds newer "
                      "checkpoint(s): {}; pass "
                      "--overwrite_output_dir to remove them and continue from step {}, or resume "
                      "from the newest "
                      "(--resume_from_checkpoint True)",
                      *resume_dir, from, args.output_dir, fmt::join(names, ", "), from));
    }
    superseded = newer;
  }
  if (!resume_dir && !args.overwrite_output_dir) {
    std::vector<CheckpointInfo> existing = list_checkpoints(args.output_dir);
    if (!existing.empty()) {
      throw ConfigError(fmt::format(
          "output_dir '{}' already holds {} checkpoint(s) (newest: {}); pass "
          "--resume_from_checkpoint True to "
          "continue that run, --overwrite_output_dir to start anew there, or choose another "
          "output_dir",
          args.output_dir, existing.size(), fs::path(existing.back().path).filename().string()));
    }
  }
  if (args.packing && (args.finetuning_type == "ptuning" || args.finetuning_type == "prefix" ||
                       args.finetuning_type == "ptuning_v2")) {
    throw ConfigError(
        fmt::format("packing cannot be combined with finetuning_type {} (virtual tokens would "
                    "cross documents); drop --packing",
                    args.finetuning_type));
  }
}

void Trainer::Impl::lock_output_dir() {
  const std::string& out = args.output_dir;
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) throw IoError(fmt::format("cannot create output_dir '{}': {}", out, ec.message()));
  if (::access(out.c_str(), W_OK | X_OK) != 0) {
    throw IoError(fmt::format("output_dir '{}' is not writable: {}", out, std::strerror(errno)));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const std::string lock_path = out + "/.zerotrain.lock";
  output_lock = files::FileLock::try_lock(lock_path, /*exclusive=*/true,
                                          fmt::format("pid {} on {} since {}", ::getpid(), host,
                                                      static_cast<long long>(std::time(nullptr))));
  if (!output_lock) {
    const std::string holder = files::FileLock::holder_of(lock_path);
    throw ConfigError(
        fmt::format("output_dir '{}' is in use by another run ({}); wait for it to end or choose "
                    "another output_dir (--overwrite_output_dir does not take a folder from a "
                    "running job)",
                    out, holder.empty() ? "its lock file " + lock_path : holder));
  }
}

void Trainer::Impl::load_data() {
  DataOptions options = data_options_for(args);
  options.token_id_limit = model_config.vocab_size;  // pre-tokenized ids index the embedding
  const std::string cache_dir =
      args.cache_dir.empty() ? args.output_dir + "/.cache" : args.cache_dir;
  auto load = [&](const std::string& path, Dataset& into, const char* what) {
    DatasetStats stats;
    // Rank 0 tokenizes (or finds the cache); the others read what it wrote.
    on_every_rank(*comm, fmt::format("tokenizing {} '{}'", what, path), [&] {
      if (rank == 0) into = load_or_tokenize(path, *tokenizer, options, cache_dir, &stats);
    });
    on_every_rank(*comm, fmt::format("reading the tokenized {} data", what), [&] {
      if (rank != 0)
        into = load_dataset(dataset_cache_path(cache_dir, path, *tokenizer, options), &stats);
    });
    if (rank == 0) {
      log::info(
          "{} data '{}': {} examples, {} tokens{}{}", what, path, stats.examples, stats.tokens,
          stats.skipped_lines ? fmt::format(", {} bad lines skipped", stats.skipped_lines) : "",
          stats.dropped_examples
              ? fmt::format(", {} examples dropped by truncation", stats.dropped_examples)
              : "");
    }
  };
  if (!args.train_file.empty()) {
    load(args.train_file, train_data, "training");
    has_train = true;
    if (args.packing) {
      std::vector<int64_t> order(static_cast<size_t>(train_data.size()));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      const int64_t before = train_data.size();
      train_data = pack(train_data, args.max_length, order);
      if (rank == 0)
        log::info("packing: {} examples into {} sequences of at most {} tokens", before,
                  train_data.size(), args.max_length);
    }
    train_lengths = train_data.lengths();
    train_targets.resize(static_cast<size_t>(train_data.size()));
    for (int64_t i = 0; i < train_data.size(); ++i) {
      // The tokens the loss counts: labels after the causal shift (a row's first label is never
      // predicted), as CausalLM::loss counts them.
      TokenView labels = train_data.labels(i);
      int64_t n = 0;
      for (int64_t t = 1; t < labels.size; ++t) n += labels[t] != kIgnoreLabel;
      train_targets[static_cast<size_t>(i)] = n;
    }
  }
  if (!args.eval_file.empty()) {
    load(args.eval_file, eval_data, "evaluation");
    has_eval = true;
  }
}

void Trainer::Impl::plan_batches() {
  if (resume_dir) {
    // Keep the saved global batch by changing the accumulation when it divides evenly.
    train::TrainerState saved = train::read_trainer_state(*resume_dir);
    const int64_t micro = ds.train_micro_batch_size_per_gpu.is_set()
                              ? ds.train_micro_batch_size_per_gpu.value()
                              : args.per_device_train_batch_size;
    const int64_t per_step = micro * world;
    if (saved.world_size != world ||
        saved.global_batch_size != per_step * args.gradient_accumulation_steps) {
      if (saved.global_batch_size % per_step == 0) {
        const int64_t accum = saved.global_batch_size / per_step;
        if (rank == 0 && accum != args.gradient_accumulation_steps) {
          log::info(
              "resuming at {} ranks (saved at {}): gradient_accumulation_steps {} keeps the global "
              "batch of {}",
              world, saved.world_size, accum, saved.global_batch_size);
        }
        args.gradient_accumulation_steps = accum;
        args.given.erase("gradient_accumulation_steps");
        if (ds.gradient_accumulation_steps.is_set()) ds.gradient_accumulation_steps.set(accum);
        if (ds.train_batch_size.is_set()) ds.train_batch_size.set(saved.global_batch_size);
      } else if (rank == 0) {
        log::warn(
            "resuming at {} ranks: the saved global batch of {} is not a multiple of micro batch "
            "{} × {} "
            "ranks; continuing with a global batch of {}",
            world, saved.global_batch_size, micro, world,
            per_step * args.gradient_accumulation_steps);
      }
    }
  }
  resolve_config(ds, args, ResolveContext{world, model_config.hidden_size, std::nullopt});
  batch = GlobalBatch{args.per_device_train_batch_size, args.gradient_accumulation_steps, world};
  if (has_train) {
    steps_per_epoch =
        zt::steps_per_epoch(train_data.size(), batch.size(), args.dataloader_drop_last);
    if (steps_per_epoch == 0) {
      throw ConfigError(
          fmt::format("'{}' has {} examples, fewer than one global batch of {} (micro batch {} × "
                      "accumulation {} × {} ranks) with dataloader_drop_last; use a smaller batch",
                      args.train_file, train_data.size(), batch.size(), batch.micro_batch,
                      batch.accumulation, world));
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
      ResolveContext{world, model_config.hidden_size,
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

void Trainer::Impl::check_machine_fits() const {
  // A lower bound: the weights each rank holds in the compute dtype (ZeRO-3 divides them).
  // Anything above the machine's whole memory is a config's mistake (or a corrupt file), said
  // before a byte is allocated.
  const ModelConfig& c = model_config;
  const double params = static_cast<double>(c.parameter_count());
  const double element = ds.bf16.enabled.value() || ds.fp16.enabled.value() ? 2.0 : 4.0;
  const double per_rank =
      params * element / (ds.zero.stage == 3 ? static_cast<double>(world) : 1.0);
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  double capacity =
      pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
  const at::Device device = comm->device();
  if (device.is_cuda())
    capacity +=
        static_cast<double>(device_stats::total_memory(device.has_index() ? device.index() : 0));
  if (capacity > 0 && per_rank > capacity) {
    throw ConfigError(
        fmt::format("{}: a model of {:.3g} parameters (vocab_size {}, hidden_size {}, "
                    "intermediate_size {}, num_hidden_layers "
                    "{}) needs {:.1f} GiB per rank for its weights alone, more than this machine's "
                    "{:.1f} GiB of memory; check "
                    "the config's sizes",
                    c.source, params, c.vocab_size, c.hidden_size, c.intermediate_size,
                    c.num_hidden_layers, per_rank / (1 << 30), capacity / (1 << 30)));
  }
}

void Trainer::Impl::build_model_and_engine() {
  std::shared_ptr<ParameterSource> base;
  on_every_rank(*comm, "building the model", [&] {
    model = std::make_shared<CausalLM>(model_config, at::TensorOptions(), /*allocate=*/false);
    if (!model_dir.empty()) check_checkpoint(*model, model_dir);  // before adapters join the model
    peft = peft_config_for(args);
    peft.base_model_name_or_path = args.model_name_or_path;
    adapter_method = peft.type == FinetuningType::kLora || peft.type == FinetuningType::kPTuning ||
                     peft.type == FinetuningType::kPrefix;
    parameters = apply_peft_from_args(*model, args, static_cast<uint64_t>(args.seed));
    non_embedding_parameters = parameters.all - model_config.vocab_size * model_config.hidden_size;
    if (!model_dir.empty()) {
      base = checkpoint_source(model_dir);
    } else {
      base = random_source(model_config, static_cast<uint64_t>(args.seed));
    }
  });
  // Collective from here: every rank builds its engine (and reads its slices of the weights).
  EngineOptions eo;
  eo.device = comm->device();
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.activation_checkpointing = args.gradient_checkpointing;
  eo.update_in_backward = args.update_in_backward;
  eo.total_train_steps = total_steps;  // 0 when unknown: schedules that need it say so
  eo.source = with_adapter_values(base, *model);
  engine = std::make_unique<Engine>(model, ds, args, comm, eo);
}

void Trainer::Impl::restore(const std::string& dir) {
  train::TrainerState saved = train::read_trainer_state(dir);
  load_engine_state(*engine, dir);
  read_rng_state(dir);
  state.log_history = saved.log_history;
  state.best_metric = saved.best_metric;
  state.best_model_checkpoint = saved.best_model_checkpoint;
  state.best_global_step = saved.best_global_step;
  state.total_flos = saved.total_flos;
  state.tokens_seen = saved.tokens_seen;
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
  log::info("  num examples = {}, num epochs = {}", train_data.size(), args.num_train_epochs);
  log::info("  batch size per device = {}, gradient accumulation steps = {}, total batch size = {}",
            batch.micro_batch, batch.accumulation, batch.size());
  log::info("  total optimization steps = {} ({} per epoch)", total_steps, steps_per_epoch);
  log::info("  fine-tuning: {} — {}", args.finetuning_type, parameters.line());
  log::info("  template: {} ({})", args.template_name, template_source);
}

Trainer::Trainer(TrainingArguments args, std::shared_ptr<Communicator> comm,
                 TrainerCallbacks callbacks)
    : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.args = std::move(args);
  I.comm = std::move(comm);
  I.callbacks = std::move(callbacks);
  I.rank = I.comm->rank();
  I.world = I.comm->world_size();
  if (I.rank == 0) {
    for (const auto& [name, line] : I.args.ignored) log::warn("{}", line);
  }
  if (I.args.tf32) compat::set_allow_tf32(*I.args.tf32);
  on_every_rank(*I.comm, "checking the arguments, output_dir and model", [&] {
    I.check_output_dir();
    if (I.rank == 0) I.lock_output_dir();
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
    I.tokenizer = load_tokenizer(I.model_dir, I.model_config.vocab_size);
    I.args.template_name =
        resolve_template(I.args.template_name, I.model_dir, *I.tokenizer, &I.template_source);
    I.pad_id =
        I.tokenizer->pad_id() >= 0 ? I.tokenizer->pad_id() : std::max(0, I.tokenizer->eos_id());
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
  // HF's set_seed: the random stream dropout draws from starts at `seed` (a resumed run then
  // continues the saved stream instead).
  at::manual_seed(static_cast<uint64_t>(I.args.seed));
  if (I.resume_dir) I.restore(*I.resume_dir);
}

Trainer::~Trainer() = default;

const TrainingArguments& Trainer::arguments() const {
  return impl_->args;
}

void Trainer::set_callbacks(TrainerCallbacks callbacks) {
  impl_->callbacks = std::move(callbacks);
}

void Trainer::cancel() {
  impl_->cancel_requested.store(true);
}

void Trainer::preempt(int signal) {
  impl_->preempt_requested.store(signal > 0 ? signal : SIGTERM);
}

int Trainer::preempted_by() const {
  return impl_->stop_signal;
}

void Trainer::Impl::check_cancel() {
  // [cancel, preempting signal], the largest of every rank's: one agreement per step.
  int preempt = preempt_requested.load();
  bool cancel = cancel_requested.load();
  if (world > 1) {
    at::Tensor flags = at::tensor({cancel ? 1.0f : 0.0f, static_cast<float>(preempt)}, at::kFloat)
                           .to(comm->device());
    comm->all_reduce(flags, ReduceOp::kMax)->wait();
    at::Tensor host = flags.cpu();
    cancel = host[0].item<float>() > 0;
    preempt = static_cast<int>(host[1].item<float>());
  }
  if (preempt > 0) {
    // A scheduler's warning before preemption: keep this step's state, then stop.
    stop_signal = preempt;
    if (state.global_step > 0 &&
        !checkpoint_in(args.output_dir, fmt::format("checkpoint-{}", state.global_step))) {
      save_checkpoint();
    }
    throw CancelledError(
        fmt::format("stopped by signal {} at step {}; the state is in checkpoint-{}: continue with "
                    "--resume_from_checkpoint True",
                    preempt, state.global_step, state.global_step));
  }
  if (cancel) {
    throw CancelledError(fmt::format("training cancelled at step {}; the newest checkpoint is kept",
                                     state.global_step));
  }
}

namespace {

// Whether every row of a (host) attention mask is its real tokens followed by padding. Causal
// attention never lets a real token see a later position, so such padding is unreachable
// without a mask: the real tokens' results are the same, and on the GPU attention runs in the
// flash kernels, which take no mask (transformers passes the mask and gets the slower kernel).
bool padding_only_at_row_ends(const at::Tensor& mask) {
  if (mask.size(1) < 2) return true;
  const at::Tensor m = mask.ne(0);
  return m.narrow(1, 1, m.size(1) - 1).le(m.narrow(1, 0, m.size(1) - 1)).all().item<bool>();
}

}  // namespace

LossSum Trainer::Impl::forward(const Batch& b) {
  const at::Device device = comm->device();
  at::Tensor mask;
  at::Tensor positions;
  if (b.document_ids.defined()) {
    mask =
        (b.document_ids + 1).to(device);  // documents numbered from 1, padding 0 (CausalLM::loss)
    positions = b.position_ids.to(device);
  } else if (!padding_only_at_row_ends(b.attention_mask)) {
    mask = b.attention_mask.to(device);
  }
  return model->loss(b.input_ids.to(device), b.labels, mask, 1024, positions);
}

void Trainer::Impl::log(const LogRecord& record) {
  state.log_history.push_back(record);
  if (rank != 0) return;
  log::info("{}", train::describe(record, total_steps));
  try {
    fs::create_directories(args.output_dir);
    std::ofstream out(args.output_dir + "/trainer_log.jsonl", std::ios::app);
    out << record.json() << "\n";
    if (!out)
      throw IoError(fmt::format("cannot append to '{}/trainer_log.jsonl'", args.output_dir));
  } catch (const std::exception& e) {
    log::warn("{}", e.what());  // a log line lost is not worth the run
  }
  report_to_tensorboard(record);
  if (callbacks.on_log) callbacks.on_log(record);
}

void Trainer::Impl::report_to_tensorboard(const LogRecord& r) {
  if (args.report_to.find("tensorboard") == std::string::npos &&
      args.report_to.find("all") == std::string::npos) {
    return;
  }
  try {
    if (!tensorboard) {
      const std::string dir =
          args.logging_dir.empty() ? train::default_logging_dir(args.output_dir) : args.logging_dir;
      tensorboard = std::make_unique<train::TensorBoardWriter>(dir);
      log::info("TensorBoard: {}", tensorboard->path());
    }
    // HF's tags: train/<key> for training records, eval/<key> for evaluation.
    auto put = [&](const char* tag, const std::optional<double>& v) {
      if (v) tensorboard->scalar(tag, *v, r.step);
    };
    put("train/loss", r.loss);
    put("train/learning_rate", r.learning_rate);
    put("train/grad_norm", r.grad_norm);
    put("train/tokens_per_second", r.tokens_per_second);
    put("train/loss_scale", r.loss_scale);
    put("train/peak_memory_gib", r.peak_memory_gib);
    put("train/train_loss", r.train_loss);
    put("train/train_runtime", r.train_runtime);
    put("eval/loss", r.eval_loss);
    if (r.loss || r.eval_loss) tensorboard->scalar("train/epoch", r.epoch, r.step);
  } catch (const std::exception& e) {
    log::warn("{} (TensorBoard reporting stops)",
              e.what());  // the run is worth more than its plots
    args.report_to = "none";
  }
}

double Trainer::Impl::run_evaluation() {
  if (!has_eval) throw ConfigError("evaluate: no eval_file given");
  at::NoGradGuard no_grad;
  model->eval();
  std::vector<std::vector<int64_t>> batches =
      eval_batches(eval_data.size(), world, rank, args.per_device_eval_batch_size);
  double sum = 0.0, tokens = 0.0;
  for (const std::vector<int64_t>& indices : batches) {
    // A rank with nothing left still runs a forward (ZeRO-3 forwards are collective), unweighted.
    const bool empty = indices.empty();
    Batch b = collate(eval_data, empty ? std::vector<int64_t>{0} : indices, pad_id);
    LossSum l = forward(b);
    if (!empty) {
      sum += l.sum.item<double>();
      tokens += static_cast<double>(l.tokens);
    }
  }
  model->train();
  at::Tensor global = at::tensor({static_cast<float>(sum), static_cast<float>(tokens)}, at::kFloat)
                          .to(comm->device());
  comm->all_reduce(global)->wait();
  at::Tensor host = global.cpu();
  if (host[1].item<double>() <= 0) {
    throw ConfigError(fmt::format("'{}' has no token that counts in the loss", args.eval_file));
  }
  return host[0].item<double>() / host[1].item<double>();
}

double Trainer::evaluate() {
  Impl& I = *impl_;
  const double loss = I.run_evaluation();
  LogRecord r;
  r.step = I.state.global_step;
  r.epoch = I.epoch_progress();
  r.eval_loss = loss;
  I.log(r);
  I.last_eval_loss = loss;
  I.last_eval_step = I.state.global_step;
  return loss;
}

std::vector<std::pair<std::string, at::Tensor>> Trainer::Impl::user_weights(bool& available) {
  available = true;
  if (adapter_method) return engine->gather_full_parameters(/*trainable_only=*/true);
  if (engine->stage() == 3) {
    if (!ds.zero.stage3_gather_16bit_weights_on_model_save) {
      available = false;
      return {};
    }
    return engine->gather_full_parameters();
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (rank == 0) {
    for (const auto& item : model->named_parameters(true))
      out.emplace_back(item.key(), item.value().detach());
  }
  return out;
}

void Trainer::Impl::write_user_files(
    const std::string& dir, bool available,
    const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  if (rank != 0) return;
  if (adapter_method) {
    save_adapter(*model, peft, dir, weights);
  } else {
    // config.json always, so `zerotrain merge` can consolidate a checkpoint without weights.
    const at::ScalarType dtype = engine->compute_dtype();
    ModelConfig c = model_config;
    c.dtype = dtype;
    files::write_atomic(dir + "/config.json", model_config_json(c) + "\n");
    if (available) {
      SafetensorsStreamWriter writer(dir, [&] {
        std::vector<TensorEntry> plan;
        for (const auto& [name, value] : weights)
          plan.push_back(TensorEntry{name, dtype, value.sizes().vec()});
        return plan;
      }());
      for (const auto& [name, value] : weights) writer.write(name, value);
      writer.finish();
    }
  }
  if (!model_dir.empty()) copy_model_companion_files(model_dir, dir);
  record_template(dir, args.template_name);  // what `zerotrain verify` asks with
}

void Trainer::Impl::write_rng_state(const std::string& dir) const {
  std::vector<std::pair<std::string, at::Tensor>> states{{"cpu", rng::state(at::kCPU)}};
  if (comm->device().is_cuda()) states.emplace_back("device", rng::state(comm->device()));
  fs::create_directories(dir + "/rng");
  save_safetensors(fmt::format("{}/rng/rank-{:05d}.safetensors", dir, rank), states);
}

void Trainer::Impl::read_rng_state(const std::string& dir) const {
  const std::string path = fmt::format("{}/rng/rank-{:05d}.safetensors", dir, rank);
  if (!fs::exists(path)) return;  // a rank the saved run did not have keeps its fresh seed
  SafetensorsFile f(path);
  rng::set_state(at::kCPU, f.load("cpu"));
  if (comm->device().is_cuda() && f.contains("device"))
    rng::set_state(comm->device(), f.load("device"));
}

void Trainer::Impl::check_disk_space(const std::string& what) const {
  // What a checkpoint holds, generously: every kind of optimizer state in fp32 over all ranks,
  // and the weights a user loads (the adapter, or the whole model in the compute dtype).
  int64_t trainable = 0;
  for (const auto& [name, shape] : engine->trainable_parameters()) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    trainable += n;
  }
  const double state_bytes =
      static_cast<double>(trainable) * 4.0 * static_cast<double>(engine->state_kinds().size());
  const double weights = adapter_method
                             ? static_cast<double>(trainable) * 4.0
                             : static_cast<double>(parameters.all) *
                                   static_cast<double>(c10::elementSize(engine->compute_dtype()));
  const double needed = 1.1 * (state_bytes + weights) + 64.0 * (1 << 20);
  std::optional<uint64_t> free = files::free_bytes(args.output_dir);
  if (const char* fake = std::getenv("ZT_TEST_FREE_BYTES"))
    free = std::strtoull(fake, nullptr, 10);  // tests
  if (free && static_cast<double>(*free) < needed) {
    throw IoError(fmt::format(
        "not enough free disk for {} in '{}': about {:.2f} GiB needed, {:.2f} GiB free; make "
        "room or lower save_total_limit (earlier checkpoints are intact)",
        what, args.output_dir, needed / (1 << 30), static_cast<double>(*free) / (1 << 30)));
  }
}

void Trainer::Impl::save_checkpoint() {
  const int64_t step = state.global_step;
  on_every_rank(*comm, "checking free disk space", [&] {
    if (rank == 0) check_disk_space(fmt::format("checkpoint-{}", step));
  });
  const std::string final_dir = fmt::format("{}/checkpoint-{}", args.output_dir, step);
  const bool greater = args.greater_is_better.value_or(false);
  if (last_eval_step == step && last_eval_loss &&
      (!state.best_metric ||
       (greater ? *last_eval_loss > *state.best_metric : *last_eval_loss < *state.best_metric))) {
    state.best_metric = last_eval_loss;
    state.best_model_checkpoint = final_dir;
    state.best_global_step = step;
  }
  CheckpointWriter writer(*comm, args.output_dir, step, args.overwrite_output_dir);
  write_checkpoint(writer, /*in_run=*/true);
  if (rank == 0) log::info("saved {}", final_dir);
}

void Trainer::Impl::write_checkpoint(CheckpointWriter& writer, bool in_run) {
  save_engine_state(*engine, writer.dir());
  bool available = false;
  std::vector<std::pair<std::string, at::Tensor>> weights = user_weights(available);
  bool ok = true;
  try {
    write_user_files(writer.dir(), available, weights);
    write_rng_state(writer.dir());
    if (rank == 0) {
      files::write_atomic(writer.dir() + "/trainer_state.json", train::trainer_state_json(state));
      files::write_atomic(writer.dir() + "/zerotrain_state.json",
                          train::zerotrain_state_json(state));
      write_run_settings(writer.dir());
    }
  } catch (const std::exception& e) {
    ok = false;
    log::error("rank {}: writing a checkpoint into '{}': {}", rank, writer.dir(), e.what());
  }
  if (in_run) {
    writer.commit(ok, args.save_total_limit, state.best_model_checkpoint.value_or(""));
  } else {
    writer.commit(ok);
  }
}

void Trainer::save_checkpoint(const std::string& dir) {
  Impl& I = *impl_;
  CheckpointWriter writer = CheckpointWriter::to_folder(*I.comm, dir);
  I.write_checkpoint(writer, /*in_run=*/false);
}

void Trainer::load_checkpoint(const std::string& dir) {
  impl_->restore(dir);
}

void Trainer::export_model(const std::string& dir) {
  Impl& I = *impl_;
  bool available = false;
  auto weights = I.user_weights(available);
  if (!available) {
    // ZeRO-3 without 16-bit gathering keeps no whole copy anywhere; exporting gathers anyway.
    weights = I.engine->gather_full_parameters();
    available = true;
  }
  on_every_rank(*I.comm, fmt::format("exporting the model to '{}'", dir), [&] {
    if (I.rank != 0) return;
    fs::create_directories(dir);
    I.write_user_files(dir, available, weights);
  });
}

int Trainer::rank() const {
  return impl_->rank;
}
int Trainer::world_size() const {
  return impl_->world;
}

namespace {

// Token ids from a caller: [batch, seq] integers inside [0, vocab) (labels may also be -100).
at::Tensor checked_tokens(const at::Tensor& t, const char* what, int64_t vocab, bool labels) {
  if (!t.defined() || t.dim() != 2 || t.size(0) < 1 || t.size(1) < 1) {
    throw InvalidArgument(
        fmt::format("{}: expected a [batch, seq] tensor with both sizes positive", what));
  }
  if (at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool) {
    throw InvalidArgument(fmt::format("{}: expected integer token ids, found {}", what,
                                      c10::toString(t.scalar_type())));
  }
  at::Tensor ids = t.to(at::kLong).contiguous();
  at::Tensor bad = labels ? at::logical_and(ids.ne(-100), at::logical_or(ids.lt(0), ids.ge(vocab)))
                          : at::logical_or(ids.lt(0), ids.ge(vocab));
  if (bad.any().item<bool>()) {
    at::Tensor where = bad.nonzero()[0];
    const int64_t r = where[0].item<int64_t>(), c = where[1].item<int64_t>();
    throw InvalidArgument(fmt::format("{}: {} at [{}, {}] is outside the vocabulary [0, {}){}",
                                      what, ids[r][c].item<int64_t>(), r, c, vocab,
                                      labels ? " (and is not -100)" : ""));
  }
  return ids;
}

}  // namespace

StepStats Trainer::train_step(const at::Tensor& input_ids, const at::Tensor& labels) {
  Impl& I = *impl_;
  const int64_t vocab = I.model_config.vocab_size;
  at::Tensor ids = checked_tokens(input_ids, "train_step input_ids", vocab, false);
  at::Tensor y = labels.defined() ? checked_tokens(labels, "train_step labels", vocab, true) : ids;
  if (y.sizes() != ids.sizes()) {
    throw InvalidArgument(fmt::format("train_step: labels have shape [{}] but input_ids [{}]",
                                      fmt::join(y.sizes(), ", "), fmt::join(ids.sizes(), ", ")));
  }
  // Gradients are scaled by a fixed estimate of the window's token count while they accumulate
  // (keeping fp16 magnitudes near a mean's), and corrected to the real count at the boundary.
  if (I.step_divisor <= 0.0) {
    I.step_divisor =
        static_cast<double>(ids.numel() * I.world * I.engine->gradient_accumulation_steps());
  }
  I.model->train();
  LossSum l = I.forward_tokens(ids, y);
  // Updates inside backward cannot be rescaled afterwards; they run only at one rank without
  // accumulation, where this micro-batch's token count is the window's.
  const bool exact = I.engine->updates_in_backward();
  I.engine->backward(l.sum,
                     exact ? std::max<double>(1.0, static_cast<double>(l.tokens)) : I.step_divisor);
  at::Tensor totals =
      at::stack({l.sum.detach().to(at::kFloat).reshape({}),
                 at::scalar_tensor(static_cast<float>(l.tokens),
                                   at::TensorOptions().dtype(at::kFloat).device(l.sum.device()))})
          .to(I.comm->device());
  I.comm->all_reduce(totals)->wait();
  at::Tensor host = totals.cpu();
  I.window_tokens += host[1].item<double>();
  const bool boundary = I.engine->at_boundary();
  const double scale = boundary && !exact ? I.step_divisor / std::max(1.0, I.window_tokens) : 1.0;
  StepStats stats;
  stats.stepped = I.engine->step(scale);
  if (stats.stepped) {
    I.window_tokens = 0.0;
    stats.skipped = I.engine->last_step_skipped();
    stats.grad_norm = I.engine->last_grad_norm();
  }
  I.state.global_step = stats.global_step = I.engine->global_step();
  stats.loss = host[0].item<double>() / std::max(1.0, host[1].item<double>());
  stats.learning_rate = I.engine->learning_rate();
  stats.loss_scale = I.engine->loss_scale();
  return stats;
}

double Trainer::evaluate_batches(const std::vector<std::pair<at::Tensor, at::Tensor>>& batches) {
  Impl& I = *impl_;
  // Every rank must run the same number of forwards (ZeRO-3 forwards are collective).
  at::Tensor counts =
      at::tensor({static_cast<float>(batches.size()), -static_cast<float>(batches.size())})
          .to(I.comm->device());
  I.comm->all_reduce(counts, ReduceOp::kMax)->wait();
  at::Tensor c = counts.cpu();
  if (c[0].item<float>() != -c[1].item<float>() || c[0].item<float>() == 0.0f) {
    throw InvalidArgument(
        fmt::format("evaluate: every rank must give the same, nonzero number of batches "
                    "(this rank gave {}, others up to {})",
                    batches.size(), c[0].item<float>()));
  }
  at::NoGradGuard no_grad;
  I.model->eval();
  double sum = 0.0, tokens = 0.0;
  std::exception_ptr error;
  for (const auto& [input_ids, labels] : batches) {
    at::Tensor ids, y;
    try {
      ids = checked_tokens(input_ids, "evaluate input_ids", I.model_config.vocab_size, false);
      y = labels.defined()
              ? checked_tokens(labels, "evaluate labels", I.model_config.vocab_size, true)
              : ids;
      if (y.sizes() != ids.sizes())
        throw InvalidArgument("evaluate: labels and input_ids differ in shape");
    } catch (...) {
      if (!error) error = std::current_exception();
      ids = y = at::zeros({1, 1}, at::kLong);  // still take part in the collective forward
    }
    LossSum l = I.forward_tokens(ids, y);
    if (!error) {
      sum += l.sum.item<double>();
      tokens += static_cast<double>(l.tokens);
    }
  }
  I.model->train();
  at::Tensor global =
      at::tensor({static_cast<float>(sum), static_cast<float>(tokens), error ? 1.0f : 0.0f},
                 at::kFloat)
          .to(I.comm->device());
  I.comm->all_reduce(global)->wait();
  at::Tensor host = global.cpu();
  if (error) std::rethrow_exception(error);
  if (host[2].item<float>() > 0)
    throw InvalidArgument("evaluate: another rank gave an invalid batch (see its error)");
  if (host[1].item<float>() <= 0)
    throw InvalidArgument("evaluate: the batches have no token that counts in the loss");
  return host[0].item<double>() / host[1].item<double>();
}

TrainResult Trainer::train() {
  Impl& I = *impl_;
  if (!I.has_train) throw ConfigError("train: no train_file given (--train_file DATA.jsonl)");
  I.announce();
  on_every_rank(*I.comm, fmt::format("preparing output_dir '{}'", I.args.output_dir), [&] {
    if (I.rank != 0) return;
    fs::create_directories(I.args.output_dir);
    if (!I.superseded.empty()) {
      for (const std::string& dir : I.superseded) {
        log::warn(
            "overwrite_output_dir: removing '{}', which is newer than the checkpoint resumed from",
            dir);
        files::remove_tree(dir);
      }
      std::error_code ec;
      const fs::path resumed = fs::absolute(*I.resume_dir).lexically_normal();
      if (fs::equivalent(resumed.parent_path(), I.args.output_dir, ec)) {
        files::write_atomic(I.args.output_dir + "/latest", resumed.filename().string() + "\n");
      }
    }
    I.write_run_settings(I.args.output_dir);
  });
  I.superseded.clear();
  if (I.args.eval_on_start && I.has_eval) evaluate();
  I.model->train();

  const Clock::time_point start = Clock::now();
  const int64_t first_step = I.state.global_step;
  Clock::time_point window_start = start;
  at::Tensor window_loss =
      at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(I.comm->device()));
  int64_t window_steps = 0, window_tokens = 0;
  double run_loss_sum = 0.0;
  int64_t run_loss_steps = 0;
  double last_logged_loss = 0.0;
  const int64_t megabatch = length_megabatch(I.train_data.size(), I.batch.size());

  auto log_window = [&] {
    if (window_steps == 0) return;
    at::Tensor total = window_loss.clone();
    I.comm->all_reduce(total)->wait();
    const double loss = total.item<double>() / static_cast<double>(window_steps);
    LogRecord r;
    r.step = I.state.global_step;
    r.epoch = I.epoch_progress();
    r.loss = loss;
    r.learning_rate = I.engine->learning_rate();
    r.grad_norm = I.engine->last_grad_norm();
    r.tokens_per_second =
        static_cast<double>(window_tokens) / std::max(1e-9, seconds_since(window_start));
    if (I.ds.fp16.enabled.value()) r.loss_scale = I.engine->loss_scale();
    r.peak_memory_gib = I.window_peak_memory_gib();
    I.log(r);
    run_loss_sum += loss * static_cast<double>(window_steps);
    run_loss_steps += window_steps;
    last_logged_loss = loss;
    window_loss.zero_();
    window_steps = 0;
    window_tokens = 0;
    window_start = Clock::now();
  };

  while (I.state.global_step < I.total_steps) {
    const int64_t epoch = I.state.epoch_index;
    // Each epoch's own order, from the seed and the epoch alone (HF's sampler with set_epoch):
    // a resumed run rebuilds the same one.
    const bool shuffle = I.args.train_sampling_strategy != "sequential";
    const std::vector<int64_t> order =
        epoch_order(I.train_data.size(), I.data_seed, epoch, shuffle,
                    I.args.group_by_length ? &I.train_lengths : nullptr, megabatch);
    bool epoch_end = false;
    while (!epoch_end && I.state.global_step < I.total_steps) {
      I.check_cancel();
      const int64_t s = I.state.steps_in_epoch;
      // The whole global batch's counts, the same on every rank without communication.
      int64_t targets = 0, tokens = 0;
      for (int64_t a = 0; a < I.batch.accumulation; ++a) {
        for (int64_t r = 0; r < I.world; ++r) {
          for (int64_t i : micro_batch_indices(order, I.batch, s, a, r)) {
            targets += I.train_targets[static_cast<size_t>(i)];
            tokens += I.train_lengths[static_cast<size_t>(i)];
          }
        }
      }
      const double divisor = static_cast<double>(std::max<int64_t>(1, targets));
      at::Tensor step_loss = at::zeros({}, window_loss.options());
      for (int64_t a = 0; a < I.batch.accumulation; ++a) {
        Batch b =
            collate(I.train_data, micro_batch_indices(order, I.batch, s, a, I.rank), I.pad_id);
        LossSum l = I.forward(b);
        I.engine->backward(l.sum, divisor);
        I.engine->step();
        step_loss += l.sum.detach() / divisor;
      }
      window_loss += step_loss;
      I.state.global_step = I.engine->global_step();
      I.state.steps_in_epoch = s + 1;
      epoch_end = I.state.steps_in_epoch == I.steps_per_epoch;
      if (epoch_end) {  // the position a checkpoint saved now resumes from
        I.state.epoch_index = epoch + 1;
        I.state.steps_in_epoch = 0;
      }
      I.state.epoch = I.epoch_progress();
      I.state.tokens_seen += tokens;
      I.state.total_flos +=
          6.0 * static_cast<double>(tokens) * static_cast<double>(I.non_embedding_parameters);
      window_tokens += tokens;
      ++window_steps;
      const int64_t step = I.state.global_step;
      if (I.callbacks.on_step) {
        I.comm->all_reduce(step_loss)->wait();  // this step's mean token loss over all ranks
        StepStats st;
        st.global_step = step;
        st.stepped = true;
        st.skipped = I.engine->last_step_skipped();
        st.loss = step_loss.item<double>();
        st.grad_norm = I.engine->last_grad_norm();
        st.learning_rate = I.engine->learning_rate();
        st.loss_scale = I.engine->loss_scale();
        I.callbacks.on_step(st);
      }
      const bool last = step == I.total_steps;
      const std::string& logging = I.args.logging_strategy;
      if ((logging == "steps" &&
           (step % I.log_every == 0 || (I.args.logging_first_step && step == 1))) ||
          (logging == "epoch" && epoch_end) || (logging != "no" && last)) {
        log_window();
      }
      if (I.rank == 0 && I.callbacks.on_progress) {
        Progress p;
        p.step = step;
        p.total_steps = I.total_steps;
        p.epoch = I.epoch_progress();
        p.loss = last_logged_loss;
        p.learning_rate = I.engine->learning_rate();
        const double elapsed = seconds_since(start);
        p.tokens_per_second = static_cast<double>(I.state.tokens_seen) / std::max(1e-9, elapsed);
        p.eta_seconds = elapsed / static_cast<double>(step - first_step) *
                        static_cast<double>(I.total_steps - step);
        I.callbacks.on_progress(p);
      }
      const bool delayed = I.args.eval_strategy == "epoch"
                               ? I.state.epoch < I.args.eval_delay
                               : static_cast<double>(step) < I.args.eval_delay;
      if (I.has_eval && !delayed &&
          ((I.args.eval_strategy == "steps" && step % I.eval_every == 0) ||
           (I.args.eval_strategy == "epoch" && epoch_end))) {
        evaluate();
      }
      if ((I.args.save_strategy == "steps" && step % I.save_every == 0) ||
          (I.args.save_strategy == "epoch" && epoch_end)) {
        I.save_checkpoint();
      }
    }
  }

  TrainResult result;
  if (I.has_eval && I.last_eval_step != I.state.global_step) evaluate();
  result.eval_loss = I.last_eval_loss;
  if (I.args.load_best_model_at_end && I.state.best_model_checkpoint &&
      I.last_eval_loss != I.state.best_metric) {
    // The best checkpoint is read only from this run's output_dir, whatever the state file says.
    const std::optional<std::string> best = checkpoint_in(
        I.args.output_dir, fs::path(*I.state.best_model_checkpoint).filename().string());
    if (best) {
      if (I.rank == 0)
        log::info("loading the best checkpoint '{}' (eval_loss {:.4f})", *best,
                  *I.state.best_metric);
      load_engine_state(*I.engine, *best);
    } else if (I.rank == 0) {
      log::warn(
          "the best checkpoint '{}' is not a checkpoint folder in '{}'; the final weights stay "
          "those of the "
          "last step",
          *I.state.best_model_checkpoint, I.args.output_dir);
    }
  }
  bool available = false;
  auto weights = I.user_weights(available);
  LogRecord summary;
  summary.step = I.state.global_step;
  summary.epoch = I.epoch_progress();
  summary.train_loss =
      run_loss_steps > 0 ? run_loss_sum / static_cast<double>(run_loss_steps) : 0.0;
  summary.train_runtime = seconds_since(start);
  I.log(summary);
  on_every_rank(*I.comm, "writing the final model", [&] {
    if (I.rank != 0) return;
    fs::create_directories(I.args.output_dir);
    I.write_user_files(I.args.output_dir, available, weights);
    if (!available) {
      log::warn(
          "ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the final weights stay "
          "sharded; "
          "run `zerotrain merge {}/checkpoint-{} OUT` to consolidate them",
          I.args.output_dir, I.state.global_step);
    }
    files::write_atomic(I.args.output_dir + "/trainer_state.json",
                        train::trainer_state_json(I.state));
    files::write_atomic(I.args.output_dir + "/loss.svg", train::loss_svg(I.state.log_history));
  });
  if (!available &&
      !fs::exists(fmt::format("{}/checkpoint-{}", I.args.output_dir, I.state.global_step))) {
    I.save_checkpoint();  // the sharded state is then the final model
  }
  result.global_step = I.state.global_step;
  result.train_loss = *summary.train_loss;
  result.best_checkpoint = I.state.best_model_checkpoint;
  result.output_dir = I.args.output_dir;
  return result;
}

}  // namespace zt
