// ZeRO stage 0 (plain data parallelism), more than one rank: every parameter's .grad is a view
// into its bucket's flat gradient, where autograd accumulates over the window; at the window's
// last micro-step each bucket is all-reduced in place (in the wire dtype) and its mean lands in
// the fp32 accumulator, which on stage 0 holds whole buckets on every rank. A local bucket
// (trainable rank-local parameters) is summed over the ranks holding the same values instead.
#include "comm/groups.hpp"
#include "zero/engine_impl.hpp"

namespace zt::zero {
namespace {

class AllReduceGradients final : public GradientStrategy {
 public:
  using GradientStrategy::GradientStrategy;

  void take(int param, bool /*again*/) override { keep_in_flat_gradient(param); }

  Pending launch(int bucket) override {
    BucketState& s = e_.buckets[static_cast<size_t>(bucket)];
    Pending p;
    p.bucket = bucket;
    at::Tensor wire =
        s.flat_grad.scalar_type() == e_.S.wire ? s.flat_grad : s.flat_grad.to(e_.S.wire);
    p.in_place = wire.is_same(s.flat_grad);
    if (e_.S.pre_scale != 1.0) wire.mul_(e_.S.pre_scale);
    p.work = e_.layout.buckets[static_cast<size_t>(bucket)].local
                 ? comm::group_all_reduce(*e_.comm, wire, e_.local_peers)
                 : e_.comm->all_reduce(wire, ReduceOp::kSum);
    p.input = wire;
    return p;
  }

  void complete(Pending& done) override {
    BucketState& s = e_.buckets[static_cast<size_t>(done.bucket)];
    if (!done.in_place) s.flat_grad.copy_(done.input);
    fold_into_slice(done.bucket, s.flat_grad, e_.S.post_scale);
  }

  // All-reduces work in place on the flat gradients: nothing to bound.
  size_t max_in_flight() const override { return std::numeric_limits<size_t>::max(); }
};

}  // namespace

std::unique_ptr<GradientStrategy> make_stage0_gradients(EngineImpl& e) {
  return std::make_unique<AllReduceGradients>(e);
}

}  // namespace zt::zero
