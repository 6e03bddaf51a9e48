// Sharding units: ZeRO-3 parameter gathering and activation checkpointing through one
// autograd function per unit call.
//
// Forward gathers the unit's parameters (stage 3; the next unit is prefetched while this one
// runs), runs the unit without recording a graph, saves only its inputs, and releases the
// parameters. Backward re-gathers (prefetching the previous unit), recomputes with the same
// random state, back-propagates into the inputs and parameters, reduce-scatters the unit's
// gradients straight into this rank's slice, and releases again. Correct by construction and
// memory-tight; the price is one recomputation, which ZeRO-3 users usually pay for activation
// checkpointing anyway. With EngineOptions::offload_activations what the recomputation needs
// waits in host memory: sent on a side stream as the unit runs, brought back for its backward,
// and the previous unit's fetched while this one's backward runs (one ahead, as stage 3's
// prefetch). With EngineOptions::units_per_checkpoint N > 1 only the first of up to N chained
// calls (each fed the one before's output) saves its inputs; a later one's backward first
// rebuilds its inputs by running the calls before it again, without gradients.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Context.h>

#include <fmt/format.h>

#include "comm/groups.hpp"
#include "comm/quantized.hpp"
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
  std::vector<at::Tensor> kept;     ///< keep_for_recompute's tensors, until backward
  std::vector<bool> kept_optional;  ///< per `kept`: kept only to skip products (in the budget)
  size_t next_kept = 0;
  std::shared_ptr<zero::KeepBudget> budget;
  int64_t kept_in_budget = 0;  ///< bytes of `kept` counted against `budget`

  // With offload_activations or units_per_checkpoint > 1 the call holds its inputs itself
  // (`holds_inputs`; autograd saves none): by input position, detached; with offload_activations
  // its activations as host copies between forward and fetch() (while the host budget allows),
  // then as device tensors whose copies `fetches` are waited for. Undefined where rebuilt from
  // the previous call's outputs (`from_previous`). The required `kept` tensors go to the host
  // too.
  bool holds_inputs = false;
  std::vector<at::Tensor> inputs;
  /// Per input position: the index of the previous call's output it is, to be rebuilt in
  /// backward; -1: held. Empty: nothing rebuilt (the call starts a span).
  std::vector<int> from_previous;
  int64_t span_position = 0;  ///< 0: this call saves its inputs; k: k calls after the one that did
  /// The call's outputs (weakly: only to recognize them as the next call's inputs).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> outputs;
  std::shared_ptr<zero::ActivationHost> host;  ///< null without offload_activations
  std::vector<int64_t> fetches;
  int64_t host_bytes = 0;
  bool fetched = false;
  bool inputs_dropped = false;  ///< after the recomputation: a second backward cannot run
  /// The unit call before this one in forward (a UnitCall: a weak pointer to the class being
  /// defined does not compile).
  c10::weak_intrusive_ptr<torch::CustomClassHolder> previous{
      c10::intrusive_ptr<torch::CustomClassHolder>()};

  /// Drops what was kept (the recomputation holds what it still needs) and gives the budget back.
  void drop_kept() {
    kept.clear();
    kept_optional.clear();
    inputs_dropped = inputs_dropped || holds_inputs;
    inputs.clear();
    // Copies fetched for a backward that never ran: the stream forgets them once waited for.
    for (int64_t ticket : fetches) host->copies.device_wait(ticket);
    fetches.clear();
    if (kept_in_budget > 0) budget->used -= kept_in_budget;
    kept_in_budget = 0;
    if (!fetched && host_bytes > 0) host->bytes -= host_bytes;
    host_bytes = 0;
  }
  ~UnitCall() override { drop_kept(); }  // a graph freed before its backward
};

// The last unit call of the forward pass on this thread, for its successor's `previous`.
thread_local c10::weak_intrusive_ptr<torch::CustomClassHolder> last_call{
    c10::intrusive_ptr<torch::CustomClassHolder>()};

// An activation: what a unit's recomputation differentiates (not a mask or positions).
bool is_activation(const at::Tensor& x) {
  return x.defined() && x.requires_grad() && at::isFloatingType(x.scalar_type());
}

// The host bytes a copy of `t` takes: page-locked blocks come rounded up to a power of two.
int64_t host_bytes_of(const at::Tensor& t) {
  const auto n = static_cast<uint64_t>(t.nbytes());
  if (!t.is_cuda() || n == 0) return static_cast<int64_t>(n);
  uint64_t block = 1;
  while (block < n) block <<= 1;
  return static_cast<int64_t>(block);
}

