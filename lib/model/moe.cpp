// See moe.hpp. The CPU path multiplies each expert's rows in turn; the pairs are grouped by
// expert first, so each expert's rows are one contiguous block and each token's outputs are
// summed in ascending expert order, as transformers' loop over the experts hit sums them.
#include "model/moe.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <fmt/format.h>

#include <limits>
#include <tuple>

#include "zerotrain/error.hpp"
#include "zerotrain/units.hpp"

namespace zt::model {

namespace {

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::vector<int64_t>& counts) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["counts"] = counts;
    const at::Tensor input = x.contiguous();
    at::Tensor out = at::empty({x.size(0), weight.size(1)}, x.options());
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      at::Tensor rows = out.narrow(0, start, n);
      at::mm_out(rows, input.narrow(0, start, n), weight.select(0, static_cast<int64_t>(e)).t());
      start += n;
    }
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0].contiguous(), weight = saved[1];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::empty_like(x);
    if (ctx->needs_input_grad(1)) dw = at::zeros_like(weight);
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      const auto i = static_cast<int64_t>(e);
      const at::Tensor ge = g.narrow(0, start, n);
      if (dx.defined()) {
        at::Tensor rows = dx.narrow(0, start, n);
        at::mm_out(rows, ge, weight.select(0, i));
      }
      if (dw.defined()) {
        at::Tensor slice = dw.select(0, i);
        at::mm_out(slice, ge.t(), x.narrow(0, start, n));
      }
      start += n;
    }
    return {dx, dw, at::Tensor()};
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

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::vector<int64_t>& counts) {
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  if (x.dim() != 2 || weight.dim() != 3 || x.size(1) != weight.size(2) ||
      static_cast<int64_t>(counts.size()) != weight.size(0) || rows != x.size(0)) {
    throw InvalidArgument(
        fmt::format("grouped_linear: rows [{}, {}] in {} groups do not fit weights [{}, {}, {}]",
                    x.size(0), x.dim() > 1 ? x.size(1) : 0, counts.size(), weight.size(0),
                    weight.dim() > 1 ? weight.size(1) : 0, weight.dim() > 2 ? weight.size(2) : 0));
  }
  return GroupedLinearFunction::apply(x, weight, counts);
}

at::Tensor MoeExperts::project(size_t i, const at::Tensor& rows, const std::vector<int64_t>& counts,
                               const at::Tensor& expert_of_row) {
  // [E, in, out] tensors multiply as their [E, out, in] view (its gradient flows back).
  at::Tensor base =
      grouped_linear(rows, transposed ? tensor(i).transpose(1, 2) : tensor(i), counts);
  const at::Tensor& bias = i == 0 ? gate_up_proj_bias : down_proj_bias;
  if (bias.defined()) base = base + bias.index_select(0, expert_of_row);
  const Adapted& a = adapted.at(i);
  if (!a.adapter || a.merged || a.disabled) return base;
  return base + a.adapter->forward(rows, counts);
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
  const at::Tensor per_expert = at::bincount(chosen, {}, spec.experts).to(at::kCPU);
  const std::vector<int64_t> counts(per_expert.data_ptr<int64_t>(),
                                    per_expert.data_ptr<int64_t>() + spec.experts);
  const at::Tensor rows = flat.index_select(0, token);
  const at::Tensor expert_of_row = spec.expert_bias ? chosen.index_select(0, order) : at::Tensor();
  const at::Tensor both = experts->project(0, rows, counts, expert_of_row);
  const at::Tensor act = spec.clamped_swiglu ? clamped_swiglu_interleaved(both, spec)
                                             : gated_activation_halves(both, spec.activation);
  const at::Tensor out = experts->project(1, act, counts, expert_of_row);
  // Weighted by the scores cast to the activations' dtype (transformers 5's softmax routers
  // return them so; GLM-4.5's weighs in fp32 and casts the product), then summed per token.
  const at::Tensor scores = r.weights.to(sigmoid ? at::kFloat : x.scalar_type())
                                .reshape({-1})
                                .index_select(0, order)
                                .unsqueeze(1);
  const at::Tensor weighted =
      sigmoid ? (out.to(at::kFloat) * scores).to(x.scalar_type()) : out * scores;
  at::Tensor routed = at::zeros_like(flat).index_add(0, token, weighted);
  if (shared_experts) routed = routed + shared_experts->forward(flat);
  return routed.view(x.sizes());
}

}  // namespace zt::model
