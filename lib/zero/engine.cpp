// The engine's two calls per micro-step — backward() and step() — and its public API. The
// parts they drive are listed in engine_impl.hpp.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "comm/agreement.hpp"
#include "comm/groups.hpp"
#include "util/log.hpp"
#include "zero/copy_stream.hpp"
#include "zero/engine_impl.hpp"
#include "zero/offload.hpp"
#include "zero/update_in_backward.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using zero::EngineImpl;

void zero::EngineImpl::record(TraceEvent::Kind kind, int index) {
  if (options.trace) trace.push_back(TraceEvent{kind, steps.micro, index});
}

at::Tensor zero::EngineImpl::slice_of(int bucket, const at::Tensor& state) const {
  const zero::Bucket& b = layout.buckets[static_cast<size_t>(bucket)];
  return state.narrow(0, b.shard.offset, b.shard_numel);
}

namespace {

// Back-propagates `loss` × `factor` (in fp32) through the gradient strategy.
void run_backward(EngineImpl& I, const at::Tensor& loss, double factor) {
  if (I.steps.awaiting_step) {
    throw InvalidArgument("Engine::backward called twice without step() in between");
  }
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    throw InvalidArgument("Engine::backward needs a scalar loss that requires grad");
  }
  {
    at::NoGradGuard no_grad;
    I.steps.nonfinite_losses.add_(
        at::isfinite(loss.detach()).logical_not().to(at::kFloat).reshape({}));
  }
  I.finish_publishing();  // a forward that ran no unit left the last step's gathers
  I.begin_backward();
  at::Tensor scaled = loss.to(at::kFloat).reshape({}) * factor;
  scaled.backward();
  I.finish_backward();
  ++I.steps.micro;
  I.steps.awaiting_step = true;
}

}  // namespace

void Engine::backward(const at::Tensor& loss) {
  EngineImpl& I = *impl_;
  // DeepSpeed: mean over accumulation steps here, mean over ranks in the reduction.
  run_backward(I, loss, I.scaler.scale() / static_cast<double>(I.S.accumulation));
}

void Engine::backward(const at::Tensor& loss, double divisor) {
  EngineImpl& I = *impl_;
  if (!(divisor > 0.0) || !std::isfinite(divisor)) {
    throw InvalidArgument(
        fmt::format("Engine::backward: the divisor must be positive and finite, got {}", divisor));
  }
  // The loss is a sum: the reduction's 1/world is undone.
  run_backward(I, loss, I.scaler.scale() * static_cast<double>(I.S.world) / divisor);
}

void Engine::backward_tokens(const at::Tensor& loss, int64_t count) {
  EngineImpl& I = *impl_;
  if (count < 0) throw InvalidArgument("Engine::backward_tokens: negative count");
  const double n = static_cast<double>(count);
  if (I.in_backward) {
    // Updates inside backward cannot be corrected afterwards; they run only at one rank
    // without accumulation, where this micro-batch's count is the window's.
    run_backward(I, loss, I.scaler.scale() / std::max(1.0, n));
    return;
  }
  // A fixed estimate of the window's count keeps the accumulating gradients near a mean's
  // magnitude (what fp16 needs); step() rescales them to the real count. Every rank must scale
  // alike: the estimate is agreed once, from the largest first count.
  if (I.tokens.estimate <= 0.0) {
    const double first = comm::reduce_scalars(*I.comm, {n}, ReduceOp::kMax)[0];
    I.tokens.estimate = std::max(1.0, first) * I.S.world * I.S.accumulation;
  }
  run_backward(I, loss, I.scaler.scale() * static_cast<double>(I.S.world) / I.tokens.estimate);
  I.tokens.count += n;
  I.tokens.open = true;
}

bool Engine::at_boundary() const {
  return impl_->steps.awaiting_step && impl_->at_boundary();
}

namespace {

struct BoundaryStats {
  double scaled_norm = 0.0;  ///< of the accumulated gradients, loss scale included
  double bad_losses = 0.0;   ///< non-finite losses of the window, all ranks
  double tokens = 0.0;       ///< backward_tokens: the window's count, all ranks
};

at::Tensor squared_norm(const at::Tensor& g) {
  return g.numel() > 0
             ? at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kFloat).pow(2).reshape({1})
             : at::zeros({1}, g.options().dtype(at::kFloat));
}

