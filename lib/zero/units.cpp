// Sharding units: ZeRO-3 parameter gathering and activation checkpointing through one
// autograd function per unit call.
//
// Forward gathers the unit's parameters (stage 3; the next unit is prefetched while this one
// runs), runs the unit without recording a graph, saves only its inputs, and releases the
// parameters. Backward re-gathers (prefetching the previous unit), recomputes with the same
// random state, back-propagates into the inputs and parameters, reduce-scatters the unit's
// gradients straight into this rank's slice, and releases again. Correct by construction and
// memory-tight; the price is one recomputation, which ZeRO-3 users usually pay for activation
// checkpointing anyway.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Context.h>

#include <fmt/format.h>

#include "util/rng.hpp"
#include "zero/copy_stream.hpp"
#include "zero/engine_impl.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

// What one unit call needs again in backward; lives in the autograd context.
struct UnitCall : torch::CustomClassHolder {
  zero::EngineImpl* impl = nullptr;
  size_t unit = 0;
  UnitFn fn;
  std::vector<bool> input_requires_grad;
  at::Tensor cpu_rng, device_rng;
  std::vector<at::Tensor> kept;  ///< keep_for_recompute's tensors, until backward
  size_t next_kept = 0;
  std::shared_ptr<zero::KeepBudget> budget;
  int64_t kept_in_budget = 0;  ///< bytes of `kept` counted against `budget`

  /// Drops what was kept (the recomputation holds what it still needs) and gives the budget back.
  void drop_kept() {
    kept.clear();
    if (kept_in_budget > 0) budget->used -= kept_in_budget;
    kept_in_budget = 0;
  }
  ~UnitCall() override { drop_kept(); }  // a graph freed before its backward
};

thread_local bool recomputing = false;
thread_local UnitCall* keeping_call = nullptr;  // the call whose pass keeps or reads `kept`

struct KeepingGuard {
  explicit KeepingGuard(UnitCall* call) : before(keeping_call) { keeping_call = call; }
  ~KeepingGuard() { keeping_call = before; }
  UnitCall* before;
};

struct RecomputeGuard {
  RecomputeGuard() : before(recomputing) { recomputing = true; }
  ~RecomputeGuard() { recomputing = before; }
  bool before;
};

struct DepthGuard {
  explicit DepthGuard(int& d) : depth(d) { ++depth; }
  ~DepthGuard() { --depth; }
  int& depth;
};

class UnitFunction : public torch::autograd::Function<UnitFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& /*dummy*/, at::TensorList inputs,
                                                const c10::IValue& handle) {
    auto call = c10::static_intrusive_pointer_cast<UnitCall>(handle.toCapsule());
    zero::EngineImpl& I = *call->impl;
    ctx->saved_data["call"] = handle;
    ctx->save_for_backward(inputs.vec());
    for (const at::Tensor& x : inputs)
      call->input_requires_grad.push_back(x.defined() && x.requires_grad());
    call->cpu_rng = rng::state(at::kCPU);
    if (I.S.device.is_cuda()) call->device_rng = rng::state(I.S.device);
    const bool sharded = I.S.shard_units;
    if (sharded) I.gather(call->unit, /*forward_order=*/true);
    torch::autograd::variable_list outputs;
    {
      DepthGuard depth(I.residency.depth);
      KeepingGuard keeping(call.get());
      outputs = call->fn(inputs.vec());
    }
    if (sharded) I.release(call->unit);
    torch::autograd::variable_list non_differentiable;
    for (const at::Tensor& y : outputs) {
      if (y.defined() && !at::isFloatingType(y.scalar_type())) non_differentiable.push_back(y);
    }
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto call = c10::static_intrusive_pointer_cast<UnitCall>(ctx->saved_data["call"].toCapsule());
    zero::EngineImpl& I = *call->impl;
    const size_t u = call->unit;
    const bool sharded = I.S.shard_units;
    torch::autograd::variable_list saved = ctx->get_saved_variables();
    if (sharded) I.gather(u, /*forward_order=*/false);

    // Stage 3: the unit's trainable gradients accumulate straight into one flat buffer.
    int grad_bucket = -1;
    if (sharded) {
      for (int b : I.layout.unit_buckets[u]) {
        const zero::Bucket& bucket = I.layout.buckets[static_cast<size_t>(b)];
        if (!bucket.trainable) continue;
        grad_bucket = b;
        const at::Tensor target = I.gradients->unit_gradients(b);
        for (size_t k = 0; k < bucket.params.size(); ++k) {
          const zero::ParamInfo& p = I.layout.params[static_cast<size_t>(bucket.params[k])];
          p.param.mutable_grad() = target.narrow(0, bucket.offsets[k], p.numel).view(p.shape);
        }
      }
    }

    std::vector<at::Tensor> detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = saved[i].defined() ? saved[i].detach() : saved[i];
      if (x.defined() && call->input_requires_grad[i] && at::isFloatingType(x.scalar_type())) {
        x.requires_grad_(true);
      }
      detached.push_back(x);
    }
    // Recompute with the random state of the forward, then put the current state back.
    at::Tensor cpu_now = rng::state(at::kCPU);
    at::Tensor dev_now = I.S.device.is_cuda() ? rng::state(I.S.device) : at::Tensor();
    rng::set_state(at::kCPU, call->cpu_rng);
    if (dev_now.defined()) rng::set_state(I.S.device, call->device_rng);
    torch::autograd::variable_list outputs;
    {
      at::AutoGradMode enable(true);
      DepthGuard depth(I.residency.depth);
      RecomputeGuard recompute;
      KeepingGuard keeping(call.get());
      call->next_kept = 0;
      outputs = call->fn(detached);
    }
    call->drop_kept();
    rng::set_state(at::kCPU, cpu_now);
    if (dev_now.defined()) rng::set_state(I.S.device, dev_now);

    torch::autograd::variable_list roots, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);

    torch::autograd::variable_list result;
    result.emplace_back();  // the dummy
    for (const at::Tensor& x : detached) {
      result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    }
    result.emplace_back();  // the handle
    if (grad_bucket >= 0) {
      const zero::Bucket& bucket = I.layout.buckets[static_cast<size_t>(grad_bucket)];
      for (int p : bucket.params)
        I.layout.params[static_cast<size_t>(p)].param.mutable_grad().reset();
      I.reduce_unit_gradients(grad_bucket);
    }
    if (sharded) I.release(u);
    return result;
  }
};

}  // namespace