// A host copy of `t` sent on the activation stream (page-locked when `t` is on a GPU), counted
// in the call's host bytes; `t` itself where the host budget has no room for it.
at::Tensor to_host(UnitCall& call, const at::Tensor& t) {
  zero::ActivationHost& host = *call.host;
  const int64_t bytes = host_bytes_of(t);
  if (host.bytes.load() + call.host_bytes + bytes > host.limit) return t;
  at::Tensor copy = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  host.copies.copy_detached(copy, t);
  call.host_bytes += bytes;
  return copy;
}

// Takes the call's inputs from autograd's keeping: each held detached (activations sent to the
// host with offload_activations) except those rebuilt from the previous call's outputs.
void hold_inputs(UnitCall& call, std::vector<at::Tensor>& saved) {
  call.inputs.assign(saved.size(), at::Tensor());
  for (size_t i = 0; i < saved.size(); ++i) {
    const at::Tensor x = saved[i];
    saved[i] = at::Tensor();
    const bool rebuilt = !call.from_previous.empty() && call.from_previous[i] >= 0;
    if (!x.defined() || rebuilt) continue;
    call.inputs[i] = call.host && is_activation(x) ? to_host(call, x.detach()) : x.detach();
  }
}

void offload_kept(UnitCall& call) {
  for (size_t k = 0; k < call.kept.size(); ++k) {
    if (call.kept_optional[k] || !call.kept[k].defined()) continue;
    call.kept[k] = to_host(call, call.kept[k]);
  }
  const int64_t now = call.host->bytes += call.host_bytes;
  int64_t peak = call.host->peak.load();
  while (now > peak && !call.host->peak.compare_exchange_weak(peak, now)) {
  }
}

// Starts bringing the call's host copies back to the device (once).
void fetch(UnitCall& call) {
  if (call.fetched || call.host_bytes == 0) return;
  zero::EngineImpl& I = *call.impl;
  auto up = [&](at::Tensor& t) {
    if (!t.defined() || !t.is_cpu() || I.S.device.is_cpu()) return;  // a CPU rank: usable
    at::Tensor device = at::empty(t.sizes(), t.options().device(I.S.device));
    call.fetches.push_back(call.host->copies.copy(device, t));
    t = device;
  };
  for (at::Tensor& x : call.inputs) up(x);
  for (size_t k = 0; k < call.kept.size(); ++k) {
    if (!call.kept_optional[k]) up(call.kept[k]);
  }
  call.host->bytes -= call.host_bytes;
  call.fetched = true;
}

thread_local bool recomputing = false;
thread_local UnitCall* keeping_call = nullptr;  // the call whose pass keeps or reads `kept`

struct KeepingGuard {
  explicit KeepingGuard(UnitCall* call) : before(keeping_call) { keeping_call = call; }
  ~KeepingGuard() { keeping_call = before; }
  UnitCall* before;
};

struct RecomputeGuard {
  explicit RecomputeGuard(bool now = true) : before(recomputing) { recomputing = now; }
  ~RecomputeGuard() { recomputing = before; }
  bool before;
};

struct DepthGuard {
  explicit DepthGuard(int& d) : depth(d) { ++depth; }
  ~DepthGuard() { --depth; }
  int& depth;
};

// Runs with a call's random state of its first pass, then puts the current state back (on an
// exception too): a recomputation or rebuild draws the forward's dropout masks again.
struct ReplayedRandom {
  ReplayedRandom(const UnitCall& call, at::Device device)
      : device(device),
        cpu_now(rng::state(at::kCPU)),
        device_now(device.is_cuda() ? rng::state(device) : at::Tensor()) {
    rng::set_state(at::kCPU, call.cpu_rng);
    if (device_now.defined()) rng::set_state(device, call.device_rng);
  }
  ~ReplayedRandom() {
    rng::set_state(at::kCPU, cpu_now);
    if (device_now.defined()) rng::set_state(device, device_now);
  }
  at::Device device;
  at::Tensor cpu_now, device_now;
};

UnitCall* previous_of(const UnitCall& call) {
  return static_cast<UnitCall*>(call.previous.lock().get());
}

std::vector<at::Tensor> rebuilt_outputs(UnitCall& call);

// The inputs of a call that holds them, for its recomputation or its successor's rebuilding:
// the host copies brought back (waited for), the rebuilt ones run again from the call before.
std::vector<at::Tensor> unit_inputs(UnitCall& call) {
  if (call.host) {
    fetch(call);
    for (int64_t ticket : call.fetches) call.host->copies.device_wait(ticket);
    call.fetches.clear();
  }
  std::vector<at::Tensor> in = call.inputs;
  if (!call.from_previous.empty()) {
    auto previous = c10::static_intrusive_pointer_cast<UnitCall>(call.previous.lock());
    if (!previous || previous->inputs_dropped) {
      throw InvalidArgument(fmt::format(
          "recompute_num_layers: unit '{}' rebuilds its inputs from the unit call before it, "
          "whose graph was already freed or back-propagated; run backward once over the whole "
          "forward pass",
          call.impl->options.units[call.unit].name));
    }
    const std::vector<at::Tensor> outputs = rebuilt_outputs(*previous);
    for (size_t i = 0; i < in.size(); ++i) {
      if (call.from_previous[i] >= 0) in[i] = outputs[static_cast<size_t>(call.from_previous[i])];
    }
  }
  return in;
}