// One all-reduce carries the squared norm of this rank's slices, the count of non-finite
// losses and (backward_tokens) the window's count. Replicated buckets (stage 0) hold the same
// values on every rank: rank 0 speaks for them (the first MiCS group for its slices), and the
// first of a rank's peers for its local buckets.
BoundaryStats boundary_stats(EngineImpl& I) {
  const at::Tensor& g = I.grad_acc;
  const zero::Layout& L = I.layout;
  const int64_t a = L.local_state_begin, b = L.local_state_end;
  // Slices held by every rank (stage 0) or by every MiCS group: one rank or group speaks.
  const bool speaks = L.replicated ? I.S.rank == 0 : I.writes_slices();
  at::Tensor local_sq;
  if (a == b || g.numel() == 0) {
    local_sq = squared_norm(g);
    if (!speaks) local_sq.zero_();
  } else {
    local_sq = squared_norm(g.narrow(0, 0, a)) + squared_norm(g.narrow(0, b, g.numel() - b));
    if (!speaks) local_sq.zero_();
    if (!L.replicated || I.local_leader) local_sq += squared_norm(g.narrow(0, a, b - a));
  }
  std::vector<at::Tensor> parts{local_sq, I.steps.nonfinite_losses.reshape({1})};
  if (I.tokens.open) parts.push_back(at::full({1}, I.tokens.count, local_sq.options()));
  at::Tensor stats = at::cat(parts);
  I.comm->all_reduce(stats, ReduceOp::kSum)->wait();
  at::Tensor host = stats.to(at::kCPU).to(at::kDouble);
  I.comm->raise_if_failed();  // after an abort these values (and the gradients) are garbage
  BoundaryStats s;
  s.scaled_norm = std::sqrt(host[0].item<double>());
  s.bad_losses = host[1].item<double>();
  if (I.tokens.open) s.tokens = host[2].item<double>();
  return s;
}

void throw_nonfinite(const EngineImpl& I, bool loss) {
  throw NumericError(fmt::format(
      "non-finite {} at optimizer step {} (micro-step {}, {}): training diverged or the data "
      "has a problem; lower the learning rate or check the inputs",
      loss ? "loss" : "gradient norm", I.steps.global, I.steps.micro, c10::toString(I.S.compute)));
}

// The optimizer over every trainable bucket, then the compute copies refreshed: within the
// step, or (step_gather_unit) by the next forward.
void apply_update(EngineImpl& I, const UpdateHyper& h) {
  if (I.offload) {
    I.offload->step(h);
  } else {
    I.optimizer->step(I.grad_acc, h);
    for (const zero::Bucket& b : I.layout.buckets) {
      if (!b.trainable) continue;
      const int unit = I.step_gather_unit[static_cast<size_t>(b.index)];
      if (unit >= 0) {
        I.publishing.deferred.push_back({unit, b.index, nullptr, at::Tensor()});
      } else {
        I.publish(b, I.slice_of(b.index, I.master));
      }
    }
  }
  I.wait_published();
}

}  // namespace

