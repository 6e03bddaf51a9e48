// ZeRO stages 2 and 3, more than one rank: a rank never holds the whole gradient. Each
// parameter's gradient is added into its bucket's staging buffer as soon as it is complete and
// the parameter's own .grad is dropped; every micro-step reduce-scatters the buckets as they
// fill, and each rank accumulates its slice in fp32. Stage 3's unit buckets stage their
// gradients during the unit's backward (units.cpp) and are reduced the same way.
#include <fmt/format.h>

#include "zero/engine_impl.hpp"
#include "zerotrain/error.hpp"

namespace zt::zero {
namespace {

class StagedGradients final : public GradientStrategy {
 public:
  using GradientStrategy::GradientStrategy;

  void take(int param, bool /*again*/) override {
    const ParamInfo& p = e_.layout.params[static_cast<size_t>(param)];
    const ParamSlot& slot = e_.slots[static_cast<size_t>(param)];
    BucketState& s = e_.buckets[static_cast<size_t>(slot.bucket)];
    if (s.launched) throw_late_gradient(p);
    if (!s.staging.defined()) {
      s.staging = at::zeros({e_.layout.buckets[static_cast<size_t>(slot.bucket)].numel},
                            at::TensorOptions().dtype(e_.S.wire).device(e_.S.device));
    }
    at::Tensor& grad = p.param.mutable_grad();
    s.staging.narrow(0, slot.offset, p.numel).add_(grad.reshape({-1}));
    grad.reset();
  }

  Pending launch(int bucket) override {
    BucketState& s = e_.buckets[static_cast<size_t>(bucket)];
    if (!s.staging.defined()) {  // no gradient reached this bucket here; peers may have some
      s.staging = at::zeros({e_.layout.buckets[static_cast<size_t>(bucket)].numel},
                            at::TensorOptions().dtype(e_.S.wire).device(e_.S.device));
    }
    at::Tensor input = s.staging.scalar_type() == e_.S.wire ? s.staging : s.staging.to(e_.S.wire);
    s.staging = at::Tensor();
    return scatter_bucket(e_, bucket, std::move(input));
  }

  void complete(Pending& done) override {
    fold_into_slice(done.bucket, done.output, e_.S.post_scale);
  }
};

}  // namespace

void throw_late_gradient(const ParamInfo& p) {
  throw InvalidArgument(fmt::format(
      "parameter '{}' received a gradient after its bucket was reduced: it is used by two "
      "sharding units without being registered in both (tie it through the units' modules)",
      p.name));
}

std::unique_ptr<GradientStrategy> make_stage2_gradients(EngineImpl& e) {
  return std::make_unique<StagedGradients>(e);
}

}  // namespace zt::zero