// The outputs of a call's first pass again: its function run on its inputs without gradients,
// with its random state and its parameters gathered, keeping nothing and skipping nothing.
std::vector<at::Tensor> rebuilt_outputs(UnitCall& call) {
  std::vector<at::Tensor> in = unit_inputs(call);
  zero::EngineImpl& I = *call.impl;
  if (I.S.shard_units) I.gather(call.unit, /*forward_order=*/false);
  std::vector<at::Tensor> out;
  {
    ReplayedRandom random(call, I.S.device);
    at::NoGradGuard no_grad;
    DepthGuard depth(I.residency.depth);
    KeepingGuard keeping(nullptr);
    RecomputeGuard first_pass(false);  // the outputs' values are read
    out = call.fn(in);
  }
  return out;
}

// Starts bringing up the host copies of the nearest call before this one that has some (the
// next backward to need them), while this backward runs.
void prefetch_before(UnitCall& call) {
  UnitCall* c = previous_of(call);
  for (int64_t n = 0; c != nullptr && n < call.impl->options.units_per_checkpoint; ++n) {
    if (c->host_bytes > 0) {
      fetch(*c);
      return;
    }
    c = previous_of(*c);
  }
}

class UnitFunction : public torch::autograd::Function<UnitFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& /*dummy*/, at::TensorList inputs,
                                                const c10::IValue& handle) {
    auto call = c10::static_intrusive_pointer_cast<UnitCall>(handle.toCapsule());
    zero::EngineImpl& I = *call->impl;
    ctx->saved_data["call"] = handle;
    for (const at::Tensor& x : inputs)
      call->input_requires_grad.push_back(x.defined() && x.requires_grad());
    std::vector<at::Tensor> saved = inputs.vec();
    if (call->holds_inputs) hold_inputs(*call, saved);
    ctx->save_for_backward(saved);
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
    if (call->host) offload_kept(*call);
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
    if (call->inputs_dropped) {
      throw InvalidArgument(
          "use_unsloth_gc (offload_activations) or recompute_num_layers above 1: a recomputed "
          "unit's backward ran a second time, but its saved inputs were dropped after the first; "
          "back-propagate once per forward pass or turn the option off");
    }
    // This call's inputs: its host copies (unless its successor's backward fetched them), those
    // rebuilt from the calls before it; then the copies of the call whose come up next.
    torch::autograd::variable_list saved =
        call->holds_inputs ? unit_inputs(*call) : ctx->get_saved_variables();
    if (call->host) prefetch_before(*call);
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
    torch::autograd::variable_list outputs;
    {
      ReplayedRandom random(*call, I.S.device);
      at::AutoGradMode enable(true);
      DepthGuard depth(I.residency.depth);
      RecomputeGuard recompute;
      KeepingGuard keeping(call.get());
      call->next_kept = 0;
      outputs = call->fn(detached);
    }
    call->drop_kept();

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

// With units_per_checkpoint > 1 units keep nothing beyond their inputs: the option trades time
// for memory, and what a unit keeps per call would outweigh the inputs it saves.
bool keeps_nothing(const UnitCall& call) {
  return call.impl->options.units_per_checkpoint > 1;
}

bool keep_for_recompute(const at::Tensor& t) {
  if (keeping_call == nullptr || recomputing || keeps_nothing(*keeping_call)) return false;
  keeping_call->kept.push_back(t);
  keeping_call->kept_optional.push_back(false);
  return true;
}

bool keep_for_recompute_if_room(at::TensorList ts) {
  if (keeping_call == nullptr || recomputing || ts.empty() || keeps_nothing(*keeping_call)) {
    return false;
  }
  UnitCall& call = *keeping_call;
  int64_t bytes = 0;
  for (const at::Tensor& t : ts) bytes += static_cast<int64_t>(t.nbytes());
  const int64_t rows = ts[0].dim() > 0 && ts[0].size(-1) > 0 ? ts[0].numel() / ts[0].size(-1) : 1;
  zero::KeepBudget& budget = *call.budget;
  if (budget.used.load() + bytes > budget.limit(rows, call.impl->steps.global)) return false;
  budget.used += bytes;
  call.kept_in_budget += bytes;
  for (const at::Tensor& t : ts) {
    call.kept.push_back(t);
    call.kept_optional.push_back(true);
  }
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
  record(TraceEvent::Kind::kUnitRun, static_cast<int>(unit));
  wait_gathers_before(static_cast<int64_t>(unit));  // the last step's, for this unit's parameters
  const bool sharded = S.shard_units;
  // With spans of several units every unit is recomputed, those not worth it otherwise too
  // (the embeddings, the head): the head then keeps nothing for its backward but its input (the
  // chunked loss's saved rows are one layer input more), and the first layer's input is rebuilt
  // by a lookup instead of held.
  const bool recomputed =
      S.checkpointing && (options.units[unit].recompute || options.units_per_checkpoint > 1);
  if (!sharded && !recomputed) return fn(inputs);
  if (!at::GradMode::is_enabled()) {
    // Evaluation: nothing to recompute later, only parameters to gather.
    if (sharded) gather(unit, true);
    std::vector<at::Tensor> out;
    {
      DepthGuard depth(residency.depth);
      out = fn(inputs);
    }
    if (sharded && !residency.held) release(unit);
    return out;
  }
  auto call = c10::make_intrusive<UnitCall>();
  call->impl = this;
  call->budget = keep_budget;
  call->host = activation_host;
  call->unit = unit;
  call->fn = fn;
  const int64_t span = options.units_per_checkpoint;
  call->holds_inputs = activation_host != nullptr || span > 1;
  if (call->holds_inputs) {
    // The call before on this thread, for the prefetch and the span: whose outputs are all of
    // this call's activations continues its span, unless the span is full.
    auto last = c10::static_intrusive_pointer_cast<UnitCall>(last_call.lock());
    if (last && last->impl == this) {
      call->previous = last_call;
      std::vector<int> from(inputs.size(), -1);
      bool all = span > 1 && last->span_position + 1 < span, any = false;
      for (size_t i = 0; i < inputs.size() && all; ++i) {
        if (!is_activation(inputs[i])) continue;
        for (size_t j = 0; j < last->outputs.size() && from[i] < 0; ++j) {
          if (last->outputs[j].lock().get() == inputs[i].unsafeGetTensorImpl()) {
            from[i] = static_cast<int>(j);
          }
        }
        all = from[i] >= 0;
        any = true;
      }
      if (all && any) {
        call->from_previous = std::move(from);
        call->span_position = last->span_position + 1;
      }
    }
    last_call = c10::weak_intrusive_ptr<torch::CustomClassHolder>(
        c10::intrusive_ptr<torch::CustomClassHolder>(call));
  }
  c10::IValue handle = c10::IValue::make_capsule(call);
  std::vector<at::Tensor> outputs = UnitFunction::apply(dummy, at::TensorList(inputs), handle);
  if (span > 1) {
    for (const at::Tensor& y : outputs) {
      call->outputs.emplace_back(
          y.defined() ? y.getIntrusivePtr()
                      : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    }
  }
  return outputs;
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
      if (s.secondary.defined()) {
        // hpZ: the values have not changed since the last gather over the job; the group's
        // parts of it make the whole without leaving the node.
        st.gathers.push_back(comm::group_all_gather(*comm, s.flat_param, s.secondary, hpz_peers));
      } else {
        // qwZ: in int8 blocks (a quantized base's bytes travel as they are).
        st.gathers.push_back(
            S.quantized_weights && !bucket.raw
                ? comm::quantized_all_gather(*comm, s.flat_param, source,
                                             hybrid() ? shard_peers : std::vector<int>{})
                : gather_bucket(bucket, s.flat_param, source));
        st.sources.push_back(source);
        if (!hpz_peers.empty()) st.keep_secondary.push_back(b);
      }
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
  for (int b : st.keep_secondary) {
    BucketState& s = buckets[static_cast<size_t>(b)];
    const int64_t part = s.flat_param.numel() / static_cast<int64_t>(hpz_peers.size());
    s.secondary = s.flat_param.narrow(0, (S.rank % S.hpz_group) * part, part).clone();
  }
  st.keep_secondary.clear();
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

void Engine::hold_units() {
  zero::EngineImpl& I = *impl_;
  if (!I.S.shard_units) return I.finish_publishing();
  if (I.steps.awaiting_step)
    throw InvalidArgument("Engine::hold_units between backward() and step()");
  I.finish_publishing();
  // Every gather is issued before any is waited on, in unit order on every rank.
  for (size_t u = 0; u < I.units.size(); ++u) {
    if (I.units[u].status == zero::EngineImpl::UnitStatus::kReleased) I.start_gather(u);
  }
  for (size_t u = 0; u < I.units.size(); ++u) {
    if (I.units[u].status == zero::EngineImpl::UnitStatus::kGathering) I.finish_gather(u);
  }
  I.residency.held = true;
}

void Engine::release_units() {
  zero::EngineImpl& I = *impl_;
  if (!I.residency.held) return;
  I.residency.held = false;
  for (size_t u = 0; u < I.units.size(); ++u) I.release(u);
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
