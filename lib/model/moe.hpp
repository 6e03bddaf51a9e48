// A sparse mixture of experts in a layer's MLP place (blocks.hpp's MoeSpec): the router, the
// token-expert pairs grouped by expert, the experts' grouped products forward and backward, and
// the weighted sum back into each token's row. Internal to lib/model/.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string_view>
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

/// MoeSpec::Router::kSigmoidGroups' routing of fp32 `logits` [N, experts] with the router's
/// `correction` [experts] (transformers' Glm4MoeTopkRouter): `experts` always in range (NaN
/// logits included), `weights` fp32 with the gradient to the logits.
Routing route_sigmoid_groups(const at::Tensor& logits, const at::Tensor& correction,
                             const MoeSpec& spec);

/// gpt-oss's routing of `logits` [N, experts] (its router's, with the bias): the top_k logits,
/// their softmax (in the logits' dtype) the weights; `experts` always in range.
Routing route_softmax_of_top_k(const at::Tensor& logits, int64_t top_k);

/// gpt-oss's activation of the experts' gate_up output [M, 2I], gate and up interleaved (even
/// columns gate): (clamp(up, ±limit) + 1) · g · σ(alpha · g), g = min(gate, limit). [M, I].
at::Tensor clamped_swiglu_interleaved(const at::Tensor& gate_up, const MoeSpec& spec);

/// Whether parameter `name` is one no fine-tuning method trains (a router's
/// e_score_correction_bias, which DeepSeek-V3's recipe updates by its own rule and transformers
/// keeps as a buffer): apply_peft leaves these frozen whatever the method asks.
bool is_fixed_parameter(std::string_view name);

/// Rows of `x` [M, in] grouped by expert: rows [start_e, start_e + counts[e]) times
/// weight[e]ᵀ, for `weight` [E, out, in] and `counts` the rows of each expert in order (summing
/// to M). Returns [M, out]. Backward gives x's gradient and weight's as one [E, out, in] tensor
/// (zeros where an expert had no rows), never a per-expert copy of the weight.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::vector<int64_t>& counts);

/// The router: one parameter `weight` [experts, hidden] (transformers 5's TopKRouter). A
/// projection, so that LoRA can adapt it where PEFT does (`gate.weight` in target_parameters,
/// which PEFT's conversion for transformers 5 puts there: lib/peft/fused_experts.hpp), but not
/// one that all-linear takes (transformers 5's router is no nn.Linear), and never 4-bit.
struct MoeRouter : Linear {
  /// kSigmoidGroups: `e_score_correction_bias` [experts], frozen (is_fixed_parameter); held in
  /// the model's dtype, as DeepSpeed's engine casts transformers' fp32 buffer.
  at::Tensor correction;
  MoeRouter(const MoeSpec& spec, int64_t hidden, const ParamFactory& o)
      : Linear(hidden, spec.experts, spec.router_bias, ParamFactory{o.options, o.allocate}) {
    if (spec.router == MoeSpec::Router::kSigmoidGroups)
      correction = register_parameter("e_score_correction_bias", o({spec.experts}));
  }
};

/// What an adapter method adds to one of the experts' fused tensors [E, out, in] (PEFT's LoRA
/// through target_parameters: lib/peft/expert_lora.hpp implements it; the model only calls it).
/// It registers its parameters on the MoeExperts it adapts, under PEFT's names. Called from the
/// thread running the model.
class ExpertAdapter {
 public:
  virtual ~ExpertAdapter() = default;
  /// The adapter's share of the grouped product of `rows` [M, in], grouped by expert as
  /// grouped_linear's `counts`: [M, out], added to the base's.
  virtual at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts) const = 0;
  /// Folds the adapter into `weight`, the tensor's values as fp32 [E, out, in], in place
  /// (merge_lora), and takes it out again (after merge_into of the same weight).
  virtual void merge_into(at::Tensor& weight) const = 0;
  virtual void unmerge_from(at::Tensor& weight) const = 0;
};

/// The experts' fused weights: `gate_up_proj` [experts, 2·intermediate, hidden] (gate rows
/// first) and `down_proj` [experts, hidden, intermediate], transformers 5's names, registered
/// in that order (the order PEFT nests its wrappers in), each with an optional adapter. With
/// spec.transposed (gpt-oss) they are [experts, in, out]; with spec.expert_bias they have
/// `gate_up_proj_bias` [experts, 2·intermediate] and `down_proj_bias` [experts, hidden].
struct MoeExperts : torch::nn::Module {
  static constexpr size_t kTensors = 2;
  /// The tensors' names, in registration order.
  static constexpr const char* kNames[kTensors] = {"gate_up_proj", "down_proj"};
  at::Tensor gate_up_proj, down_proj;
  at::Tensor gate_up_proj_bias, down_proj_bias;  ///< spec.expert_bias only
  bool transposed = false;
  /// One tensor's adapter (peft's attach), as model::Linear keeps its own: `merged` folded into
  /// the tensor (merge_lora), `disabled` while the model's adapters are off.
  struct Adapted {
    std::shared_ptr<const ExpertAdapter> adapter;
    bool merged = false, disabled = false;
  };
  std::array<Adapted, kTensors> adapted;

  MoeExperts(const MoeSpec& spec, int64_t hidden, const ParamFactory& o)
      : transposed(spec.transposed) {
    const int64_t e = spec.experts, i = spec.intermediate;
    gate_up_proj = register_parameter("gate_up_proj",
                                      transposed ? o({e, hidden, 2 * i}) : o({e, 2 * i, hidden}));
    if (spec.expert_bias)
      gate_up_proj_bias = register_parameter("gate_up_proj_bias", o({e, 2 * i}));
    down_proj = register_parameter("down_proj", transposed ? o({e, i, hidden}) : o({e, hidden, i}));
    if (spec.expert_bias) down_proj_bias = register_parameter("down_proj_bias", o({e, hidden}));
  }
  /// Tensor `i` of kNames.
  at::Tensor& tensor(size_t i) { return i == 0 ? gate_up_proj : down_proj; }
  /// grouped_linear of `rows` by tensor `i` (its bias added by `expert_of_row` [M], the expert
  /// of each row, where it has one), plus its adapter's share where one is active.
  at::Tensor project(size_t i, const at::Tensor& rows, const std::vector<int64_t>& counts,
                     const at::Tensor& expert_of_row = {});
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

/// The mixture: `gate` (the router), `experts` and, where the spec has one, `shared_experts`
/// under the layer's `mlp`.
struct SparseMoe : torch::nn::Module {
  std::shared_ptr<MoeRouter> gate;
  std::shared_ptr<MoeExperts> experts;
  std::shared_ptr<Mlp> shared_experts;
  MoeSpec spec;
  /// Set (by the model, when its config asks for the load-balancing loss): where this layer's
  /// routing is counted.
  std::shared_ptr<RouterBalance> balance;
  /// The router registered as names.moe_router.
  SparseMoe(const MoeSpec& spec, int64_t hidden, const ParamFactory& o,
            const ModuleNames& names = {});
  /// x [..., hidden] → the weighted sum of each token's experts' outputs, same shape and dtype.
  at::Tensor forward(const at::Tensor& x);
};

}  // namespace zt::model
