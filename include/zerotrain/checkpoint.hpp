// Training checkpoints: `output_dir/checkpoint-<step>/` folders written atomically, the
// `output_dir/latest` pointer, rotation, and the engine's sharded optimizer state in a layout
// that any world size can read back.
//
// On disk (docs/checkpoints.md has the full description):
//   checkpoint-<step>/layout.json                          state kinds, parameters, shard files
//   checkpoint-<step>/optimizer/rank-<r>-of-<w>.safetensors  rank r's pieces: "<kind>/<name>"
//   checkpoint-<step>/trainer_state.json, adapter or HF weights (written by the trainer)
//
// Collective-ness: CheckpointWriter's constructor and commit(), save_engine_state and
// load_engine_state are collectives over the engine's communicator. Threading: one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/comm.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"

namespace zt {

/// A complete checkpoint folder of a run.
struct CheckpointInfo {
  std::string path;
  int64_t step = 0;
};

/// Complete checkpoints under `output_dir` (folders named checkpoint-<digits>, not links),
/// oldest first. Temporary folders of an interrupted save never match; a step too large for
/// int64 is warned about and skipped.
std::vector<CheckpointInfo> list_checkpoints(const std::string& output_dir);

/// The newest complete checkpoint: the one `output_dir/latest` names when that folder exists,
/// else the highest step; none when there is no checkpoint. Only real checkpoint-<step>
/// folders count (`latest` naming "..", another path or a link is warned about and ignored).
std::optional<std::string> latest_checkpoint(const std::string& output_dir);

/// `output_dir`/`name` when `name` is a checkpoint-<step> folder there (a real folder, not a
/// link); nullopt otherwise. For names read from files (latest, best_model_checkpoint).
std::optional<std::string> checkpoint_in(const std::string& output_dir, const std::string& name);

/// Writes one checkpoint atomically. The constructor prepares a temporary folder (a name that
/// never matches checkpoint-<digits>) that every rank writes into; commit() renames it to
/// checkpoint-<step> once every rank has succeeded, then updates `latest` and rotates. A run
/// killed in between leaves earlier checkpoints and `latest` untouched.
class CheckpointWriter {
 public:
  /// Collective. An existing checkpoint-<step> is an IoError (it is never overwritten) unless
  /// `replace` (overwrite_output_dir): then the old folder is removed when the new one commits.
  CheckpointWriter(Communicator& comm, const std::string& output_dir, int64_t step,
                   bool replace = false);
  /// A checkpoint at a folder of the caller's choosing (written atomically the same way, but
  /// outside a run's output_dir: no `latest`, no rotation). Collective.
  static CheckpointWriter to_folder(Communicator& comm, const std::string& dir,
                                    bool replace = false);
  /// The temporary folder to write into.
  const std::string& dir() const { return tmp_; }
  /// Collective: `ok` is this rank's verdict on its own writes (false after a caught error).
  /// When any rank reports failure, the temporary folder is removed and an IoError naming the
  /// failing ranks is thrown on every rank. Otherwise the folder is renamed into place,
  /// `latest` is rewritten, and with `total_limit` the oldest checkpoints beyond it are
  /// deleted — never `keep` (the best checkpoint) and never the new one. Returns the final path.
  std::string commit(bool ok, std::optional<int64_t> total_limit = std::nullopt,
                     const std::string& keep = "");

 private:
  CheckpointWriter(Communicator& comm, std::string parent, std::string tmp, std::string final_dir,
                   bool replace, bool run_folder);

  Communicator& comm_;
  std::string output_dir_, tmp_, final_;
  bool replace_ = false;
  bool run_folder_ = true;  ///< checkpoint-<step> of a run: maintain `latest` and rotation
};

/// Writes the engine's optimizer state (fp32 masters and moments of the trainable parameters)
/// and its counters into `dir`: every rank its own shard file, rank 0 layout.json. Returns the
/// save's id, which layout.json and every shard file carry (readers refuse a checkpoint whose
/// pieces carry different ids, or whose pieces overlap). Collective; throws on every rank when
/// any rank failed (naming it).
std::string save_engine_state(Engine& engine, const std::string& dir);

/// The save id layout.json in `dir` carries ("" for checkpoints written before save ids).
std::string checkpoint_save_id(const std::string& dir);

/// Reads state written by save_engine_state — at any world size and ZeRO stage — into the
/// engine, with its counters. The checkpoint must hold exactly the engine's trainable
/// parameters with the same shapes, else ConfigError naming the first difference. Collective.
void load_engine_state(Engine& engine, const std::string& dir);

/// The counters save_engine_state recorded in `dir`.
EngineState read_engine_state(const std::string& dir);

/// The trainable parameters a checkpoint's layout.json lists, with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> checkpoint_parameters(
    const std::string& dir);

