// DoRA (PEFT's use_dora) as a plug-in of one model::Linear: LoRA's A and B plus a trained
// magnitude m [out], the adapted weight's rows rescaled to it —
//   y = m / ‖W + s·B·A‖_row ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + bias,
// the row norm held constant in backward (the DoRA paper §4.3, as PEFT's DoraLinearLayer). The
// magnitude is saved as "<module>.lora_magnitude_vector", PEFT's key.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "model/layers.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// The parameter name of a DoRA magnitude on projection `module`.
std::string magnitude_name(const std::string& module);

/// ‖weight + scaling · lora_B · lora_A‖ per row, [out] in weight's dtype (PEFT's
/// get_weight_norm: B·A cast to weight's dtype, scaled, added, then the 2-norm of each row). At
/// the start B = 0 and it is the weight's row norms: DoRA's initial magnitude.
at::Tensor dora_weight_norm(const at::Tensor& weight, const at::Tensor& lora_A,
                            const at::Tensor& lora_B, double scaling);

/// Folds a DoRA adapter into fp32 `weight` [out, in] in place, as PEFT's merge:
/// weight ← m / ‖weight + ΔW‖_row ⊙ (weight + ΔW), ΔW = scaling · B · A. Returns the row norms
/// it divided by (unmerging needs them).
at::Tensor dora_merge(at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                      const at::Tensor& magnitude, double scaling);

/// DoRA on one Linear: lora_A, lora_B (register_lora_factors) and lora_magnitude_vector on
/// `host`, the magnitude ones until its start is known: the row norms of the host's weight,
/// which peft::attach_adapter sets on a model that holds values and peft::dora_source gives
/// the engine of one that does not.
class DoraAdapter final : public model::LinearAdapter {
 public:
  DoraAdapter(const std::string& path, model::Linear& host, const LoraOptions& options,
              uint64_t seed);
  at::Tensor forward(const model::Linear& base, const at::Tensor& x, bool output_unread,
                     const at::Tensor& kept) const override;
  /// Never: DoRA's backward needs the product before rescaling, which it keeps itself.
  bool reuses_kept(bool /*training*/) const override { return false; }
  void merge_into(at::Tensor& weight) const override;
  void unmerge_from(at::Tensor& weight) const override;

 private:
  std::shared_ptr<model::Linear> a_, b_;
  at::Tensor magnitude_;
  double scaling_, dropout_;
  mutable at::Tensor merged_norm_;  ///< the row norms merge_into divided by
};

}  // namespace zt::peft
