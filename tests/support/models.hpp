// Small models for engine tests: an MLP classifier and a two-block causal transformer, both
// routing their layers through a UnitGate, plus deterministic data with ignored labels.
#pragma once

#include <torch/nn/module.h>

#include <memory>

#include "zerotrain/engine.hpp"

namespace zt::test {

/// A model that computes the summed token loss of a batch and counts its tokens.
struct TestModel : torch::nn::Module {
  UnitGate gate;
  /// Summed cross-entropy over labels != -100 (the HF ≥ 4.46 numerator).
  virtual at::Tensor loss_sum(const at::Tensor& inputs, const at::Tensor& labels) = 0;
  virtual std::vector<UnitSpec> units() = 0;
};

/// Builds model "mlp", "wide" or "transformer" with parameters drawn from `seed`.
std::shared_ptr<TestModel> make_model(const std::string& kind, uint64_t seed);

/// One micro-batch: inputs and labels (some -100) for sample indices [first, first + count).
struct Batch {
  at::Tensor inputs, labels;
  int64_t tokens() const;
};
Batch make_batch(const std::string& kind, int64_t step, int64_t first, int64_t count);

}  // namespace zt::test
