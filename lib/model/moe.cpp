// See moe.hpp. The CPU path multiplies each expert's rows in turn; the pairs are grouped by
// expert first, so each expert's rows are one contiguous block and each token's outputs are
// summed in ascending expert order, as transformers' loop over the experts hit sums them.
#include "model/moe.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <limits>
#include <tuple>

#include "model/exchange.hpp"
#include "util/torch_compat.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/units.hpp"

namespace zt::model {

namespace {

// Whether the grouped GEMM takes `m` as one of its operands: 16-byte aligned data and a unit
// stride in one of its last two dimensions with the other a multiple of 16 bytes.
bool grouped_operand(const at::Tensor& m) {
  const int64_t d = m.dim(), unit = 16 / static_cast<int64_t>(m.element_size());
  if (reinterpret_cast<uintptr_t>(m.data_ptr()) % 16 != 0) return false;
  const int64_t rows = m.stride(d - 2), cols = m.stride(d - 1);
  return (cols == 1 && rows % unit == 0 && rows >= m.size(d - 1)) ||
         (rows == 1 && cols % unit == 0 && cols >= m.size(d - 2));
}

// Whether x [M, in] · weight[e]ᵀ (weight [E, out, in]) runs as grouped GEMMs forward and
// backward: CUDA, bf16 (the CUTLASS kernel's dtype), in and out multiples of 8.
bool grouped_gemm_applies(const at::Tensor& x, const at::Tensor& weight) {
  if (!compat::has_grouped_mm() || !x.is_cuda() || x.scalar_type() != at::kBFloat16 ||
      weight.scalar_type() != at::kBFloat16 || x.size(0) == 0) {
    return false;
  }
  return weight.size(1) % 8 == 0 && weight.size(2) % 8 == 0 && grouped_operand(weight) &&
         grouped_operand(weight.transpose(1, 2));
}

// f(e, start, n) for each expert e with n > 0 rows, from row `start` (the per-expert loop).
template <typename F>
void each_expert(const ExpertGroups& groups, F&& f) {
  int64_t start = 0;
  const std::vector<int64_t>& counts = groups.counts();
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    f(static_cast<int64_t>(e), start, counts[e]);
    start += counts[e];
  }
}

// The products both functions below share. `grouped`: by grouped GEMMs on `ends`, else one
// product per expert on the host counts.
at::Tensor grouped_forward(const at::Tensor& x, const at::Tensor& weight, const ExpertGroups& g,
                           bool grouped) {
  if (grouped) return compat::grouped_mm(x, weight.transpose(1, 2), g.ends());
  at::Tensor out = at::empty({x.size(0), weight.size(1)}, x.options());
  each_expert(g, [&](int64_t e, int64_t start, int64_t n) {
    at::Tensor rows = out.narrow(0, start, n);
    at::mm_out(rows, x.narrow(0, start, n), weight.select(0, e).t());
  });
  return out;
}

at::Tensor grouped_input_grad(const at::Tensor& g, const at::Tensor& weight,
                              const ExpertGroups& groups, bool grouped) {
  if (grouped) return compat::grouped_mm(g, weight, groups.ends());
  at::Tensor dx = at::empty({g.size(0), weight.size(2)}, g.options());
  each_expert(groups, [&](int64_t e, int64_t start, int64_t n) {
    at::Tensor rows = dx.narrow(0, start, n);
    at::mm_out(rows, g.narrow(0, start, n), weight.select(0, e));
  });
  return dx;
}

at::Tensor grouped_weight_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
                               const ExpertGroups& groups, bool grouped) {
  if (grouped) {
    // An expert without rows gets zeros, whatever the kernel leaves in its empty product.
    const at::Tensor& ends = groups.ends();
    const at::Tensor empty =
        at::diff(ends, 1, 0, at::zeros({1}, ends.options())).eq(0).view({-1, 1, 1});
    // In the weight's own layout: a [E, in, out] tensor's view gets its [E, in, out] gradient.
    if (weight.stride(1) == 1) {
      return compat::grouped_mm(x.t(), g, ends).masked_fill_(empty, 0).transpose(1, 2);
    }
    return compat::grouped_mm(g.t(), x, ends).masked_fill_(empty, 0);
  }
  at::Tensor dw = at::zeros_like(weight);
  each_expert(groups, [&](int64_t e, int64_t start, int64_t n) {
    at::Tensor slice = dw.select(0, e);
    at::mm_out(slice, g.narrow(0, start, n).t(), x.narrow(0, start, n));
  });
  return dw;
}