bool Engine::step(double gradient_scale) {
  EngineImpl& I = *impl_;
  if (!(gradient_scale > 0.0) || !std::isfinite(gradient_scale)) {
    throw InvalidArgument(fmt::format(
        "Engine::step: gradient_scale must be positive and finite, got {}", gradient_scale));
  }
  if (!I.steps.awaiting_step) throw InvalidArgument("Engine::step called without backward()");
  I.finish_publishing();  // a forward that ran no unit left the last step's gathers
  I.steps.awaiting_step = false;
  if (!I.at_boundary()) return false;
  if (I.in_backward && gradient_scale != 1.0) {
    throw InvalidArgument(fmt::format(
        "Engine::step: gradient_scale {} with updates applied during backward "
        "(EngineOptions::update_in_backward): pass the normalizer to backward(loss, divisor)",
        gradient_scale));
  }
  ++I.steps.global;
  at::NoGradGuard no_grad;
  if (I.in_backward) {
    I.in_backward->finish_step();
    return true;
  }
  I.gradients->before_step();
  const BoundaryStats st = boundary_stats(I);
  if (I.tokens.open) {
    gradient_scale *= I.tokens.estimate / std::max(1.0, st.tokens);
    I.tokens.count = 0.0;
    I.tokens.open = false;
  }
  const double scale = I.scaler.scale();
  const bool overflow = !std::isfinite(st.scaled_norm);
  I.steps.nonfinite_losses.zero_();
  if (!I.S.fp16 && (overflow || st.bad_losses > 0)) throw_nonfinite(I, st.bad_losses > 0);
  if (I.S.fp16) I.scaler.update(overflow);  // throws at the minimum scale
  if (overflow) {
    I.steps.last_skipped = true;
    I.steps.last_norm = std::numeric_limits<double>::infinity();
    I.gradients->clear();
    log::info("fp16 overflow at step {}: skipped, loss scale now {}", I.steps.global,
              I.scaler.scale());
    return true;
  }
  // Unscale and clip with one factor (DeepSpeed: 1 / (scale · max(1, (norm + 1e-6) / clip))),
  // applied inside the optimizer's pass over the gradients.
  const double norm = st.scaled_norm * gradient_scale / scale;
  double coef = gradient_scale / scale;
  if (I.S.clip > 0.0 && (norm + 1e-6) / I.S.clip > 1.0) coef /= (norm + 1e-6) / I.S.clip;
  const UpdateHyper h = I.step_hyper(coef);
  apply_update(I, h);
  ++I.steps.applied;
  I.steps.last_lr = h.lr;
  I.steps.last_norm = norm;
  I.steps.last_skipped = false;
  I.gradients->clear();
  return true;
}

UpdateHyper zero::EngineImpl::step_hyper(double grad_scale) const {
  UpdateHyper h = S.hyper;
  h.lr = learning_rate(steps.applied);
  h.grad_scale = grad_scale;
  return h;
}

void zero::EngineImpl::publish(const zero::Bucket& b, const at::Tensor& mine) {
  BucketState& s = buckets[static_cast<size_t>(b.index)];
  if (b.sharded_params) {
    s.param_shard.copy_(mine);
    s.secondary = at::Tensor();  // hpZ: the next gather is over the job again
  } else if (b.replicated || S.world == 1) {
    if (!s.flat_param.is_same(mine) && s.flat_param.data_ptr() != mine.data_ptr())
      s.flat_param.copy_(mine);
  } else {
    // All-gathers in flight are bounded by allgather_bucket_size elements; a local bucket's
    // among the ranks holding it.
    at::Tensor piece = mine.to(at::TensorOptions().dtype(S.compute).device(S.device));
    if (publishing.elements > 0 && publishing.elements + b.numel > S.allgather_bucket_size) {
      wait_published();
    }
    publishing.gathers.push_back(gather_bucket(b, s.flat_param, piece));
    publishing.inputs.push_back(piece);
    publishing.elements += b.numel;
  }
}

WorkHandle zero::EngineImpl::gather_bucket(const Bucket& b, const at::Tensor& whole,
                                           const at::Tensor& mine) {
  if (b.local) return comm::group_all_gather(*comm, whole, mine, local_peers);
  if (hybrid()) return comm::group_all_gather(*comm, whole, mine, shard_peers);
  return comm->all_gather(whole, mine);
}

void zero::EngineImpl::wait_published() {
  for (WorkHandle& g : publishing.gathers) g->wait();
  publishing.gathers.clear();
  publishing.inputs.clear();
  publishing.elements = 0;
}

