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

/// transformers' load-balancing loss (load_balancing_loss_func) of one forward, gathered over
/// the mixture layers of a model: with C_e the top-k choices of expert e and P_e the sum of its
/// softmax probabilities over every sparse layer's real rows (padding excluded), and R the rows
/// counted, aux = E · Σ_e (C_e / R)(P_e / R). The counts come from the forward's first pass;
/// the gradient reaches each router inside its layer (`inject`), so a layer that activation
/// checkpointing or ZeRO-3 recomputes gets it from its recomputation: its value is
/// E · C_e / R² times the gradient the objective gives the loss (`finish`'s result), which that
/// result's backward records before any layer's runs (it is the graph's newest node). One
/// forward whose loss counts at a time, its backward before the next; not thread-safe.
class RouterBalance {
 public:
  /// Starts a forward whose loss counts: `row_weights` [rows] fp32 (1 real, 0 padding), or
  /// undefined when every row is real.
  void begin(const at::Tensor& row_weights);
  /// In a sparse layer: adds the layer's choices to the counts in the forward's first pass, and
  /// where gradients are recorded (that pass without recomputation, or the recomputation)
  /// returns `scores` [rows, k] through a node that gives the layer's router its share of the
  /// loss's gradient; otherwise `scores` as they are.
  at::Tensor observe(const at::Tensor& logits, const at::Tensor& selected,
                     const at::Tensor& scores);
  /// Ends the forward: the loss, an fp32 scalar whose backward seeds the routers' gradients;
  /// undefined when no sparse layer ran.
  at::Tensor finish();

 private:
  bool open_ = false;   // inside begin .. finish
  bool armed_ = false;  // finish ran: the recomputations of its backward may come
  int64_t experts_ = 0;
  at::Tensor row_weights_, counts_, probs_, rows_;
  at::Tensor seed_;  // ∂ objective / ∂ aux, from finish's node
  friend class BalanceLossFunction;
  friend class BalanceGradientFunction;
};

/// The mixture: `gate` (the router) and `experts` under the layer's `mlp`.
struct SparseMoe : torch::nn::Module {
  std::shared_ptr<MoeRouter> gate;
  std::shared_ptr<MoeExperts> experts;
  MoeSpec spec;
  /// Set (by the model, when its config asks for the load-balancing loss): where this layer's
  /// routing is counted.
  std::shared_ptr<RouterBalance> balance;
  SparseMoe(const MoeSpec& spec, int64_t hidden, const ParamFactory& o);
  /// x [..., hidden] → the weighted sum of each token's experts' outputs, same shape and dtype.
  at::Tensor forward(const at::Tensor& x);
};

}  // namespace zt::model