// ExpertGroups through an autograd context: its ends, and its host counts where they were read.
void keep_groups(torch::autograd::AutogradContext* ctx, const ExpertGroups& g) {
  ctx->saved_data["ends"] = g.ends();
}
ExpertGroups groups_of(torch::autograd::AutogradContext* ctx) {
  return ExpertGroups::from_ends(ctx->saved_data["ends"].toTensor());
}

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                            const at::Tensor& weight, const ExpertGroups& groups) {
    const at::Tensor x = x_in.contiguous();
    const bool grouped = grouped_gemm_applies(x, weight);
    ctx->save_for_backward({x, weight});
    keep_groups(ctx, groups);
    ctx->saved_data["grouped"] = grouped;
    return grouped_forward(x, weight, groups, grouped);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0], weight = saved[1];
    const bool grouped = ctx->saved_data["grouped"].toBool();
    const ExpertGroups groups = groups_of(ctx);
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = grouped_input_grad(g, weight, groups, grouped);
    if (ctx->needs_input_grad(1)) dw = grouped_weight_grad(g, x, weight, groups, grouped);
    return {dx, dw, at::Tensor()};
  }
};

// The values of 4-bit expert storage as [E, out, in] (a view of [E, in, out] when transposed).
at::Tensor expert_values(const at::Tensor& storage, const quant::FourBitLayout& layout,
                         bool transposed, at::ScalarType dtype) {
  const at::Tensor w = quant::dequantize_weight(layout, storage, dtype).view(layout.value_shape());
  return transposed ? w.transpose(1, 2) : w;
}

class QuantizedGroupedLinearFunction
    : public torch::autograd::Function<QuantizedGroupedLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                            const at::Tensor& storage, const std::vector<int64_t>& layout_numbers,
                            bool transposed, const ExpertGroups& groups) {
    const at::Tensor x = x_in.contiguous();
    const quant::FourBitLayout layout = quant::layout_from_numbers(layout_numbers);
    const at::Tensor w = expert_values(storage, layout, transposed, x.scalar_type());
    const bool grouped = grouped_gemm_applies(x, w);
    ctx->save_for_backward({storage});
    keep_groups(ctx, groups);
    ctx->saved_data["layout"] = layout_numbers;
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["grouped"] = grouped;
    return grouped_forward(x, w, groups, grouped);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor storage = ctx->get_saved_variables()[0];
    const quant::FourBitLayout layout =
        quant::layout_from_numbers(ctx->saved_data["layout"].toIntVector());
    const at::Tensor g = grads[0].contiguous();
    const at::Tensor w =
        expert_values(storage, layout, ctx->saved_data["transposed"].toBool(), g.scalar_type());
    const at::Tensor dx =
        grouped_input_grad(g, w, groups_of(ctx), ctx->saved_data["grouped"].toBool());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The RouterBalance a node serves, kept in its context (the model owns it, so it outlives
// every backward).
void keep_balance(torch::autograd::AutogradContext* ctx, RouterBalance* balance) {
  ctx->saved_data["balance"] = reinterpret_cast<int64_t>(balance);
}

RouterBalance& balance_of(torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<RouterBalance*>(ctx->saved_data["balance"].toInt());
}

}  // namespace

// The loss's node: its backward records the objective's gradient for the routers' nodes.
class BalanceLossFunction : public torch::autograd::Function<BalanceLossFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& anchor,
                            const at::Tensor& value, RouterBalance* balance) {
    (void)anchor;
    keep_balance(ctx, balance);
    return value.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    balance_of(ctx).seed_ = grads[0].detach().to(at::kFloat).reshape({});
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// In a sparse layer: the scores pass through; the layer's probability sums P_e get the loss's
// gradient, seed · E · C_e / R².
class BalanceGradientFunction : public torch::autograd::Function<BalanceGradientFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores,
                            const at::Tensor& probs, RouterBalance* balance) {
    (void)probs;
    keep_balance(ctx, balance);
    return scores.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const RouterBalance& b = balance_of(ctx);
    at::Tensor probs_grad;
    // No seed: the objective left the loss out (its gradient is zero).
    if (b.seed_.defined()) {
      probs_grad = b.counts_ * (b.seed_ * static_cast<double>(b.experts_) / (b.rows_ * b.rows_));
    }
    return {grads[0], probs_grad, at::Tensor()};
  }
};

