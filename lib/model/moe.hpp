// A sparse mixture of experts in a layer's MLP place (blocks.hpp's MoeSpec): the router, the
// token-expert pairs grouped by expert, the experts' grouped products forward and backward, and
// the weighted sum back into each token's row. Internal to lib/model/.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "model/blocks.hpp"
#include "model/layers.hpp"
#include "zerotrain/comm.hpp"

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

/// How rows grouped by expert (the token-expert pairs in a stable order by expert) split among
/// the experts. `ends()` is int32 [E] on the rows' device, each expert's end row (the running
/// sum of the counts): the GPU's grouped GEMM reads it there, so that a mixture's forward and
/// backward never wait for the host. `counts()` copies the counts to the host on its first call,
/// for the paths that loop over the experts (the CPU, and dtypes or shapes the grouped GEMM does
/// not take). Not thread-safe (that first copy).
class ExpertGroups {
 public:
  /// From each expert's row count, int64 [E], on any device.
  explicit ExpertGroups(const at::Tensor& counts);
  /// From host counts, `ends()` on `device`.
  explicit ExpertGroups(const std::vector<int64_t>& counts, const at::Device& device = at::kCPU);
  /// From `ends()` as another ExpertGroups made them (int32 [E]; an autograd node's saved copy).
  static ExpertGroups from_ends(const at::Tensor& ends);
  int64_t experts() const { return ends_.size(0); }
  const at::Tensor& ends() const { return ends_; }
  const std::vector<int64_t>& counts() const;

 private:
  at::Tensor ends_;
  mutable std::shared_ptr<std::vector<int64_t>> counts_;  // null until read
  ExpertGroups() = default;
};

/// Rows of `x` [M, in] grouped by expert: rows [start_e, start_e + counts[e]) times
/// weight[e]ᵀ, for `weight` [E, out, in] and `groups` the rows of each expert in order (summing
/// to M). Returns [M, out]. Backward gives x's gradient and weight's as one [E, out, in] tensor
/// (zeros where an expert had no rows), never a per-expert copy of the weight. On CUDA, with
/// bf16 operands whose sizes and strides the grouped GEMM takes (compat::has_grouped_mm: in, out
/// multiples of 8), one grouped GEMM per product forward and backward, no host sync; otherwise
/// one product per expert. `groups` are checked against the rows where their counts are on the
/// host.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const ExpertGroups& groups);
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::vector<int64_t>& counts);

/// grouped_linear over a frozen 4-bit weight: `storage` (quant::FourBitLayout with
/// `layout.groups` experts, its values [E, a, b]) dequantized for the product and again in
/// backward, which gives only x's gradient. `transposed`: the values are [E, in, out] (gpt-oss).
at::Tensor quantized_grouped_linear(const at::Tensor& x, const at::Tensor& storage,
                                    const quant::FourBitLayout& layout, bool transposed,
                                    const ExpertGroups& groups);

/// Whether parameter `name` is one of a mixture's expert tensors (`….experts.gate_up_proj`,
/// `….experts.down_proj` and their biases): the tensors expert parallelism shards by expert.
bool is_expert_tensor(std::string_view name);

/// `global`, which holds a model's full tensors, read as an expert-parallel model's parameters
/// (ModelConfig::expert_shard): an expert tensor asked with this rank's shape [E / size, ...]
/// reads its experts [rank · E / size, ...) of the full one; every other name as it is. Below any
/// quantizing source (it maps values, not 4-bit storage). Not thread-safe, as every source.
std::shared_ptr<ParameterSource> expert_shard_source(std::shared_ptr<ParameterSource> global,
                                                     const ModelConfig::ExpertShard& shard);

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
  /// grouped_linear's `groups`: [M, out], added to the base's.
  virtual at::Tensor forward(const at::Tensor& rows, const ExpertGroups& groups) const = 0;
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
/// Made with a ParamFactory's quantization (a 4-bit model) the two tensors are frozen uint8
/// storage (quant::FourBitLayout, `groups` the experts) of those values; biases stay as they are.
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
  /// Tensor i's 4-bit layout where the experts are 4-bit, else null.
  std::array<std::shared_ptr<const quant::FourBitLayout>, kTensors> quantized;

  MoeExperts(const MoeSpec& spec, int64_t hidden, const ParamFactory& o);
  /// Tensor `i` of kNames (its storage when 4-bit).
  at::Tensor& tensor(size_t i) { return i == 0 ? gate_up_proj : down_proj; }
  const at::Tensor& tensor(size_t i) const { return i == 0 ? gate_up_proj : down_proj; }
  /// Tensor i's values' shape as stored ([E, out, in], or [E, in, out] when transposed).
  std::vector<int64_t> shape(size_t i) const;
  /// The options of the values (the model's dtype where the tensors are 4-bit storage).
  at::TensorOptions value_options() const;
  /// grouped_linear of `rows` by tensor `i` (its bias added by `expert_of_row` [M], the expert
  /// of each row, where it has one), plus its adapter's share where one is active.
  at::Tensor project(size_t i, const at::Tensor& rows, const ExpertGroups& groups,
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
  /// spec.shard_size > 1: the communicator the rows travel over (CausalLM::
  /// set_expert_communicator); this rank holds spec.local_experts() of the experts.
  std::shared_ptr<Communicator> comm;
  /// The router registered as names.moe_router.
  SparseMoe(const MoeSpec& spec, int64_t hidden, const ParamFactory& o,
            const ModuleNames& names = {});
  /// x [..., hidden] → the weighted sum of each token's experts' outputs, same shape and dtype.
  /// Under expert parallelism a collective of the job (CausalLM::set_expert_communicator).
  at::Tensor forward(const at::Tensor& x);

 private:
  /// The experts' outputs for `rows` [P, hidden] grouped by expert (`counts` [experts] on the
  /// rows' device; `expert_of_row` [P] where the experts have biases): here, or under expert
  /// parallelism on the ranks that hold them. `beside` runs once, after the experts' compute:
  /// under expert parallelism while their outputs travel back (and, in backward, while their
  /// gradients travel out).
  at::Tensor expert_outputs(const at::Tensor& rows, const at::Tensor& counts,
                            const at::Tensor& expert_of_row, const std::function<void()>& beside);
  at::Tensor experts_across_ranks(const at::Tensor& rows, const at::Tensor& counts,
                                  const std::function<void()>& beside);
  /// gate_up, activation, down of rows grouped by this rank's experts.
  at::Tensor local_experts(const at::Tensor& rows, const ExpertGroups& groups,
                           const at::Tensor& expert_of_row);
};

}  // namespace zt::model