/// A ParameterSource over a checkpoint's fp32 masters: full values of its trainable
/// parameters assembled from every rank's shard file (for merge and export).
std::shared_ptr<ParameterSource> checkpoint_master_source(const std::string& dir);

/// A shared lock on a folder being read — a checkpoint or a run's output folder — held while
/// the object lives: checkpoint rotation skips a checkpoint so held, and a folder a running job
/// holds (its output_dir) cannot be read as finished (IoError naming the holder). A folder this
/// process cannot write into is read without a lock. Used by merge_checkpoint and `verify`.
class ReadLock {
 public:
  explicit ReadLock(const std::string& folder);

 private:
  std::shared_ptr<void> held_;
};

struct MergeOptions {
  /// The base model folder: required for LoRA checkpoints whose adapter names none and for
  /// Freeze checkpoints (their frozen weights are not in the checkpoint).
  std::string base_model;
  /// The output dtype; default: the model's own (its config.json dtype).
  std::optional<at::ScalarType> dtype;
  int64_t max_shard_bytes = 5000000000;
  /// A ChatGLM2/3 model written as transformers' `glm` (GlmForCausalLM: q/k/v split out of
  /// query_key_value, HF names, a glm config.json) instead of in ChatGLM's own layout. Any
  /// other model type is a ConfigError.
  bool as_glm = false;
};

struct MergeReport {
  std::vector<std::string> files;  ///< safetensors shards and index, config.json
  int64_t tensors = 0;
  int64_t largest_tensor_bytes = 0;  ///< in the output dtype
  int64_t peak_rss_anon_bytes = 0;   ///< growth of anonymous resident memory while merging
};

/// Consolidates a zerotrain checkpoint — or a run's final output folder (PEFT adapter files, or
/// an HF model folder) — into an HF model folder at `out_dir` (which must not exist or be
/// empty): a checkpoint's fp32 masters from every rank's shard file, or the folder's own
/// tensors — LoRA folded into the base weights (W + B·A·scaling) for adapters, whose base is
/// `options.base_model` or the adapter's base_model_name_or_path (adapter_base_model) — written
/// as model.safetensors or model-0000k-of-0000n.safetensors + index, with config.json and the
/// tokenizer and generation files. It streams tensor by tensor, so memory stays near the largest
/// tensor. Prompt adapters (P-Tuning, prefix) have no weights to fold in: a ConfigError. Not
/// collective.
MergeReport merge_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                             const MergeOptions& options = {});

/// The model a run trained, rebuilt from a folder it wrote (its output_dir, a checkpoint-<step>
/// folder with adapter files, or an HF model folder) as the run trained it: for an adapter, its
/// base as the run recorded it in training_args.json — a 4-bit base dequantized to the values
/// the adapter was trained over, PiSSA's residual from the starting factors the run saved
/// (pissa_init/) — with the adapter's trained values. fp32 on the CPU, in eval mode.
struct TrainedModel {
  std::shared_ptr<CausalLM> model;
  std::string base_dir;  ///< the base model's folder (the folder itself for a whole model)
  bool adapter = false;  ///< an adapter folder (LoRA, P-Tuning, prefix) over base_dir
  std::optional<QuantizationConfig> quantization;  ///< the 4-bit base it trained over, if any
  /// The model the run started from: `start_adapters_off` (the adapters switched off) with the
  /// trainable values `start` swapped in (swap_parameter_values) — a new LoRA / DoRA adapter is
  /// the base with its adapters off; PiSSA's start is its saved factors over the residual, a
  /// continued adapter's the adapter it continued, a prompt adapter's its first virtual tokens
  /// (from the recorded seed); a trained bias or module to save starts as the base has it.
  bool start_adapters_off = false;
  std::vector<std::pair<std::string, at::Tensor>> start;
  std::string start_description;  ///< what the start is, for messages
};

/// load_trained_model's answer for `dir`; `base_model`, when given, replaces the adapter's
/// base_model_name_or_path. IoError / ConfigError naming the file for a folder that is none of
/// these or whose files disagree with the base. Not collective; the caller owns the model.
TrainedModel load_trained_model(const std::string& dir, const std::string& base_model = "");

/// Exchanges the values of `model`'s parameters named in `values` with those tensors (same
/// shapes): called twice, everything is as it was. InvalidArgument naming a parameter the model
/// lacks or one of another shape.
void swap_parameter_values(torch::nn::Module& model,
                           std::vector<std::pair<std::string, at::Tensor>>& values);

}  // namespace zt