void zero::EngineImpl::wait_gathers_before(int64_t unit) {
  std::vector<Publishing::Deferred>& deferred = publishing.deferred;
  if (deferred.empty()) return;
  if (!deferred.front().gather) {
    // Issued in the order the forward needs them: on one communication stream the first
    // unit's then waits for its own gathers alone.
    std::stable_sort(deferred.begin(), deferred.end(),
                     [](const auto& a, const auto& b) { return a.unit < b.unit; });
    for (Publishing::Deferred& d : deferred) {
      const Bucket& b = layout.buckets[static_cast<size_t>(d.bucket)];
      BucketState& s = buckets[static_cast<size_t>(d.bucket)];
      d.input =
          slice_of(d.bucket, master).to(at::TensorOptions().dtype(S.compute).device(S.device));
      d.gather = gather_bucket(b, s.flat_param, d.input);
    }
  }
  size_t& next = publishing.next_wait;
  for (; next < deferred.size() && deferred[next].unit <= unit; ++next) {
    deferred[next].gather->wait();
    deferred[next].input = at::Tensor();
    record(TraceEvent::Kind::kParameterWait, deferred[next].bucket);
  }
  if (next == deferred.size()) {
    deferred.clear();
    next = 0;
  }
}

void zero::EngineImpl::finish_publishing() {
  wait_gathers_before(std::numeric_limits<int64_t>::max());
  wait_published();
}

void Engine::wait_for_parameters() {
  impl_->finish_publishing();
}

double Engine::learning_rate() const {
  return impl_->steps.last_lr;
}
double Engine::loss_scale() const {
  return impl_->scaler.scale();
}
double Engine::last_grad_norm() const {
  return impl_->steps.last_norm;
}
bool Engine::last_step_skipped() const {
  return impl_->steps.last_skipped;
}
int64_t Engine::global_step() const {
  return impl_->steps.global;
}
int64_t Engine::micro_step() const {
  return impl_->steps.micro;
}
int Engine::gradient_accumulation_steps() const {
  return impl_->S.accumulation;
}
at::ScalarType Engine::compute_dtype() const {
  return impl_->S.compute;
}
int Engine::stage() const {
  return impl_->S.stage;
}
bool Engine::updates_in_backward() const {
  return impl_->S.in_backward();
}
Communicator& Engine::communicator() {
  return *impl_->comm;
}
torch::nn::Module& Engine::module() {
  return *impl_->model;
}
const std::vector<TraceEvent>& Engine::trace() const {
  return impl_->trace;
}

namespace {

// A parameter's whole shape: a rank-local one's block count times its own along dim 0.
std::vector<int64_t> whole_shape(const zero::EngineImpl& I, const zero::ParamInfo& p) {
  std::vector<int64_t> shape = p.shape;
  if (p.rank_local) shape[0] *= I.options.local_split.blocks;
  return shape;
}

// Whether this rank writes a piece of `p` into checkpoints: of a replicated parameter (or a
// slice MiCS's groups each hold) only one rank of those holding it does.
bool writes_piece(const zero::EngineImpl& I, const zero::ParamInfo& p) {
  if (p.rank_local) return !I.layout.replicated || I.local_leader;
  return I.layout.replicated ? I.S.rank == 0 : I.writes_slices();
}

// One of this rank's pieces of the trainable parameters (a rank-local parameter's in the whole
// tensor's elements), with its offset in the flat state.
struct HeldPiece {
  StatePiece piece;
  int64_t offset = 0;
  bool writes = false;  ///< this rank writes it into checkpoints (writes_piece)
};

std::vector<HeldPiece> held_pieces(const zero::EngineImpl& I) {
  const zero::Layout& L = I.layout;
  std::vector<HeldPiece> out;
  for (const zero::Bucket& b : L.buckets) {
    if (!b.trainable) continue;
    const int64_t lo = b.slice_begin();
    for (size_t k = 0; k < b.params.size(); ++k) {
      const zero::ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
      const int64_t a = std::max(lo, b.offsets[k]);
      const int64_t e = std::min(lo + b.shard_numel, b.offsets[k] + p.numel);
      if (a >= e) continue;
      const int64_t block = p.rank_local ? I.options.local_split.index * p.numel : 0;
      out.push_back({StatePiece{p.name, whole_shape(I, p), block + a - b.offsets[k], e - a},
                     b.shard.offset + (a - lo), writes_piece(I, p)});
    }
  }
  return out;
}

// The state tensors in state_kinds() order (host copies made current).
std::vector<at::Tensor> state_tensors(const zero::EngineImpl& I) {
  if (I.offload) I.offload->sync_host();
  std::vector<at::Tensor> out{I.master};
  if (I.optimizer->state0().defined()) out.push_back(I.optimizer->state0());
  if (I.optimizer->state1().defined()) out.push_back(I.optimizer->state1());
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> Engine::trainable_parameters() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const zero::ParamInfo& p : impl_->layout.params) {
    if (p.trainable) out.emplace_back(p.name, whole_shape(*impl_, p));
  }
  return out;
}

