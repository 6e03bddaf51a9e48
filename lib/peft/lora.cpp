// LoRA on one Linear: the adapter, its initialization, its merge, and the projection with the
// adapter as one autograd function (peft::lora_linear).
#include "peft/lora.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <functional>
#include <vector>

#include <fmt/format.h>

#include "model/decoding.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {
namespace {

// lora_linear's autograd: saves x (as rows), the weights and the [tokens, r] activations
// a = (x · Aᵀ) · scaling, rounded as PEFT's `lora_A(x) * scaling`; the adapter's gradients as
// autograd of PEFT's expression forms them (dB = gᵀ·a, da = (g·B) · scaling, dA = daᵀ·x). A
// 4-bit base (a non-empty "layout") is dequantized where its values are read.
class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling,
                            bool output_unread, const at::Tensor& kept,
                            const quant::FourBitLayout* quantized) {
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    at::Tensor a = at::mm(rows, lora_a.t());
    if (scaling != 1.0) a = a * scaling;
    ctx->save_for_backward({rows, weight, lora_a, lora_b, a});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["bias"] = bias.numel() > 0;
    ctx->saved_data["layout"] =
        quantized ? quant::layout_numbers(*quantized) : std::vector<int64_t>{};
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = lora_b.size(0);
    if (kept.numel() > 0) return kept.detach();
    if (output_unread) return at::empty(shape, x.options());
    const at::Tensor w =
        quantized ? quant::dequantize_weight(*quantized, weight, x.scalar_type()) : weight;
    at::Tensor y = bias.numel() > 0 ? at::addmm(bias, rows, w.t()) : at::mm(rows, w.t());
    y.addmm_(a, lora_b.t());
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& lora_a = saved[2];
    const at::Tensor& lora_b = saved[3];
    const at::Tensor& a = saved[4];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const std::vector<int64_t> layout = ctx->saved_data["layout"].toIntVector();
    const at::Tensor g = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_x, grad_weight, grad_bias, grad_a, grad_b;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(3)) {
      at::Tensor da = at::mm(g, lora_b);
      if (scaling != 1.0) da = da * scaling;
      if (ctx->needs_input_grad(3)) grad_a = at::mm(da.t(), rows);
      if (ctx->needs_input_grad(0)) {
        grad_x = layout.empty()
                     ? at::mm(g, weight)
                     : at::mm(g, quant::dequantize_weight(quant::layout_from_numbers(layout),
                                                          weight, g.scalar_type()));
        grad_x.addmm_(da, lora_a);
        std::vector<int64_t> shape = grads[0].sizes().vec();
        shape.back() = rows.size(1);
        grad_x = grad_x.view(shape);
      }
    }
    if (ctx->needs_input_grad(4)) grad_b = at::mm(g.t(), a);
    if (ctx->needs_input_grad(1) && layout.empty()) grad_weight = at::mm(g.t(), rows);
    if (ctx->needs_input_grad(2) && ctx->saved_data["bias"].toBool()) grad_bias = g.sum(0);
    return {grad_x,       grad_weight,  grad_bias,    grad_a,      grad_b,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                       bool output_unread, const at::Tensor& kept,
                       const quant::FourBitLayout* quantized) {
  const at::Tensor none = at::empty({0}, x.options());
  return LoraLinearFunction::apply(x, weight, bias.defined() ? bias : none, lora_A, lora_B, scaling,
                                   output_unread, kept.defined() ? kept : none, quantized);
}

void add_lora_delta(at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                    double scaling) {
  weight.addmm_(lora_B.to(at::kFloat), lora_A.to(at::kFloat), /*beta=*/1.0, /*alpha=*/scaling);
}

at::Generator generator_for(uint64_t seed, const std::string& name) {
  return at::detail::createCPUGenerator(seed ^
                                        (std::hash<std::string>{}(name)*0x9E3779B97F4A7C15ULL));
}

LoraFactors register_lora_factors(const std::string& path, model::Linear& host,
                                  const LoraOptions& o, uint64_t seed) {
  const model::ParamFactory factory{host.value_options(), true};
  LoraFactors f;
  f.a = host.register_module(
      "lora_A", std::make_shared<model::Linear>(host.in_features, o.r, false, factory));
  f.b = host.register_module(
      "lora_B", std::make_shared<model::Linear>(o.r, host.out_features, false, factory));
  at::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(host.in_features));
  f.a->weight.copy_(
      at::empty({o.r, host.in_features}).uniform_(-bound, bound, generator_for(seed, path)));
  f.b->weight.zero_();
  return f;
}

LoraAdapter::LoraAdapter(const std::string& path, model::Linear& host, const LoraOptions& o,
                         uint64_t seed)
    : scaling_(o.scaling()), dropout_(o.dropout) {
  LoraFactors f = register_lora_factors(path, host, o, seed);
  a_ = std::move(f.a);
  b_ = std::move(f.b);
}

at::Tensor LoraAdapter::forward(const model::Linear& base, const at::Tensor& x, bool output_unread,
                                const at::Tensor& kept) const {
  if (model::decoding() && !at::GradMode::is_enabled() && kept.numel() == 0 && !output_unread) {
    // Decoding: y + ((x·Aᵀ)·Bᵀ)·scaling in one product after the base's.
    at::Tensor y = base.base_forward(x).contiguous();
    y.view({-1, base.out_features})
        .addmm_(at::mm(x.reshape({-1, x.size(-1)}), a_->weight.t()), b_->weight.t(), 1.0, scaling_);
    return y;
  }
  if (!reuses_kept(base.is_training())) {
    // Dropout in training: autograd of PEFT's expression around the base's product (its own
    // function); the output is computed.
    at::Tensor y = base.base_forward(x);
    at::Tensor a = at::linear(at::dropout(x, dropout_, true), a_->weight);
    if (scaling_ != 1.0) a = a * scaling_;
    return at::addmm(y.reshape({-1, base.out_features}), a.reshape({-1, a.size(-1)}),
                     b_->weight.t())
        .view(y.sizes());
  }
  return lora_linear(x, base.weight, base.bias, a_->weight, b_->weight, scaling_, output_unread,
                     kept, base.quantized.get());
}

void LoraAdapter::merge_into(at::Tensor& weight) const {
  add_lora_delta(weight, a_->weight, b_->weight, scaling_);
}

void LoraAdapter::unmerge_from(at::Tensor& weight) const {
  add_lora_delta(weight, a_->weight, b_->weight, -scaling_);
}

}  // namespace zt::peft