void RouterBalance::begin(const at::Tensor& row_weights) {
  open_ = true;
  armed_ = false;
  experts_ = 0;
  row_weights_ = row_weights.defined() ? row_weights.to(at::kFloat).reshape({-1}) : at::Tensor();
  counts_ = probs_ = rows_ = seed_ = at::Tensor();
}

at::Tensor RouterBalance::observe(const at::Tensor& logits, const at::Tensor& selected,
                                  const at::Tensor& scores) {
  const bool recomputing = recomputing_for_backward();
  if (!(open_ && !recomputing) && !(armed_ && recomputing)) return scores;
  // transformers' softmax in the logits' dtype, summed in fp32, rows weighted by the mask: the
  // layer's P_e, with a graph where gradients are recorded.
  const at::Tensor soft = at::softmax(logits, -1);
  const at::Tensor probs = soft.to(at::kFloat);
  const at::Tensor& w = row_weights_;
  if (w.defined() && w.size(0) != probs.size(0)) {
    throw InvalidArgument(
        fmt::format("RouterBalance: {} row weights for {} rows", w.size(0), probs.size(0)));
  }
  const at::Tensor p = (w.defined() ? probs * w.unsqueeze(1) : probs).sum(0);
  if (open_ && !recomputing) {
    at::NoGradGuard no_grad;
    const int64_t experts = logits.size(-1);
    if (experts_ != 0 && experts_ != experts) {
      throw InvalidArgument(
          fmt::format("RouterBalance: layers of {} and {} experts", experts_, experts));
    }
    experts_ = experts;
    // transformers' own top-k of those probabilities (the router's, but for ties in a
    // 16-bit dtype).
    const at::Tensor chosen = std::get<1>(at::topk(soft, selected.size(-1), -1));
    const at::Tensor per_choice = w.defined() ? w.repeat_interleave(chosen.size(-1))
                                              : at::ones({chosen.numel()}, probs.options());
    const at::Tensor c =
        at::zeros({experts}, probs.options()).scatter_add_(0, chosen.reshape({-1}), per_choice);
    const at::Tensor r =
        w.defined() ? w.sum()
                    : at::scalar_tensor(static_cast<double>(probs.size(0)), probs.options());
    counts_ = counts_.defined() ? counts_ + c : c;
    probs_ = probs_.defined() ? probs_ + p.detach() : p.detach();
    rows_ = rows_.defined() ? rows_ + r : r;
  }
  if (!at::GradMode::is_enabled() || !logits.requires_grad()) return scores;
  return BalanceGradientFunction::apply(scores, p, this);
}

at::Tensor RouterBalance::finish() {
  open_ = false;
  if (!counts_.defined()) return at::Tensor();
  armed_ = true;
  const at::Tensor value =
      (counts_ * probs_).sum() * static_cast<double>(experts_) / (rows_ * rows_);
  // A leaf that requires grad puts the loss's node in the graph.
  const at::Tensor anchor = at::zeros({}, value.options()).requires_grad_(true);
  return BalanceLossFunction::apply(anchor, value, this);
}

Routing route_top_k(const at::Tensor& logits, int64_t top_k, bool normalize) {
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  at::Tensor weights, experts;
  std::tie(weights, experts) = at::topk(probs, top_k, -1);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return {experts, weights};
}

ExpertGroups::ExpertGroups(const at::Tensor& counts)
    : ends_(counts.to(at::kLong).cumsum(0).to(at::kInt)) {}

ExpertGroups::ExpertGroups(const std::vector<int64_t>& counts, const at::Device& device)
    : ExpertGroups(at::tensor(counts, at::kLong).to(device)) {
  counts_ = std::make_shared<std::vector<int64_t>>(counts);
}

ExpertGroups ExpertGroups::from_ends(const at::Tensor& ends) {
  ExpertGroups g;
  g.ends_ = ends;
  return g;
}

