// DoRA on one Linear (dora.hpp): the adapter, its projection as one autograd function, and its
// merge.
#include "peft/dora.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "peft/lora.hpp"

namespace zt::peft {
namespace {

// The base's values in `dtype`: `weight` itself, or a 4-bit storage dequantized (`layout`
// non-empty: quant::layout_numbers).
at::Tensor base_values(const at::Tensor& weight, const std::vector<int64_t>& layout,
                       at::ScalarType dtype) {
  if (layout.empty()) return weight.to(dtype);
  return quant::dequantize_weight(quant::layout_from_numbers(layout), weight, dtype);
}

// y = f ⊙ inner + bias, inner = x·Wᵀ + s·(x·Aᵀ)·Bᵀ, f = m / n with n = ‖W + s·B·A‖_row held
// constant. Saves x (as rows), the weight (storage when 4-bit: dequantized again in backward),
// A, B, x·Aᵀ, inner, f and n — not W's values. Backward: with g = dy ⊙ f,
// dm = Σ_tokens dy ⊙ inner / n, dB = s·gᵀ·(x·Aᵀ), dA = (s·g·B)ᵀ·x, dx = g·W + (s·g·B)·A.
class DoraLinearFunction : public torch::autograd::Function<DoraLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& lora_a, const at::Tensor& lora_b,
                            const at::Tensor& magnitude, double scaling,
                            const std::vector<int64_t>& layout) {
    const at::Tensor w = base_values(weight, layout, x.scalar_type());
    const at::Tensor norm = dora_weight_norm(w, lora_a, lora_b, scaling);
    const at::Tensor factor = magnitude / norm;
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    const at::Tensor a = at::mm(rows, lora_a.t());
    at::Tensor inner = at::mm(rows, w.t());
    inner.addmm_(a, lora_b.t(), /*beta=*/1.0, /*alpha=*/scaling);
    at::Tensor y = inner * factor.to(inner.scalar_type());
    if (bias.numel() > 0) y.add_(bias);
    ctx->save_for_backward({rows, weight, lora_a, lora_b, a, inner, factor, norm});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["bias"] = bias.numel() > 0;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &rows = saved[0], &weight = saved[1], &lora_a = saved[2], &lora_b = saved[3],
                     &a = saved[4], &inner = saved[5], &factor = saved[6], &norm = saved[7];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const at::Tensor dy = grads[0].reshape({-1, inner.size(1)});
    const at::Tensor g = dy * factor.to(dy.scalar_type());
    at::Tensor grad_x, grad_bias, grad_a, grad_b, grad_m;
    if (ctx->needs_input_grad(5)) {
      grad_m = ((dy * inner).sum(0) / norm).to(factor.scalar_type());
    }
    if (ctx->needs_input_grad(4)) grad_b = at::mm(g.t(), a) * scaling;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(3)) {
      const at::Tensor da = at::mm(g, lora_b) * scaling;
      if (ctx->needs_input_grad(3)) grad_a = at::mm(da.t(), rows);
      if (ctx->needs_input_grad(0)) {
        const at::Tensor w =
            base_values(weight, ctx->saved_data["layout"].toIntVector(), g.scalar_type());
        grad_x = at::mm(g, w);
        grad_x.addmm_(da, lora_a);
        std::vector<int64_t> shape = grads[0].sizes().vec();
        shape.back() = rows.size(1);
        grad_x = grad_x.view(shape);
      }
    }
    if (ctx->needs_input_grad(2) && ctx->saved_data["bias"].toBool()) grad_bias = dy.sum(0);
    return {grad_x, at::Tensor(), grad_bias, grad_a, grad_b, grad_m, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::string magnitude_name(const std::string& module) {
  return module + ".lora_magnitude_vector";
}

at::Tensor dora_weight_norm(const at::Tensor& weight, const at::Tensor& lora_A,
                            const at::Tensor& lora_B, double scaling) {
  at::NoGradGuard no_grad;
  const at::Tensor lora_weight = at::mm(lora_B, lora_A).to(weight.scalar_type());
  return (weight + lora_weight * scaling).norm(2, {1}).to(weight.scalar_type());
}

at::Tensor dora_merge(at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                      const at::Tensor& magnitude, double scaling) {
  at::NoGradGuard no_grad;
  add_lora_delta(weight, lora_A, lora_B, scaling);
  const at::Tensor norm = weight.norm(2, {1});
  weight.mul_((magnitude.to(at::kFloat) / norm).unsqueeze(1));
  return norm;
}

DoraAdapter::DoraAdapter(const std::string& path, model::Linear& host, const LoraOptions& o,
                         uint64_t seed)
    : scaling_(o.scaling()), dropout_(o.dropout) {
  LoraFactors f = register_lora_factors(path, host, o, seed);
  a_ = std::move(f.a);
  b_ = std::move(f.b);
  // Ones until peft::attach_adapter or the engine's source gives the weight's row norms.
  magnitude_ = host.register_parameter("lora_magnitude_vector",
                                       at::ones({host.out_features}, host.value_options()));
}

at::Tensor DoraAdapter::forward(const model::Linear& base, const at::Tensor& x,
                                bool /*output_unread*/, const at::Tensor& /*kept*/) const {
  const bool drop = dropout_ > 0 && base.is_training();
  if (!drop) {
    const at::Tensor none = at::empty({0}, x.options());
    const std::vector<int64_t> layout =
        base.quantized ? quant::layout_numbers(*base.quantized) : std::vector<int64_t>{};
    return DoraLinearFunction::apply(x, base.weight, base.bias.defined() ? base.bias : none,
                                     a_->weight, b_->weight, magnitude_, scaling_, layout);
  }
  // Dropout in training: autograd of PEFT's expression — the base's output on x, DoRA's
  // correction on dropout(x). The base's products go through base_forward, so that autograd
  // keeps no dense copy of a 4-bit weight (which would cost the memory QLoRA saves); W's values
  // serve the norm only, outside autograd.
  const at::Tensor norm =
      dora_weight_norm(base.dense_weight(x.scalar_type()), a_->weight, b_->weight, scaling_);
  const at::Tensor factor = magnitude_ / norm.unsqueeze(0);
  const at::Tensor dropped = at::dropout(x, dropout_, true);
  const at::Tensor lora = at::linear(at::linear(dropped, a_->weight), b_->weight);
  at::Tensor base_dropped = base.base_forward(dropped);
  if (base.bias.defined()) base_dropped = base_dropped - base.bias;
  return base.base_forward(x) + (factor - 1) * base_dropped + factor * lora * scaling_;
}

void DoraAdapter::merge_into(at::Tensor& weight) const {
  merged_norm_ = dora_merge(weight, a_->weight, b_->weight, magnitude_, scaling_);
}

void DoraAdapter::unmerge_from(at::Tensor& weight) const {
  weight.div_((magnitude_.to(at::kFloat) / merged_norm_).unsqueeze(1));
  add_lora_delta(weight, a_->weight, b_->weight, -scaling_);
}

}  // namespace zt::peft