bool recomputing_for_backward() {
  return recomputing;
}

bool keep_for_recompute(const at::Tensor& t) {
  if (keeping_call == nullptr || recomputing) return false;
  keeping_call->kept.push_back(t);
  return true;
}

bool keep_for_recompute_if_room(at::TensorList ts) {
  if (keeping_call == nullptr || recomputing || ts.empty()) return false;
  UnitCall& call = *keeping_call;
  int64_t bytes = 0;
  for (const at::Tensor& t : ts) bytes += static_cast<int64_t>(t.nbytes());
  const int64_t rows = ts[0].dim() > 0 && ts[0].size(-1) > 0 ? ts[0].numel() / ts[0].size(-1) : 1;
  zero::KeepBudget& budget = *call.budget;
  if (budget.used.load() + bytes > budget.limit(rows, call.impl->steps.global)) return false;
  budget.used += bytes;
  call.kept_in_budget += bytes;
  for (const at::Tensor& t : ts) call.kept.push_back(t);
  return true;
}

at::Tensor kept_for_recompute() {
  if (keeping_call == nullptr || !recomputing) return {};
  UnitCall& call = *keeping_call;
  return call.next_kept < call.kept.size() ? call.kept[call.next_kept++] : at::Tensor();
}

std::vector<at::Tensor> zero::EngineImpl::run_unit(size_t unit,
                                                   const std::vector<at::Tensor>& inputs,
                                                   const UnitFn& fn) {
  if (unit >= options.units.size()) {
    throw InvalidArgument(
        fmt::format("UnitGate: unit {} does not exist ({} declared in "
                    "EngineOptions::units)",
                    unit, options.units.size()));
  }
  if (residency.depth > 0) {
    throw InvalidArgument(
        fmt::format("UnitGate: unit '{}' runs inside another unit; units cannot "
                    "nest",
                    options.units[unit].name));
  }
  const bool sharded = S.shard_units;
  if (!sharded && !(S.checkpointing && options.units[unit].recompute)) return fn(inputs);
  if (!at::GradMode::is_enabled()) {
    // Evaluation: nothing to recompute later, only parameters to gather.
    if (sharded) gather(unit, true);
    std::vector<at::Tensor> out;
    {
      DepthGuard depth(residency.depth);
      out = fn(inputs);
    }
    if (sharded) release(unit);
    return out;
  }
  auto call = c10::make_intrusive<UnitCall>();
  call->impl = this;
  call->budget = keep_budget;
  call->unit = unit;
  call->fn = fn;
  c10::IValue handle = c10::IValue::make_capsule(call);
  return UnitFunction::apply(dummy, at::TensorList(inputs), handle);
}

// ---- gathering --------------------------------------------------------------------------------

