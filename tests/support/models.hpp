// Small models for engine tests: an MLP classifier and a two-block causal transformer, both
// routing their layers through a UnitGate, plus deterministic data with ignored labels.
#pragma once

#include <torch/nn/module.h>

#include <memory>

#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"

namespace zt::test {

/// A model that computes the summed token loss of a batch and counts its tokens.
struct TestModel : torch::nn::Module {
  UnitGate gate;
  /// The gate the model routes its units through (a wrapped model may own another).
  virtual UnitGate& unit_gate() { return gate; }
  /// Summed cross-entropy over labels != -100 (the HF ≥ 4.46 numerator).
  virtual at::Tensor loss_sum(const at::Tensor& inputs, const at::Tensor& labels) = 0;
  virtual std::vector<UnitSpec> units() = 0;
};

/// Builds model "mlp", "wide", "transformer", "llm" or "llm_tied" (zt::CausalLM: a tiny LLaMA,
/// with untied or tied embeddings) with
/// parameters drawn from `seed`.
std::shared_ptr<TestModel> make_model(const std::string& kind, uint64_t seed);

/// A tiny Qwen3-MoE config.json (2 layers, hidden 32) with `experts` experts, 2 per token.
std::string tiny_moe_config(int experts);

/// One micro-batch: inputs and labels (some -100) for sample indices [first, first + count).
struct Batch {
  at::Tensor inputs, labels;
  bool causal_shift = false;  ///< the model predicts label t+1 at position t (causal LMs)
  int64_t tokens() const;     ///< the labels the loss counts
};
Batch make_batch(const std::string& kind, int64_t step, int64_t first, int64_t count);

/// Every member of two RoPE scalings is the same.
void check_same_scaling(const RopeScaling& got, const RopeScaling& want);

/// Checks (Catch CHECKs) that two configs state the same model: every member a family decides,
/// RoPE scaling included, and the parameter count; the dtype too unless `same_dtype` is false
/// (a config written in another dtype).
void check_same_model(const ModelConfig& got, const ModelConfig& want, bool same_dtype = true);

/// The losses of `steps` steps of `model`, an adapter over a base the engine reads from
/// `source`, at this rank of `comm`: ZeRO `setting` "0" … "3" or "3 offload" (offload_param),
/// a setting holding "hpz" / "mics" with zero_hpz_partition_size / mics_shard_size half the world,
/// "qw" / "qg" with zero_quantized_weights / zero_quantized_gradients,
/// AdamW at a constant 0.01, clipping 1.0; each the global mean over a batch of 4 rows — the
/// tiny llama fixture's 2 and the same rolled by 5 — split by rank. The adapters' tests at
/// world 1, 2 and 4 compare these.
std::vector<double> fixture_batch_losses(const std::shared_ptr<Communicator>& comm,
                                         const std::shared_ptr<CausalLM>& model,
                                         std::shared_ptr<ParameterSource> source,
                                         const std::string& setting, int steps);

}  // namespace zt::test
