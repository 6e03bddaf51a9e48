// EngineOptions::update_in_backward: the optimizer runs on each parameter as soon as its
// gradient is complete, inside backward, and the gradient is freed at once, so no full set of
// gradients ever exists. Only where that cannot change the math (settings.cpp decides): one
// rank, no accumulation, no clipping, no fp16. Masters in the compute dtype are the parameters
// themselves; fp32 masters are updated from autograd's bf16 gradient and written back into the
// parameter in the same pass (on the GPU one kernel: no fp32 gradient copy, no separate cast).
// A weight two units share (tied embeddings) gets one gradient share per unit: the shares are
// summed in fp32, as the accumulator of the step path sums them, and the update runs on the
// last.
#pragma once

#include "zero/engine_impl.hpp"

namespace zt::zero {

class InBackwardUpdate final : public GradientStrategy {
 public:
  explicit InBackwardUpdate(EngineImpl& engine);

  bool reduces(int64_t /*micro*/) const override { return false; }
  void begin_backward() override;
  void take(int param, bool again) override;
  Pending launch(int bucket) override;  ///< never needed: nothing is reduced
  void complete(Pending& /*done*/) override {}

  /// The step after a backward: the parameters that got no gradient are updated with zeros
  /// (momentum and weight decay still apply, as on the flat path), then the global norm and the
  /// finiteness of the losses are checked. Throws NumericError (the update is already applied).
  void finish_step();

 private:
  /// The parameter's values as the model computes with them, when they are not the masters.
  at::Tensor compute_copy(int param) const;
  void apply(int param, const at::Tensor& grad);

  UpdateHyper hyper_;   ///< the update of the step under way
  at::Tensor grad_sq_;  ///< Σ g² of each parameter's gradient this step (0 if none)
  /// Per parameter: how many units hold it (1 unless shared), the shares taken this backward,
  /// and their fp32 sum until the last share.
  std::vector<int> holders_, shares_;
  std::vector<at::Tensor> partial_;
};

}  // namespace zt::zero