const std::vector<int64_t>& ExpertGroups::counts() const {
  if (!counts_) {
    const at::Tensor ends = ends_.to(at::kCPU, at::kLong);
    auto counts = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(experts()));
    int64_t before = 0;
    for (int64_t e = 0; e < experts(); ++e) {
      const int64_t end = ends.data_ptr<int64_t>()[e];
      (*counts)[static_cast<size_t>(e)] = end - before;
      before = end;
    }
    counts_ = std::move(counts);
  }
  return *counts_;
}

namespace {

// grouped_linear's checks of x [M, in] and the grouped weight [E, out, in].
void check_grouped(const at::Tensor& x, const std::vector<int64_t>& weight,
                   const ExpertGroups& groups) {
  // The rows' split is checked where it is on the host (a GPU's would cost a sync).
  bool rows_fit = true;
  if (groups.ends().is_cpu()) {
    int64_t rows = 0;
    for (int64_t n : groups.counts()) {
      rows_fit = rows_fit && n >= 0;
      rows += n;
    }
    rows_fit = rows_fit && x.dim() == 2 && rows == x.size(0);
  }
  if (x.dim() != 2 || weight.size() != 3 || x.size(1) != weight[2] ||
      groups.experts() != weight[0] || !rows_fit) {
    throw InvalidArgument(
        fmt::format("grouped_linear: rows [{}, {}] in {} groups do not fit weights [{}]", x.size(0),
                    x.dim() > 1 ? x.size(1) : 0, groups.experts(), fmt::join(weight, ", ")));
  }
}

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const ExpertGroups& groups) {
  if (weight.dim() != 3) {
    throw InvalidArgument(fmt::format("grouped_linear: weights [{}] are not [experts, out, in]",
                                      fmt::join(weight.sizes(), ", ")));
  }
  check_grouped(x, weight.sizes().vec(), groups);
  return GroupedLinearFunction::apply(x, weight, groups);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::vector<int64_t>& counts) {
  return grouped_linear(x, weight, ExpertGroups(counts));
}

at::Tensor quantized_grouped_linear(const at::Tensor& x, const at::Tensor& storage,
                                    const quant::FourBitLayout& layout, bool transposed,
                                    const ExpertGroups& groups) {
  std::vector<int64_t> shape = layout.value_shape();
  if (shape.size() != 3 || storage.numel() != layout.bytes()) {
    throw InvalidArgument(fmt::format(
        "quantized_grouped_linear: storage of {} bytes is not 4-bit experts [{}] ({} bytes)",
        storage.numel(), fmt::join(shape, ", "), layout.bytes()));
  }
  if (transposed) std::swap(shape[1], shape[2]);
  check_grouped(x, shape, groups);
  return QuantizedGroupedLinearFunction::apply(x, storage, quant::layout_numbers(layout),
                                               transposed, groups);
}

MoeExperts::MoeExperts(const MoeSpec& spec, int64_t hidden, const ParamFactory& o)
    : transposed(spec.transposed) {
  const int64_t e = spec.local_experts(), i = spec.intermediate;
  const std::array<std::vector<int64_t>, kTensors> shapes = {
      transposed ? std::vector<int64_t>{e, hidden, 2 * i} : std::vector<int64_t>{e, 2 * i, hidden},
      transposed ? std::vector<int64_t>{e, i, hidden} : std::vector<int64_t>{e, hidden, i}};
  for (size_t t = 0; t < kTensors; ++t) {
    const std::vector<int64_t>& shape = shapes[t];
    if (o.quantization != nullptr) {
      quantized[t] =
          four_bit_layout(*o.quantization, shape[0] * shape[1], shape[2],
                          c10::typeMetaToScalarType(o.options.dtype()), /*groups=*/shape[0]);
      tensor(t) = register_parameter(kNames[t], o.bytes(quantized[t]->bytes()),
                                     /*requires_grad=*/false);
    } else {
      tensor(t) = register_parameter(kNames[t], o(shape));
    }
    if (spec.expert_bias) {
      at::Tensor& bias = t == 0 ? gate_up_proj_bias : down_proj_bias;
      bias = register_parameter(std::string(kNames[t]) + "_bias",
                                o({e, transposed ? shape[2] : shape[1]}));
    }
  }
}

std::vector<int64_t> MoeExperts::shape(size_t i) const {
  return quantized[i] ? quantized[i]->value_shape() : tensor(i).sizes().vec();
}