void zero::EngineImpl::start_gather(size_t u) {
  UnitState& st = units[u];
  for (int b : layout.unit_buckets[u]) {
    const zero::Bucket& bucket = layout.buckets[static_cast<size_t>(b)];
    BucketState& s = buckets[static_cast<size_t>(b)];
    // Offloaded shards come up from pinned memory asynchronously: at one rank on the side
    // stream, overlapping the compute already queued (finish_gather orders the compute stream
    // after it); with ranks on the compute stream, ordered before the gather.
    at::Tensor source = s.param_shard;
    if (param_uploads && source.device() != S.device) {
      source = at::empty(s.param_shard.sizes(), s.param_shard.options().device(S.device));
      st.uploads.push_back(param_uploads->copy(source, s.param_shard));
    } else if (source.device() != S.device) {
      source = s.param_shard.to(S.device, /*non_blocking=*/true);
    }
    if (S.world == 1) {
      s.flat_param = source;  // the whole bucket already; nothing to gather
    } else {
      s.flat_param = at::empty({bucket.numel},
                               at::TensorOptions().dtype(stored_dtype(bucket)).device(S.device));
      st.gathers.push_back(comm->all_gather(s.flat_param, source));
      st.sources.push_back(source);
    }
    st.elements += bucket.numel;
  }
  residency.gathered_now += st.elements;
  residency.gathered_peak = std::max(residency.gathered_peak, residency.gathered_now);
  st.status = UnitStatus::kGathering;
}

void zero::EngineImpl::finish_gather(size_t u) {
  UnitState& st = units[u];
  for (int64_t ticket : st.uploads) param_uploads->device_wait(ticket);
  st.uploads.clear();
  for (WorkHandle& w : st.gathers) w->wait();
  st.gathers.clear();
  st.sources.clear();
  bind_unit_params(u, true);
  st.status = UnitStatus::kGathered;
}

void zero::EngineImpl::gather(size_t u, bool forward_order) {
  UnitState& st = units[u];
  if (st.status == UnitStatus::kReleased) {
    // Make room within stage3_max_live_parameters by dropping prefetched units first.
    int64_t need = 0;
    for (int b : layout.unit_buckets[u]) need += layout.buckets[static_cast<size_t>(b)].numel;
    for (size_t other = 0;
         other < units.size() && residency.gathered_now + need > S.max_live_elements; ++other) {
      if (other != u && units[other].status != UnitStatus::kReleased) {
        if (units[other].status == UnitStatus::kGathering) finish_gather(other);
        release(other);
      }
    }
    start_gather(u);
  }
  if (st.status == UnitStatus::kGathering) finish_gather(u);
  record(TraceEvent::Kind::kUnitGather, static_cast<int>(u));
  prefetch_after(u, forward_order);
}

void zero::EngineImpl::prefetch_after(size_t u, bool forward_order) {
  // The next unit in execution order is always prefetched when it fits under the live bound;
  // more follow while the prefetched elements stay within stage3_prefetch_bucket_size.
  int64_t ahead = 0;
  for (int step = 1;; ++step) {
    long next = forward_order ? static_cast<long>(u) + step : static_cast<long>(u) - step;
    if (next < 0 || next >= static_cast<long>(units.size())) return;
    UnitState& st = units[static_cast<size_t>(next)];
    int64_t size = 0;
    for (int b : layout.unit_buckets[static_cast<size_t>(next)]) {
      size += layout.buckets[static_cast<size_t>(b)].numel;
    }
    if (residency.gathered_now + (st.status == UnitStatus::kReleased ? size : 0) >
        S.max_live_elements)
      return;
    if (step > 1 && ahead + size > S.prefetch_elements) return;
    if (st.status == UnitStatus::kReleased && size > 0) start_gather(static_cast<size_t>(next));
    ahead += size;
  }
}

void zero::EngineImpl::release(size_t u) {
  UnitState& st = units[u];
  if (st.status == UnitStatus::kReleased) return;
  if (st.status == UnitStatus::kGathering) finish_gather(u);
  bind_unit_params(u, false);
  for (int b : layout.unit_buckets[u]) buckets[static_cast<size_t>(b)].flat_param = at::Tensor();
  residency.gathered_now -= st.elements;
  st.elements = 0;
  st.status = UnitStatus::kReleased;
  record(TraceEvent::Kind::kUnitRelease, static_cast<int>(u));
}

void zero::EngineImpl::bind_unit_params(size_t u, bool gathered) {
  for (int b : layout.unit_buckets[u]) {
    const zero::Bucket& bucket = layout.buckets[static_cast<size_t>(b)];
    BucketState& s = buckets[static_cast<size_t>(b)];
    const auto empty_options = at::TensorOptions().dtype(stored_dtype(bucket)).device(S.device);
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const zero::ParamInfo& p = layout.params[static_cast<size_t>(bucket.params[k])];
      at::Tensor param = p.param;
      if (gathered) {
        param.set_data(s.flat_param.narrow(0, bucket.offsets[k], p.numel).view(p.shape));
      } else {
        param.set_data(at::empty({0}, empty_options));
      }
    }
  }
}

}  // namespace zt