std::vector<std::string> Engine::state_kinds() const {
  const EngineImpl& I = *impl_;
  if (I.optimizer->type() == OptimizerType::kSgd) {
    return I.optimizer->state0().defined() ? std::vector<std::string>{"master", "momentum_buffer"}
                                           : std::vector<std::string>{"master"};
  }
  return {"master", "exp_avg", "exp_avg_sq"};
}

std::vector<std::pair<StatePiece, std::vector<at::Tensor>>> Engine::state_pieces() const {
  const EngineImpl& I = *impl_;
  std::vector<std::pair<StatePiece, std::vector<at::Tensor>>> out;
  const std::vector<at::Tensor> tensors = state_tensors(I);
  for (auto& [piece, offset, writes] : held_pieces(I)) {
    if (!writes) continue;
    std::vector<at::Tensor> values;
    for (const at::Tensor& t : tensors) {
      at::Tensor run = t.narrow(0, offset, piece.length);
      values.push_back(run.is_cpu() ? run.clone() : run.cpu());
    }
    out.emplace_back(std::move(piece), std::move(values));
  }
  return out;
}

EngineState Engine::state() const {
  const EngineImpl& I = *impl_;
  EngineState s;
  s.global_steps = I.steps.global;
  s.applied_steps = I.steps.applied;
  s.micro_steps = I.steps.micro;
  s.optimizer_steps = I.optimizer->steps();
  const LossScaler::State& ls = I.scaler.state();
  s.loss_scale = ls.cur_scale;
  s.scaler_iter = ls.cur_iter;
  s.scaler_last_overflow_iter = ls.last_overflow_iter;
  s.scaler_hysteresis = ls.cur_hysteresis;
  return s;
}