at::TensorOptions MoeExperts::value_options() const {
  return quantized[0] ? gate_up_proj.options().dtype(quantized[0]->dtype) : gate_up_proj.options();
}

at::Tensor MoeExperts::project(size_t i, const at::Tensor& rows, const ExpertGroups& groups,
                               const at::Tensor& expert_of_row) {
  // [E, in, out] tensors multiply as their [E, out, in] view (its gradient flows back).
  at::Tensor base =
      quantized[i]
          ? quantized_grouped_linear(rows, tensor(i), *quantized[i], transposed, groups)
          : grouped_linear(rows, transposed ? tensor(i).transpose(1, 2) : tensor(i), groups);
  const at::Tensor& bias = i == 0 ? gate_up_proj_bias : down_proj_bias;
  if (bias.defined()) base = base + bias.index_select(0, expert_of_row);
  const Adapted& a = adapted.at(i);
  if (!a.adapter || a.merged || a.disabled) return base;
  return base + a.adapter->forward(rows, groups);
}

Routing route_sigmoid_groups(const at::Tensor& logits, const at::Tensor& correction,
                             const MoeSpec& spec) {
  const int64_t n = logits.size(0), e = spec.experts, per_group = e / spec.groups;
  const at::Tensor scores = logits.to(at::kFloat).sigmoid();
  at::Tensor choice = scores + correction.to(at::kFloat);
  // Each group ranked by the sum of its two best; the experts of all but the top_groups masked.
  const at::Tensor group_scores =
      std::get<0>(
          choice.view({n, spec.groups, per_group}).topk(std::min<int64_t>(2, per_group), -1))
          .sum(-1);
  const at::Tensor best_groups = std::get<1>(group_scores.topk(spec.top_groups, -1));
  const at::Tensor keep = at::zeros_like(group_scores)
                              .scatter_(1, best_groups, 1.0)
                              .unsqueeze(-1)
                              .expand({n, spec.groups, per_group})
                              .reshape({n, e})
                              .to(at::kBool);
  choice = choice.masked_fill(keep.logical_not(), -std::numeric_limits<float>::infinity());
  const at::Tensor chosen = std::get<1>(choice.topk(spec.top_k, -1));
  at::Tensor weights = scores.gather(1, chosen);
  if (spec.normalize_top_k) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  return {chosen, weights * spec.scaling};
}

Routing route_softmax_of_top_k(const at::Tensor& logits, int64_t top_k) {
  at::Tensor values, experts;
  std::tie(values, experts) = at::topk(logits, top_k, -1);
  return {experts, at::softmax(values, -1)};
}

at::Tensor clamped_swiglu_interleaved(const at::Tensor& gate_up, const MoeSpec& spec) {
  const int64_t i = gate_up.size(-1) / 2;
  const at::Tensor pairs = gate_up.view({-1, i, 2});
  const at::Tensor gate = pairs.select(-1, 0).clamp_max(spec.swiglu_limit);
  const at::Tensor up = pairs.select(-1, 1).clamp(-spec.swiglu_limit, spec.swiglu_limit);
  const at::Tensor glu = gate * at::sigmoid(gate * spec.swiglu_alpha);
  return (up + 1) * glu;
}

bool is_fixed_parameter(std::string_view name) {
  constexpr std::string_view kCorrection = ".e_score_correction_bias";
  return name.size() >= kCorrection.size() &&
         name.substr(name.size() - kCorrection.size()) == kCorrection;
}

bool is_expert_tensor(std::string_view name) {
  for (std::string_view suffix : {".experts.gate_up_proj", ".experts.down_proj",
                                  ".experts.gate_up_proj_bias", ".experts.down_proj_bias"}) {
    if (name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix) {
      return true;
    }
  }
  return false;
}

namespace {

class ExpertShardSource final : public ParameterSource {
 public:
  ExpertShardSource(std::shared_ptr<ParameterSource> global, const ModelConfig::ExpertShard& shard)
      : global_(std::move(global)), shard_(shard) {}
  bool has(const std::string& name) const override { return global_->has(name); }
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    if (!is_expert_tensor(name) || shape.empty()) {
      global_->read(name, shape, offset, out);
      return;
    }
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::vector<int64_t> full = shape;
    full[0] *= shard_.size;
    global_->read(name, full, offset + shard_.rank * numel, out);
  }

