// One rank: the reduction is the identity, so no collective, copy or scaling is issued.
//
// In the accumulator (masters in the compute dtype): every parameter's .grad is a view into
// the fp32/bf16 accumulator itself, where autograd accumulates over the window; nothing at all
// happens per bucket.
//
// Otherwise (bf16 compute, fp32 masters): stages 0/1 accumulate in the compute-dtype flat
// gradients and copy them up at the window's end; stages 2/3 write each gradient straight into
// the fp32 accumulator as it completes (overwriting at a window's start, adding after), and
// stage 3's unit buckets fold their staged gradients in when their unit's backward ends.
#include "comm/work.hpp"
#include "zero/engine_impl.hpp"

namespace zt::zero {
namespace {

Pending done(int bucket) {
  Pending p;
  p.bucket = bucket;
  p.work = std::make_unique<comm::DoneWork>();
  p.in_place = true;
  return p;
}

class OneRankGradients final : public GradientStrategy {
 public:
  using GradientStrategy::GradientStrategy;

  void take(int param, bool again) override {
    if (e_.S.stage <= 1) return keep_in_flat_gradient(param);
    const ParamInfo& p = e_.layout.params[static_cast<size_t>(param)];
    const ParamSlot& slot = e_.slots[static_cast<size_t>(param)];
    const Bucket& bucket = e_.layout.buckets[static_cast<size_t>(slot.bucket)];
    const BucketState& s = e_.buckets[static_cast<size_t>(slot.bucket)];
    if (s.launched) throw_late_gradient(p);
    at::Tensor& grad = p.param.mutable_grad();
    at::Tensor region = e_.grad_acc.narrow(0, bucket.shard.offset + slot.offset, p.numel);
    if (s.slice_fresh && !again) {
      region.copy_(grad.reshape({-1}));
    } else {
      region.add_(grad.reshape({-1}));
    }
    grad.reset();
  }

  Pending launch(int bucket) override {
    Pending p = done(bucket);
    BucketState& s = e_.buckets[static_cast<size_t>(bucket)];
    if (e_.S.stage <= 1) {
      p.output = s.flat_grad;
    } else if (s.staging.defined()) {
      p.output = s.staging;  // a stage-3 unit's gradients
      s.staging = at::Tensor();
    }
    return p;
  }

  void complete(Pending& d) override {
    if (d.output.defined()) return fold_into_slice(d.bucket, d.output, 1.0);
    // The hooks wrote straight into the accumulator; parameters that got no gradient in the
    // first micro-step of a window still hold the last window's values.
    BucketState& s = e_.buckets[static_cast<size_t>(d.bucket)];
    if (s.slice_fresh) {
      const Bucket& b = e_.layout.buckets[static_cast<size_t>(d.bucket)];
      for (size_t k = 0; k < b.params.size(); ++k) {
        const size_t pi = static_cast<size_t>(b.params[k]);
        if (!e_.slots[pi].fired) {
          e_.grad_acc.narrow(0, b.shard.offset + b.offsets[k], e_.layout.params[pi].numel).zero_();
        }
      }
    }
    s.slice_fresh = false;
  }

  size_t max_in_flight() const override { return std::numeric_limits<size_t>::max(); }
};

class InAccumulatorGradients final : public GradientStrategy {
 public:
  using GradientStrategy::GradientStrategy;

  void take(int param, bool /*again*/) override { keep_in_flat_gradient(param); }

  at::Tensor unit_gradients(int bucket) override { return e_.slice_of(bucket, e_.grad_acc); }

  Pending launch(int bucket) override { return done(bucket); }

  void complete(Pending& d) override {
    e_.buckets[static_cast<size_t>(d.bucket)].slice_fresh = false;
  }

  size_t max_in_flight() const override { return std::numeric_limits<size_t>::max(); }

  // The accumulator is written in place by autograd and never holds stale slices.
  void before_step() override {}

  void clear() override {
    e_.grad_acc.zero_();
    for (BucketState& s : e_.buckets) s.slice_fresh = true;
  }
};

}  // namespace

std::unique_ptr<GradientStrategy> make_one_rank_gradients(EngineImpl& e) {
  return std::make_unique<OneRankGradients>(e);
}

std::unique_ptr<GradientStrategy> make_in_accumulator_gradients(EngineImpl& e) {
  return std::make_unique<InAccumulatorGradients>(e);
}

}  // namespace zt::zero
