// Parameter snapshots: the trainable parameters of a source laid out as this rank keeps its
// compute copy, swapped in and out around forwards without gradients (a frozen reference model
// that ZeRO shards as it shards the policy).
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include "zero/engine_impl.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using zero::EngineImpl;

int64_t ParameterSnapshot::bytes() const {
  int64_t n = 0;
  for (const at::Tensor& t : buckets) {
    if (t.defined()) n += static_cast<int64_t>(t.nbytes());
  }
  return n;
}

namespace {

// A trainable bucket's compute copy as this rank keeps it: its shard, or the whole bucket.
const at::Tensor& compute_copy(const EngineImpl& I, const zero::Bucket& b) {
  const zero::BucketState& s = I.buckets[static_cast<size_t>(b.index)];
  return b.sharded_params ? s.param_shard : s.flat_param;
}

}  // namespace

ParameterSnapshot Engine::parameter_snapshot(ParameterSource& source) const {
  const EngineImpl& I = *impl_;
  at::NoGradGuard no_grad;
  ParameterSnapshot snap;
  snap.buckets.resize(I.layout.buckets.size());
  at::Tensor staging;
  for (const zero::Bucket& b : I.layout.buckets) {
    if (!b.trainable) continue;
    const at::Tensor& like = compute_copy(I, b);
    const bool whole = !b.sharded_params;
    const int64_t begin = whole ? 0 : b.slice_begin();
    const at::Tensor values = zero::read_bucket(
        source, I.layout, b, begin, whole ? b.numel : b.shard_numel, I.S.device, staging);
    at::Tensor held = at::empty_like(like);  // the same dtype, device and pinning
    held.copy_(values);
    snap.buckets[static_cast<size_t>(b.index)] = held;
  }
  return snap;
}

void Engine::swap_parameters(ParameterSnapshot& snapshot) {
  EngineImpl& I = *impl_;
  if (I.steps.awaiting_step) {
    throw InvalidArgument("Engine::swap_parameters between backward() and step()");
  }
  if (snapshot.buckets.size() != I.layout.buckets.size()) {
    throw InvalidArgument("Engine::swap_parameters: the snapshot is another engine's");
  }
  at::NoGradGuard no_grad;
  I.finish_publishing();  // a step's all-gathers write the compute copy
  // Gathered stage-3 units hold copies of the shards: drop them, the next forward gathers the
  // values swapped in.
  I.residency.held = false;  // a hold_units ends here
  for (size_t u = 0; u < I.units.size(); ++u) I.release(u);
  // Offloaded shards are written on the host below: no upload from them may still be reading.
  if (I.S.offload_param && I.S.device.is_cuda()) torch::cuda::synchronize();
  for (const zero::Bucket& b : I.layout.buckets) {
    if (!b.trainable) continue;
    const at::Tensor& live = compute_copy(I, b);
    at::Tensor& held = snapshot.buckets[static_cast<size_t>(b.index)];
    if (!held.defined() || !live.defined() || held.sizes() != live.sizes()) {
      throw InvalidArgument("Engine::swap_parameters: the snapshot is another engine's");
    }
    const at::Tensor mine = live.clone();
    live.copy_(held);
    held.copy_(mine);
    I.buckets[static_cast<size_t>(b.index)].secondary = at::Tensor();  // hpZ: other values now
  }
}

}  // namespace zt