 private:
  std::shared_ptr<ParameterSource> global_;
  ModelConfig::ExpertShard shard_;
};

}  // namespace

std::shared_ptr<ParameterSource> expert_shard_source(std::shared_ptr<ParameterSource> global,
                                                     const ModelConfig::ExpertShard& shard) {
  if (shard.size == 1) return global;
  return std::make_shared<ExpertShardSource>(std::move(global), shard);
}

SparseMoe::SparseMoe(const MoeSpec& s, int64_t hidden, const ParamFactory& o,
                     const ModuleNames& names)
    : spec(s) {
  gate = register_module(std::string(names.moe_router), std::make_shared<MoeRouter>(s, hidden, o));
  experts = register_module("experts", std::make_shared<MoeExperts>(s, hidden, o));
  if (s.shared_intermediate > 0) {
    MlpSpec shared;
    shared.intermediate = s.shared_intermediate;
    shared.activation = s.activation;
    shared_experts =
        register_module("shared_experts", std::make_shared<Mlp>(shared, hidden, ModuleNames{}, o));
  }
}

at::Tensor SparseMoe::forward(const at::Tensor& x) {
  const int64_t hidden = x.size(-1);
  const at::Tensor flat = x.reshape({-1, hidden});
  const bool sigmoid = spec.router == MoeSpec::Router::kSigmoidGroups;
  // GLM-4.5's router multiplies in fp32 (its weight cast up), its adapter's share added.
  const bool adapted = gate->adapter && !gate->adapter_merged && !gate->adapter_disabled;
  const at::Tensor logits = sigmoid && !adapted
                                ? at::linear(flat.to(at::kFloat), gate->weight.to(at::kFloat))
                            : sigmoid ? gate->forward(flat).to(at::kFloat)
                                      : gate->forward(flat);
  Routing r = sigmoid ? route_sigmoid_groups(logits, gate->correction, spec)
              : spec.router == MoeSpec::Router::kTopKSoftmax
                  ? route_softmax_of_top_k(logits, spec.top_k)
                  : route_top_k(logits, spec.top_k, spec.normalize_top_k);
  if (balance) r.weights = balance->observe(logits, r.experts, r.weights);
  // The (token, expert) pairs grouped by expert, each group in token order.
  const at::Tensor chosen = r.experts.reshape({-1});
  const at::Tensor order = std::get<1>(at::sort(chosen, /*stable=*/true, 0, /*descending=*/false));
  const at::Tensor token = at::div(order, spec.top_k, "trunc");
  // Each expert's rows, counted where they are (bincount on CUDA reads its maximum on the host).
  const at::Tensor counts =
      at::zeros({spec.experts}, chosen.options()).index_add_(0, chosen, at::ones_like(chosen));
  const at::Tensor rows = flat.index_select(0, token);
  const at::Tensor expert_of_row =
      spec.expert_bias && spec.shard_size == 1 ? chosen.index_select(0, order) : at::Tensor();
  // The shared experts run while the routed rows come back from their ranks.
  at::Tensor shared;
  const at::Tensor out = expert_outputs(rows, counts, expert_of_row, [&] {
    if (shared_experts) shared = shared_experts->forward(flat);
  });
  // Weighted by the scores cast to the activations' dtype (transformers 5's softmax routers
  // return them so; GLM-4.5's weighs in fp32 and casts the product), then summed per token.
  const at::Tensor scores = r.weights.to(sigmoid ? at::kFloat : x.scalar_type())
                                .reshape({-1})
                                .index_select(0, order)
                                .unsqueeze(1);
  const at::Tensor weighted =
      sigmoid ? (out.to(at::kFloat) * scores).to(x.scalar_type()) : out * scores;
  at::Tensor routed = at::zeros_like(flat).index_add(0, token, weighted);
  if (shared_experts) routed = routed + shared;
  return routed.view(x.sizes());
}

at::Tensor SparseMoe::local_experts(const at::Tensor& rows, const ExpertGroups& groups,
                                    const at::Tensor& expert_of_row) {
  const at::Tensor both = experts->project(0, rows, groups, expert_of_row);
  const at::Tensor act = spec.clamped_swiglu ? clamped_swiglu_interleaved(both, spec)
                                             : gated_activation_halves(both, spec.activation);
  return experts->project(1, act, groups, expert_of_row);
}

