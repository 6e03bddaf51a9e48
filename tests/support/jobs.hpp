// Small training jobs for the Trainer tests (CPU and GPU): a tiny model, a dataset whose loss
// falls, and the losses a run logged.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "zerotrain/model.hpp"

namespace zt::test {

/// An inline LLaMA config (vocab 259: the byte-level tokenizer), 2 layers, GQA.
extern const char* const kTinyModel;

/// Training flags of a run of kTinyModel on dir/train.jsonl into dir/out with the alpaca
/// template, then `settings`, then `extra` (a later flag wins).
std::vector<std::string> tiny_run_flags(const std::string& dir,
                                        const std::vector<std::string>& settings,
                                        const std::vector<std::string>& extra = {});

/// Writes `count` alpaca-style examples ("Is N even or odd?" → "odd" / "even", N from `salt`)
/// to dir/name and returns the path.
std::string write_data(const std::string& dir, const std::string& name, int count, int salt);
/// A model folder of random weights (config.json + safetensors) of `config_json` drawn from
/// `seed`, in `folder` (made when missing); returns its config.
ModelConfig write_model_folder(const std::string& folder, const std::string& config_json,
                               uint64_t seed);

/// A run of the trainer on `dir`/base (a model folder) with the tiny run's data flags, 2 rows a
/// step, learning rate 1e-2, then `settings` (a later flag wins); returns each step's loss.
std::vector<double> train_on_base(const std::string& dir, const std::vector<std::string>& settings);

/// The same task as preference pairs in LLaMA-Factory's alpaca layout: the right answer chosen,
/// the wrong one rejected. Returns the path.
std::string write_pairs(const std::string& dir, const std::string& name, int count, int salt);

/// The values of `key` out_dir/trainer_log.jsonl recorded, by step (the last record of a step
/// that has the key wins).
std::map<int64_t, double> logged(const std::string& out_dir, const std::string& key);

/// Training flags through one environment variable (a rank's ZT_FLAGS): joined with '\x1f'.
std::string join_flags(const std::vector<std::string>& flags);
std::vector<std::string> split_flags(const std::string& joined);

/// DeepSpeed JSON of a ZeRO stage with "auto" batch sizes and precision, `extra` appended inside
/// zero_optimization; fp16 starts at a loss scale of 2^8 (DeepSpeed's 2^16 would skip the tiny
/// model's first steps).
std::string stage_json(int stage, const std::string& extra = "");

/// `--deepspeed` with the ZeRO stage `kind` names: "0" … "3", or "3 offload" (stage 3 with
/// parameters and optimizer offloaded to the CPU); any other kind is stage 2. Under stage 3
/// every parameter of 10 elements or more is sharded and the 16-bit model gathered for saving
/// (the multi-rank trainer tests' runs).
std::vector<std::string> zero_stage_flags(const std::string& kind);

/// The training losses, by step.
inline std::map<int64_t, double> logged_losses(const std::string& out_dir) {
  return logged(out_dir, "loss");
}

}  // namespace zt::test