void Engine::load_state(const StateReader& read, const EngineState& state) {
  EngineImpl& I = *impl_;
  if (I.steps.awaiting_step)
    throw InvalidArgument("Engine::load_state between backward() and step()");
  at::NoGradGuard no_grad;
  const std::vector<std::string> kinds = state_kinds();
  const std::vector<at::Tensor> tensors = state_tensors(I);
  std::string error;
  try {
    for (const auto& [piece, offset, writes] : held_pieces(I)) {
      for (size_t k = 0; k < kinds.size(); ++k) {
        at::Tensor host =
            at::empty({piece.length}, at::TensorOptions().dtype(tensors[k].scalar_type()));
        read(kinds[k], piece, host);
        tensors[k].narrow(0, offset, piece.length).copy_(host);
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Every rank learns whether all could read before any republishes (a collective).
  const bool others_failed = !comm::failed_ranks(*I.comm, error.empty()).empty();
  if (!error.empty()) throw IoError(error);
  if (others_failed) {
    throw IoError("restoring the optimizer state failed on another rank (see its error)");
  }
  I.optimizer->set_state(state.optimizer_steps, at::Tensor(), at::Tensor());
  if (I.offload) I.offload->load_from_host();
  LossScaler::State ls;
  ls.cur_scale = state.loss_scale;
  ls.cur_iter = state.scaler_iter;
  ls.last_overflow_iter = state.scaler_last_overflow_iter;
  ls.cur_hysteresis = state.scaler_hysteresis;
  I.scaler.set_state(ls);
  // Saved at a boundary; with another accumulation count (another world size, same global
  // batch) the micro-step count restarts from the boundary in this run's terms.
  I.steps.global = state.global_steps;
  I.steps.applied = state.applied_steps;
  I.steps.micro = state.global_steps * I.S.accumulation;
  I.steps.last_lr = I.learning_rate(I.steps.applied);
  for (const zero::Bucket& b : I.layout.buckets) {
    if (b.trainable) I.publish(b, I.slice_of(b.index, I.master));
  }
  I.finish_publishing();
}

EngineMemory Engine::memory() const {
  const EngineImpl& I = *impl_;
  EngineMemory m;
  for (const zero::BucketState& s : I.buckets) {
    if (s.param_shard.defined()) m.compute_params += s.param_shard.nbytes();
    if (s.flat_param.defined() && !s.param_shard.defined())
      m.compute_params += s.flat_param.nbytes();
    if (s.secondary.defined()) m.compute_params += s.secondary.nbytes();
    if (s.flat_grad.defined()) m.gradients += s.flat_grad.nbytes();
  }
  m.gradients += I.grad_acc.nbytes();
  m.optimizer_state = I.optimizer->state_bytes(/*with_master=*/!I.S.master_aliases_params);
  if (I.offload) m.device_optimizer_state = I.offload->device_state_bytes();
  m.optimizer_state += m.device_optimizer_state;
  m.gathered_now = I.residency.gathered_now;
  m.gathered_peak = I.residency.gathered_peak;
  if (I.activation_host) m.host_activations_peak = I.activation_host->peak.load();
  auto count_host = [&](const at::Tensor& t) {
    if (!I.S.device.is_cuda() || !t.defined() || !t.is_cpu()) return;
    (t.is_pinned() ? m.host_pinned : m.host_pageable) += static_cast<int64_t>(t.nbytes());
  };
  for (const zero::BucketState& s : I.buckets) count_host(s.param_shard);
  count_host(I.master);
  count_host(I.optimizer->state0());
  count_host(I.optimizer->state1());
  if (I.offload) {
    for (const at::Tensor& slot : I.offload->gradient_slots()) count_host(slot);
  }
  return m;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::gather_full_parameters(
    bool trainable_only) {
  EngineImpl& I = *impl_;
  const zero::Layout& L = I.layout;
  at::NoGradGuard no_grad;
  I.finish_publishing();
  if (I.offload) I.offload->sync_host();
  std::vector<at::Tensor> full_of_bucket(L.buckets.size());
  for (const zero::Bucket& b : L.buckets) {
    if (trainable_only && !b.trainable) continue;
    at::Tensor full;
    if (b.trainable) {
      at::Tensor mine =
          I.master.narrow(0, b.shard.offset, b.shard_numel).to(I.S.device, at::kFloat);
      if (b.replicated) {
        full = mine;
      } else {
        full = at::empty({b.numel}, mine.options());
        I.gather_bucket(b, full, mine)->wait();
      }
    } else if (b.sharded_params) {
      at::Tensor mine = I.buckets[static_cast<size_t>(b.index)].param_shard.to(I.S.device);
      full = at::empty({b.numel}, mine.options());
      I.gather_bucket(b, full, mine)->wait();
    } else {
      full = I.buckets[static_cast<size_t>(b.index)].flat_param;
    }
    full_of_bucket[static_cast<size_t>(b.index)] = full;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < L.params.size(); ++i) {
    const zero::ParamInfo& p = L.params[i];
    const zero::Bucket& b = L.buckets[static_cast<size_t>(I.slots[i].bucket)];
    if (trainable_only && !b.trainable) continue;
    const at::Tensor& full = full_of_bucket[static_cast<size_t>(b.index)];
    at::Tensor values = full.narrow(0, I.slots[i].offset, p.numel);
    if (p.rank_local && !I.options.local_split.holders.empty()) {
      // The whole from the holders of its blocks, in block order (dim 0).
      at::Tensor whole = at::empty({I.options.local_split.blocks * p.numel}, values.options());
      comm::group_all_gather(*I.comm, whole, values.contiguous(), I.options.local_split.holders)
          ->wait();
      // On the host at once: the whole experts of every layer would not fit beside the model.
      out.emplace_back(p.name, whole.view(whole_shape(I, p)).cpu());
      continue;
    }
    out.emplace_back(p.name, values.view(p.shape).clone());
  }
  return out;
}

}  // namespace zt
