// A sparse mixture of experts in a layer's MLP place (blocks.hpp's MoeSpec): the router, the
// token-expert pairs grouped by expert, the experts' grouped products forward and backward, and
// the weighted sum back into each token's row. Internal to lib/model/.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "model/blocks.hpp"
#include "model/layers.hpp"

namespace zt::model {

/// Each token's experts and their weights from the router's logits [N, experts] (any dtype):
/// softmax over all experts in fp32, the top k (ties to the lower index, as torch.topk), and
/// with `normalize` divided by their sum. `experts` [N, k] int64 always lies in [0, experts),
/// whatever the logits hold (NaN included); `weights` [N, k] fp32 carries the gradient to the
/// logits, as transformers' Qwen3MoeTopKRouter.
struct Routing {
  at::Tensor experts, weights;
};
Routing route_top_k(const at::Tensor& logits, int64_t top_k, bool normalize);

/// Rows of `x` [M, in] grouped by expert: rows [start_e, start_e + counts[e]) times
/// weight[e]ᵀ, for `weight` [E, out, in] and `counts` the rows of each expert in order (summing
/// to M). Returns [M, out]. Backward gives x's gradient and weight's as one [E, out, in] tensor
/// (zeros where an expert had no rows), never a per-expert copy of the weight.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::vector<int64_t>& counts);

/// The router: one parameter `weight` [experts, hidden] (transformers 5's TopKRouter).
struct MoeRouter : torch::nn::Module {
  at::Tensor weight;
  MoeRouter(int64_t experts, int64_t hidden, const ParamFactory& o) {
    weight = register_parameter("weight", o({experts, hidden}));
  }
};

/// The experts' fused weights: `gate_up_proj` [experts, 2·intermediate, hidden] (gate rows
/// first) and `down_proj` [experts, hidden, intermediate], transformers 5's names.
struct MoeExperts : torch::nn::Module {
  at::Tensor gate_up_proj, down_proj;
  MoeExperts(const MoeSpec& spec, int64_t hidden, const ParamFactory& o) {
    gate_up_proj =
        register_parameter("gate_up_proj", o({spec.experts, 2 * spec.intermediate, hidden}));
    down_proj = register_parameter("down_proj", o({spec.experts, hidden, spec.intermediate}));
  }
};

/// The mixture: `gate` (the router) and `experts` under the layer's `mlp`.
struct SparseMoe : torch::nn::Module {
  std::shared_ptr<MoeRouter> gate;
  std::shared_ptr<MoeExperts> experts;
  MoeSpec spec;
  SparseMoe(const MoeSpec& spec, int64_t hidden, const ParamFactory& o);
  /// x [..., hidden] → the weighted sum of each token's experts' outputs, same shape and dtype.
  at::Tensor forward(const at::Tensor& x);
};

}  // namespace zt::model
