// LoRA and rsLoRA as a plug-in of one model::Linear: its math (one autograd function), its
// parameters under PEFT's names, its initialization and its merge. The scaling formula is
// LoraOptions::scaling(); registration with the other adapter methods: linear_adapters.hpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "model/layers.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// x · weightᵀ + bias + ((x · lora_Aᵀ) · scaling) · lora_Bᵀ — a projection with an active LoRA
/// adapter and no dropout — as one autograd function. lora_B's GEMM accumulates into the base
/// product in place, and backward accumulates the adapter's share of the input gradient into
/// the base's the same way (β = 1): no [tokens, out] copy, no [tokens, in] sum. PEFT computes
/// lora_B(lora_A(x)) · scaling and adds it; scaling the [tokens, r] activations instead is the
/// same sum. `output_unread` or a defined `kept` (a recomputed unit, as
/// model::linear_for_backward): the output is not computed — it is `kept`, or uninitialized —,
/// only the [tokens, r] activations that the adapter's weight gradients need. `quantized`: the
/// base is 4-bit, `weight` its storage (model::Linear::quantized), dequantized for the product
/// and again in backward, as model::quantized_linear, and never given a gradient.
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                       bool output_unread, const at::Tensor& kept = {},
                       const quant::FourBitLayout* quantized = nullptr);

/// weight += lora_B · lora_A · scaling, in place on an fp32 [out, in] `weight` (one GEMM, no
/// [out, in] temporary): the one statement of LoRA's merge.
void add_lora_delta(at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                    double scaling);

/// A CPU generator for the adapter values of module `name`, so that they do not depend on the
/// order modules are made in and agree on every rank.
at::Generator generator_for(uint64_t seed, const std::string& name);

/// LoRA's A [r, in] and B [out, r], registered on `host` as its submodules "lora_A" and "lora_B"
/// in its value dtype and device: A ~ kaiming_uniform(a=√5) = U(±1/√in) from `seed` and the
/// module's `path` (the same values on every rank), B = 0, so the adapter starts as a no-op
/// (PEFT's init). LoRA's and DoRA's adapters hold them.
struct LoraFactors {
  std::shared_ptr<model::Linear> a, b;
};
LoraFactors register_lora_factors(const std::string& path, model::Linear& host,
                                  const LoraOptions& options, uint64_t seed);

/// LoRA on one Linear (PEFT's layout: submodules lora_A [r, in] and lora_B [out, r] of the
/// projection, output += lora_B(lora_A(dropout(x))) · scaling; lora_B has no bias).
class LoraAdapter final : public model::LinearAdapter {
 public:
  /// Registers lora_A and lora_B on `host` (register_lora_factors).
  LoraAdapter(const std::string& path, model::Linear& host, const LoraOptions& options,
              uint64_t seed);
  at::Tensor forward(const model::Linear& base, const at::Tensor& x, bool output_unread,
                     const at::Tensor& kept) const override;
  bool reuses_kept(bool training) const override { return dropout_ <= 0 || !training; }
  void merge_into(at::Tensor& weight) const override;
  void unmerge_from(at::Tensor& weight) const override;

 private:
  std::shared_ptr<model::Linear> a_, b_;
  double scaling_, dropout_;
};

}  // namespace zt::peft
