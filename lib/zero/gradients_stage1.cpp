// ZeRO stage 1, more than one rank: gradients accumulate over the window in whole flat buckets
// exactly as on stage 0, but at the window's last micro-step each bucket is reduce-scattered,
// so a rank receives (and keeps optimizer state for) only its own slice. A local bucket
// (trainable rank-local parameters) is reduce-scattered over the ranks holding the same values
// instead, its slices theirs.
#include "comm/groups.hpp"
#include "comm/quantized.hpp"
#include "comm/work.hpp"
#include "zero/engine_impl.hpp"

namespace zt::zero {

Pending scatter_bucket(EngineImpl& e, int bucket, at::Tensor input) {
  const Bucket& b = e.layout.buckets[static_cast<size_t>(bucket)];
  Pending p;
  p.bucket = bucket;
  if (e.S.pre_scale != 1.0) input.mul_(e.S.pre_scale);
  if (b.local) {
    p.output = at::empty({b.shard_numel}, input.options());
    p.work = comm::group_reduce_scatter(*e.comm, p.output, input, e.local_peers);
  } else if (e.S.quantized_gradients && !e.node_peers.empty()) {
    // qgZ over nodes: summed within the node, then across nodes among the ranks at the same
    // place, each hop in int8 blocks. Arranged [place, node, slice] first, so that the place's
    // chunk of the first hop holds the slices its rank on every node owns.
    const int64_t per_node = static_cast<int64_t>(e.node_peers.size());
    const int64_t nodes = e.S.world / per_node;
    at::Tensor arranged =
        input.view({nodes, per_node, b.shard_numel}).transpose(0, 1).contiguous().view({-1});
    at::Tensor partial = at::empty({nodes * b.shard_numel}, input.options());
    p.output = at::empty({b.shard_numel}, input.options());
    WorkHandle within = comm::quantized_reduce_scatter(*e.comm, partial, arranged, e.node_peers);
    p.work = std::make_unique<comm::ThenWork>(
        std::move(within), [&e, partial, arranged, slice = p.output] {
          comm::quantized_reduce_scatter(*e.comm, slice, partial, e.place_peers)->wait();
        });
  } else if (e.S.quantized_gradients) {
    p.output = at::empty({b.shard_numel}, input.options());
    p.work = comm::quantized_reduce_scatter(*e.comm, p.output, input, {});
  } else if (e.hybrid() && e.S.use_reduce_scatter) {
    // MiCS: summed within the shard group, then each slice over the groups holding it.
    p.output = at::empty({b.shard_numel}, input.options());
    WorkHandle within = comm::group_reduce_scatter(*e.comm, p.output, input, e.shard_peers);
    p.work = std::make_unique<comm::ThenWork>(std::move(within), [&e, slice = p.output] {
      comm::group_all_reduce(*e.comm, slice, e.replica_peers)->wait();
    });
  } else if (e.S.use_reduce_scatter) {
    p.output = at::empty({b.shard_numel}, input.options());
    p.work = e.comm->reduce_scatter(p.output, input, ReduceOp::kSum);
  } else {
    p.work = e.comm->all_reduce(input, ReduceOp::kSum);
    p.output = input.narrow(0, b.slice_begin(), b.shard_numel);
  }
  p.input = input;
  return p;
}

namespace {

class FlatScatterGradients final : public GradientStrategy {
 public:
  using GradientStrategy::GradientStrategy;

  void take(int param, bool /*again*/) override { keep_in_flat_gradient(param); }

  Pending launch(int bucket) override {
    // The flat gradient is cleared after the step, so it may be scaled and sent in place.
    const at::Tensor& g = e_.buckets[static_cast<size_t>(bucket)].flat_grad;
    return scatter_bucket(e_, bucket, g.scalar_type() == e_.S.wire ? g : g.to(e_.S.wire));
  }

  void complete(Pending& done) override {
    fold_into_slice(done.bucket, done.output, e_.S.post_scale);
  }
};

}  // namespace

std::unique_ptr<GradientStrategy> make_stage1_gradients(EngineImpl& e) {
  return std::make_unique<FlatScatterGradients>(e);
}

}  // namespace zt::zero