at::Tensor SparseMoe::expert_outputs(const at::Tensor& rows, const at::Tensor& counts,
                                     const at::Tensor& expert_of_row,
                                     const std::function<void()>& beside) {
  if (spec.shard_size > 1) return experts_across_ranks(rows, counts, beside);
  at::Tensor out = local_experts(rows, ExpertGroups(counts), expert_of_row);
  beside();
  return out;
}

namespace {

std::vector<int64_t> host_values(const at::Tensor& t) {
  const at::Tensor h = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
}

}  // namespace

at::Tensor SparseMoe::experts_across_ranks(const at::Tensor& rows, const at::Tensor& counts,
                                           const std::function<void()>& beside) {
  if (!comm) {
    throw InvalidArgument(
        "a mixture of experts sharded over ranks (expert_parallel_size > 1) has no communicator: "
        "call CausalLM::set_expert_communicator before the first forward");
  }
  const int64_t ep = spec.shard_size, local = spec.local_experts();
  const int world = comm->world_size();
  const int64_t first = comm->rank() - spec.shard_rank;  // the group's first world rank
  // Each member's counts of this rank's experts, [ep, local] (one all-to-all of fixed sizes),
  // then both on the host: the exchange's sizes (a sync, as every all-to-all dispatch needs).
  std::vector<int64_t> fixed(static_cast<size_t>(world), 0);
  for (int64_t j = 0; j < ep; ++j) fixed[static_cast<size_t>(first + j)] = local;
  const at::Tensor device_counts = counts.to(comm->device()).contiguous();
  at::Tensor theirs = at::empty({ep * local}, device_counts.options());
  comm->all_to_all(theirs, device_counts, fixed, fixed)->wait();
  const std::vector<int64_t> mine = host_values(counts), from = host_values(theirs);
  std::vector<int64_t> send_rows(static_cast<size_t>(world), 0), recv_rows(send_rows);
  for (int64_t j = 0; j < ep; ++j) {
    for (int64_t e = 0; e < local; ++e) {
      send_rows[static_cast<size_t>(first + j)] += mine[static_cast<size_t>(j * local + e)];
      recv_rows[static_cast<size_t>(first + j)] += from[static_cast<size_t>(j * local + e)];
    }
  }
  const at::Tensor received = exchange_rows(comm, rows, recv_rows, send_rows);
  // The received rows come by member, each member's by expert: regrouped by expert (members
  // in order within each), and back again after the experts.
  std::vector<int64_t> block_start(static_cast<size_t>(ep), 0);
  for (int64_t j = 1; j < ep; ++j) {
    block_start[static_cast<size_t>(j)] =
        block_start[static_cast<size_t>(j - 1)] + recv_rows[static_cast<size_t>(first + j - 1)];
  }
  std::vector<int64_t> by_expert, local_counts(static_cast<size_t>(local), 0);
  by_expert.reserve(static_cast<size_t>(received.size(0)));
  for (int64_t e = 0; e < local; ++e) {
    for (int64_t j = 0; j < ep; ++j) {
      int64_t at = block_start[static_cast<size_t>(j)];
      for (int64_t f = 0; f < e; ++f) at += from[static_cast<size_t>(j * local + f)];
      const int64_t n = from[static_cast<size_t>(j * local + e)];
      for (int64_t k = 0; k < n; ++k) by_expert.push_back(at + k);
      local_counts[static_cast<size_t>(e)] += n;
    }
  }
  const at::Device device = rows.device();
  const at::Tensor perm = at::tensor(by_expert, at::kLong).to(device);
  const at::Tensor regrouped = received.index_select(0, perm);
  const ExpertGroups groups(local_counts, device);
  at::Tensor expert_of_row;
  if (spec.expert_bias) {
    expert_of_row = at::repeat_interleave(at::arange(local, perm.options()),
                                          at::tensor(local_counts, at::kLong).to(device));
  }
  const at::Tensor done = local_experts(regrouped, groups, expert_of_row);
  const at::Tensor back = at::zeros_like(done).index_copy(0, perm, done);
  RowsInFlight returning = start_rows(comm, back, send_rows, recv_rows);
  beside();
  return finish_rows(std::move(returning));
}

}  // namespace zt::model
