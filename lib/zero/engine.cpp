// Engine set-up, the optimizer step and the public API. Gradient reduction lives in
// gradients.cpp, sharding units in units.cpp.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>

#include <fmt/format.h>

#include "comm/agreement.hpp"
#include "kernels/adam_cpu.hpp"
#include "util/log.hpp"
#include "zero/copy_stream.hpp"
#include "zero/engine_impl.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using zero::EngineImpl;

bool applies_weight_decay(const std::string& parameter_name) {
  std::string name;
  for (char c : parameter_name)
    name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name.find("bias") != std::string::npos || name.find("layernorm") != std::string::npos ||
      name.find("rmsnorm") != std::string::npos) {
    return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('.', start);
    std::string part =
        name.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (part == "norm" || (part.size() > 5 && part.compare(part.size() - 5, 5, "_norm") == 0)) {
      return false;
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return true;
}

void zero::EngineImpl::record(TraceEvent::Kind kind, int index) {
  if (options.trace) trace.push_back(TraceEvent{kind, micro_steps, index});
}

namespace {

at::ScalarType wire_dtype(CommDataType c, at::ScalarType compute) {
  switch (c) {
    case CommDataType::kFp32:
      return at::kFloat;
    case CommDataType::kFp16:
      return at::kHalf;
    case CommDataType::kBf16:
      return at::kBFloat16;
    case CommDataType::kDefault:
      return compute;
  }
  return compute;
}

bool schedule_needs_total(const DeepSpeedConfig& ds, const TrainingArguments& args) {
  if (ds.scheduler.present) {
    return ds.scheduler.type == SchedulerType::kWarmupDecayLR ||
           ds.scheduler.type == SchedulerType::kWarmupCosineLR;
  }
  return args.lr_scheduler_type != "constant" && args.lr_scheduler_type != "constant_with_warmup" &&
         args.lr_scheduler_type != "inverse_sqrt";
}

// Each parameter's unit: the first unit whose module holds it; one held by two units (tied
// weights) gets -2: it belongs to none (so it stays whole under stage 3) and its gradient
// arrives once per unit that uses it.
std::unordered_map<const void*, int> unit_of_parameters(const std::vector<UnitSpec>& units) {
  std::unordered_map<const void*, int> unit_of;
  for (size_t u = 0; u < units.size(); ++u) {
    if (!units[u].module) {
      throw InvalidArgument(
          fmt::format("EngineOptions::units[{}] ('{}') has no module", u, units[u].name));
    }
    for (const at::Tensor& p : units[u].module->parameters(true)) {
      auto [it, fresh] = unit_of.emplace(p.unsafeGetTensorImpl(), static_cast<int>(u));
      if (!fresh && it->second != static_cast<int>(u)) it->second = -2;
    }
  }
  return unit_of;
}

// `numel` floats of host memory, owned by the returned tensor, that `touch` writes first (it must
// write every element: fresh pages land in the memory of the thread that first writes them),
// then, with `pin`, page-locked where they are (zero::page_lock).
at::Tensor placed_host_floats(int64_t numel, bool pin, const std::function<void(float*)>& touch) {
  // Whole pages, so that locking them locks no page another allocation shares.
  const size_t bytes =
      (static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(float) + 4095) / 4096 * 4096;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    throw OutOfMemoryError(
        fmt::format("cannot allocate {} bytes of host memory for optimizer state", bytes));
  }
  touch(static_cast<float*>(p));
  if (pin) {
    const std::string error = zero::page_lock(p, bytes);
    if (!error.empty()) {
      std::free(p);
      throw OutOfMemoryError(
          fmt::format("cannot page-lock {} bytes of host memory for offloaded state: {} "
                      "(raise the locked-memory limit, `ulimit -l`, or free host memory)",
                      bytes, error));
    }
  }
  return at::from_blob(
      p, {numel},
      [pin](void* q) {
        if (pin) zero::page_unlock(q);
        std::free(q);
      },
      at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const DeepSpeedConfig& ds,
               const TrainingArguments& args, std::shared_ptr<Communicator> comm,
               EngineOptions options)
    : impl_(std::make_unique<EngineImpl>()) {
  EngineImpl& I = *impl_;
  if (!model) throw InvalidArgument("Engine: model is null");
  if (!comm) throw InvalidArgument("Engine: communicator is null");
  check_resolved(ds);
  I.ds = ds;
  I.args = args;
  I.options = std::move(options);
  I.model = std::move(model);
  I.comm = std::move(comm);
  I.stage = ds.zero.stage;
  I.world = I.comm->world_size();
  I.rank = I.comm->rank();
  I.accumulation = static_cast<int>(ds.gradient_accumulation_steps.value());
  I.device = I.options.device;
  if (I.comm->device().type() != I.device.type()) {
    throw ConfigError(fmt::format("Engine: the communicator runs on {} but the model on {}",
                                  I.comm->device().str(), I.device.str()));
  }

  // Precision. fp16 on CPU computes in fp32 (LibTorch 1.13 has no CPU half matmul) while the
  // loss scaler still runs, so the fp16 code path stays exercised.
  const bool fp16 = ds.fp16.enabled.value(), bf16 = ds.bf16.enabled.value();
  I.compute = bf16 ? at::kBFloat16 : fp16 ? at::kHalf : at::kFloat;
  if (fp16 && I.device.is_cpu()) {
    I.compute = at::kFloat;
    log::warn(
        "fp16 on CPU: computing in fp32 (no CPU half matmul); the dynamic loss scaler "
        "still runs");
  }
  if (fp16) I.scaler = LossScaler(ds.fp16.scaler());
  if ((ds.bf16.master_weights_and_grads || ds.bf16.optimizer_states) && !bf16) {
    throw ConfigError(
        fmt::format("{}: bf16.bf16_master_weights_and_grads / bf16_optimizer_states "
                    "need bf16.enabled",
                    ds.source));
  }
  if (ds.bf16.master_weights_and_grads) I.master_dtype = at::kBFloat16;
  I.wire = wire_dtype(ds.communication_data_type, I.compute);
  I.overlap = I.stage == 0 || ds.zero.overlap();
  I.use_reduce_scatter = ds.zero.reduce_scatter;
  const double w = static_cast<double>(I.world), f = ds.gradient_predivide_factor;
  I.pre_scale = ds.prescale_gradients ? 1.0 / w : 1.0 / f;
  I.post_scale = ds.prescale_gradients ? 1.0 : f / w;
  I.offload_optimizer = I.stage >= 1 && ds.zero.offload_optimizer.enabled();
  I.offload_param = I.stage == 3 && ds.zero.offload_param.enabled();
  if (I.offload_optimizer && I.master_dtype != at::kFloat) {
    throw ConfigError(
        fmt::format("{}: bf16_master_weights_and_grads cannot be combined with "
                    "offload_optimizer (the CPU optimizer keeps fp32 masters)",
                    ds.source));
  }
  I.checkpointing = I.options.activation_checkpointing || I.stage == 3;
  I.prefetch_elements = ds.zero.stage3_prefetch_bucket_size.value();
  I.max_live_elements = ds.zero.stage3_max_live_parameters;
  if (I.stage == 3 && I.options.units.empty()) {
    log::warn(
        "ZeRO-3 without sharding units keeps every parameter whole on every rank (stage 2 "
        "memory); declare EngineOptions::units to partition parameters");
  }
  if (schedule_needs_total(ds, args) && I.options.total_train_steps <= 0) {
    throw ConfigError(
        fmt::format("the learning-rate schedule '{}' needs the run length: set max_steps (without "
                    "a train_file there "
                    "are no epochs to count), or use lr_scheduler_type constant",
                    ds.scheduler.present ? ds.scheduler.type_name : args.lr_scheduler_type));
  }
  I.schedule = LrSchedule::from_config(ds, args, I.options.total_train_steps);

  // Parameters and layout. With a source the module's own values are placeholders or
  // irrelevant and are never moved.
  const bool from_source = I.options.source != nullptr;
  if (!from_source) I.model->to(I.device);
  std::unordered_map<const void*, int> unit_of = unit_of_parameters(I.options.units);
  std::vector<zero::ParamInfo> params;
  for (const auto& item : I.model->named_parameters(true)) {
    zero::ParamInfo p;
    p.name = item.key();
    p.param = item.value();
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.trainable = p.param.requires_grad();
    p.decay = applies_weight_decay(p.name);
    auto it = unit_of.find(p.param.unsafeGetTensorImpl());
    p.unit = it == unit_of.end() ? -1 : std::max(-1, it->second);
    p.shared = it != unit_of.end() && it->second == -2;
    params.push_back(std::move(p));
  }
  bool any_trainable = false;
  for (const zero::ParamInfo& p : params) any_trainable = any_trainable || p.trainable;
  if (!any_trainable) throw ConfigError("Engine: the model has no trainable parameters");
  zero::LayoutOptions lo;
  lo.stage = I.stage;
  lo.world = I.world;
  lo.rank = I.rank;
  lo.bucket_size = std::max<int64_t>(1, ds.zero.reduce_bucket_size.value());
  lo.persistence_threshold = ds.zero.stage3_param_persistence_threshold.value();
  lo.num_units = static_cast<int>(I.options.units.size());
  I.layout = zero::build_layout(std::move(params), lo);
  const zero::Layout& L = I.layout;
  I.bucket_of_param.assign(L.params.size(), -1);
  I.fired.assign(L.params.size(), 0);
  I.slot_of_param.assign(L.params.size(), -1);
  for (const zero::Bucket& b : L.buckets) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      I.bucket_of_param[static_cast<size_t>(b.params[k])] = b.index;
      I.slot_of_param[static_cast<size_t>(b.params[k])] = static_cast<int>(k);
    }
  }
  for (size_t i = 0; i < L.params.size(); ++i) {
    I.param_of_impl[L.params[i].param.unsafeGetTensorImpl()] = static_cast<int>(i);
  }

  // Storage. Every bucket is assembled in fp32 from the module's initial values and broadcast
  // from rank 0, so all ranks start from the same weights whatever the stage and world size;
  // then each rank keeps what its stage keeps.
  const auto host =
      at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(I.device.is_cuda());
  const auto dev32 = at::TensorOptions().dtype(at::kFloat).device(I.device);
  I.bucket_segments.resize(L.buckets.size());
  for (const zero::Bucket& b : L.buckets) {
    if (!b.trainable) continue;
    for (const Segment& seg : L.segments) {
      if (seg.offset >= b.shard.offset && seg.offset < b.shard.offset + b.shard_numel) {
        I.bucket_segments[static_cast<size_t>(b.index)].push_back(seg);
      }
    }
  }
  // Offloaded masters are written first by the threads of the CPU optimizer's per-bucket
  // updates (pages stay where they were first touched), then page-locked in place.
  const std::vector<std::vector<Segment>> no_groups;
  const std::vector<std::vector<Segment>>& update_groups =
      I.offload_optimizer ? I.bucket_segments : no_groups;
  if (I.offload_optimizer) {
    I.master = placed_host_floats(L.state_numel, I.device.is_cuda(), [&](float* p) {
      kernels::adam_cpu_first_touch({p}, L.state_numel, update_groups);
    });
  } else {
    I.master = at::zeros({L.state_numel}, dev32.dtype(I.master_dtype));
  }
  // bf16 masters on a rank that keeps whole buckets are the parameters themselves.
  I.master_aliases_params =
      I.master_dtype == I.compute && !I.offload_optimizer && (L.replicated || I.world == 1);
  // One rank whose gradients are already in the masters' dtype needs no reduction or staging:
  // the optimizer either runs inside backward, or reads the gradients autograd accumulates
  // straight into grad_acc.
  const bool plain_gradients = I.world == 1 && I.master_dtype == I.compute;
  bool any_shared = false;
  for (const zero::ParamInfo& p : L.params) any_shared = any_shared || (p.trainable && p.shared);
  I.in_backward = I.options.update_in_backward && plain_gradients && !I.offload_optimizer &&
                  I.stage <= 2 && I.accumulation == 1 && !fp16 &&
                  !(ds.gradient_clipping.value() > 0.0) && !any_shared;
  I.grads_in_acc = plain_gradients && !I.in_backward;
  I.grad_acc = at::zeros({I.in_backward ? 0 : L.state_numel}, dev32.dtype(I.master_dtype));
  // Each parameter's Σ g² in a slot of its own (on the GPU added by the AdamW kernel's own pass
  // over the gradient, elsewhere by a norm kernel), summed once at step().
  if (I.in_backward) I.param_grad_sq = at::zeros({static_cast<int64_t>(L.params.size())}, dev32);
  if (I.offload_optimizer) {
    int64_t longest = 0, trainable = 0;
    for (const zero::Bucket& b : L.buckets) {
      if (!b.trainable) continue;
      longest = std::max(longest, b.shard_numel);
      ++trainable;
    }
    for (int64_t k = 0; k < std::min<int64_t>(3, trainable); ++k)
      I.grad_slots.push_back(at::empty({longest}, host));
  }
  I.buckets.resize(L.buckets.size());
  at::NoGradGuard no_grad;
  at::Tensor staging;  // host fp32, reused by every bucket read from the source
  for (const zero::Bucket& b : L.buckets) {
    EngineImpl::BucketState& s = I.buckets[static_cast<size_t>(b.index)];
    const int64_t lo = b.slice_begin(I.rank, L.replicated);
    at::Tensor slice;  // this rank's slice of the bucket, fp32, on the device
    at::Tensor full;   // the whole bucket when this rank keeps it whole
    if (from_source) {
      // Every rank reads what it keeps straight from the source (the same values everywhere):
      // sharded buckets only their slice, so no rank ever holds the whole model.
      const bool whole = !b.sharded_params;
      const int64_t begin = whole ? 0 : lo, len = whole ? b.numel : b.shard_numel;
      // For a GPU, one host staging buffer serves all buckets (fresh pages for every bucket
      // cost more in page faults than the reads on a 7B model); on the host the buffer is kept.
      at::Tensor host;
      if (I.device.is_cpu()) {
        host = at::empty({len}, at::TensorOptions().dtype(at::kFloat));
      } else {
        if (staging.numel() < len)
          staging = at::empty({len}, at::TensorOptions().dtype(at::kFloat));
        host = staging.narrow(0, 0, len);
      }
      // Parameters lie in increasing offsets; only the alignment padding between them (and
      // after the last) is zeroed here, the rest is written by the reads.
      int64_t filled = begin;
      for (size_t k = 0; k < b.params.size(); ++k) {
        const zero::ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
        const int64_t a = std::max(begin, b.offsets[k]);
        const int64_t e = std::min(begin + len, b.offsets[k] + p.numel);
        if (a >= e) continue;
        if (a > filled) host.narrow(0, filled - begin, a - filled).zero_();
        I.options.source->read(p.name, p.shape, a - b.offsets[k], host.narrow(0, a - begin, e - a));
        filled = e;
      }
      if (begin + len > filled) host.narrow(0, filled - begin, begin + len - filled).zero_();
      at::Tensor values = host.to(I.device);  // a blocking copy: the staging buffer is free again
      if (whole) {
        full = values;
        slice = full.narrow(0, lo, b.shard_numel);
      } else {
        slice = values;
      }
    } else {
      full = at::zeros({b.numel}, dev32);
      for (size_t k = 0; k < b.params.size(); ++k) {
        const zero::ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
        full.narrow(0, b.offsets[k], p.numel).copy_(p.param.reshape({-1}));
      }
      I.comm->broadcast(full, 0)->wait();
      slice = full.narrow(0, lo, b.shard_numel);
    }
    if (b.trainable) I.master.narrow(0, b.shard.offset, b.shard_numel).copy_(slice);
    if (b.sharded_params) {
      if (I.offload_param) {
        // Allocated pinned, then filled: Tensor::to() would drop the pinned_memory request (its
        // copy pins only for non-blocking copies out of a GPU), and every gather would then come
        // up from pageable memory at a fraction of the bandwidth.
        s.param_shard =
            at::empty({b.shard_numel},
                      at::TensorOptions().dtype(I.compute).pinned_memory(I.device.is_cuda()));
        s.param_shard.copy_(slice);
      } else {
        s.param_shard = slice.to(I.compute).clone();
      }
    } else {
      s.flat_param = b.trainable && I.master_aliases_params
                         ? I.master.narrow(0, b.shard.offset, b.numel)
                         : full.to(I.compute);
      if (b.trainable && I.grads_in_acc) {
        s.flat_grad = I.grad_acc.narrow(0, b.shard.offset, b.numel);
      } else if (b.trainable && I.stage <= 1 && !I.in_backward) {
        s.flat_grad = at::zeros({b.numel}, s.flat_param.options());
      }
    }
  }
  // Point the module's parameters (and, for stages 0/1, their gradients) into the buckets.
  for (const zero::Bucket& b : L.buckets) {
    EngineImpl::BucketState& s = I.buckets[static_cast<size_t>(b.index)];
    for (size_t k = 0; k < b.params.size(); ++k) {
      const zero::ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
      at::Tensor param = p.param;
      if (b.sharded_params) {
        param.set_data(at::empty({0}, at::TensorOptions().dtype(I.compute).device(I.device)));
      } else {
        param.set_data(s.flat_param.narrow(0, b.offsets[k], p.numel).view(p.shape));
      }
      if (s.flat_grad.defined()) {
        param.mutable_grad() = s.flat_grad.narrow(0, b.offsets[k], p.numel).view(p.shape);
      }
    }
  }
  I.optimizer = std::make_unique<ShardOptimizer>(
      ds.optimizer.type, I.master, L.segments, ds.optimizer.momentum,
      bf16 && ds.bf16.optimizer_states ? at::kBFloat16 : at::kFloat, update_groups);
  if (I.in_backward) {
    I.param_segments.resize(L.params.size());
    I.param_state_offset.assign(L.params.size(), 0);
    for (const zero::Bucket& b : L.buckets) {
      if (!b.trainable) continue;
      for (size_t k = 0; k < b.params.size(); ++k) {
        const size_t pi = static_cast<size_t>(b.params[k]);
        const int64_t offset = b.shard.offset + b.offsets[k];  // one rank: the whole bucket
        I.param_state_offset[pi] = offset;
        I.param_segments[pi] = {Segment{offset, L.params[pi].numel, L.params[pi].decay}};
      }
    }
  }
  I.units.resize(I.options.units.size());
  I.dummy = at::zeros({}, dev32).requires_grad_(true);
  I.nonfinite_losses = at::zeros({}, dev32);
  I.install_hooks();
  if (I.options.gate != nullptr) I.options.gate->attach(&I);
  I.last_lr = I.schedule.lr(0);
  if (I.rank == 0) {
    log::info(
        "engine: ZeRO stage {}, {} ranks, compute {}, {} buckets, {} state elements/rank{}{}{}",
        I.stage, I.world, c10::toString(I.compute), L.buckets.size(), L.state_numel,
        I.offload_optimizer ? ", optimizer offloaded" : "",
        I.offload_param ? ", parameters offloaded" : "",
        I.in_backward ? ", parameters updated during backward" : "");
  }
}

Engine::~Engine() {
  if (impl_ && impl_->options.gate != nullptr) impl_->options.gate->attach(nullptr);
}

void Engine::backward(const at::Tensor& loss) {
  backward(loss, 0.0);
}

void Engine::backward(const at::Tensor& loss, double divisor) {
  EngineImpl& I = *impl_;
  if (I.awaiting_step) {
    throw InvalidArgument("Engine::backward called twice without step() in between");
  }
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    throw InvalidArgument("Engine::backward needs a scalar loss that requires grad");
  }
  if (divisor < 0.0) throw InvalidArgument("Engine::backward: negative divisor");
  // DeepSpeed: mean over accumulation steps here, mean over ranks in the reduction. With a
  // divisor the loss is a sum and the reduction's 1/world is undone.
  const double factor =
      I.scaler.scale() * (divisor > 0.0 ? static_cast<double>(I.world) / divisor
                                        : 1.0 / static_cast<double>(I.accumulation));
  {
    at::NoGradGuard no_grad;
    I.nonfinite_losses.add_(at::isfinite(loss.detach()).logical_not().to(at::kFloat).reshape({}));
  }
  I.begin_backward();
  at::Tensor scaled = loss.to(at::kFloat).reshape({}) * factor;
  scaled.backward();
  I.finish_backward();
  ++I.micro_steps;
  I.awaiting_step = true;
}

bool Engine::at_boundary() const {
  return impl_->awaiting_step && impl_->at_boundary();
}

bool Engine::step(double gradient_scale) {
  EngineImpl& I = *impl_;
  if (!(gradient_scale > 0.0) || !std::isfinite(gradient_scale)) {
    throw InvalidArgument(fmt::format(
        "Engine::step: gradient_scale must be positive and finite, got {}", gradient_scale));
  }
  if (!I.awaiting_step) throw InvalidArgument("Engine::step called without backward()");
  I.awaiting_step = false;
  if (!I.at_boundary()) return false;
  if (I.in_backward && gradient_scale != 1.0) {
    throw InvalidArgument(fmt::format(
        "Engine::step: gradient_scale {} with updates applied during backward "
        "(EngineOptions::update_in_backward): pass the normalizer to backward(loss, divisor)",
        gradient_scale));
  }
  ++I.global_steps;
  at::NoGradGuard no_grad;
  if (I.in_backward) {
    // The update happened in backward; what is left is the norm and the finiteness check —
    // and the parameters that got no gradient, which the flat path updates with zeros
    // (momentum and weight decay still apply).
    for (size_t i = 0; i < I.param_segments.size(); ++i) {
      if (I.param_segments[i].empty() || I.fired[i]) continue;
      const at::Tensor zeros = at::zeros({I.layout.params[i].numel}, I.master.options());
      I.optimizer->update(zeros, I.backward_hyper, I.param_segments[i], I.param_state_offset[i]);
    }
    at::Tensor host =
        at::stack({I.param_grad_sq.sum(), I.nonfinite_losses.reshape({})}).to(at::kCPU);
    const double norm = std::sqrt(host[0].item<double>());
    const double bad_losses = host[1].item<double>();
    I.nonfinite_losses.zero_();
    if (!std::isfinite(norm) || bad_losses > 0) {
      throw NumericError(fmt::format(
          "non-finite {} at optimizer step {} (micro-step {}, {}; its update was already applied "
          "during backward): training diverged or the data has a problem; lower the learning "
          "rate or check the inputs",
          bad_losses > 0 ? "loss" : "gradient norm", I.global_steps, I.micro_steps,
          c10::toString(I.compute)));
    }
    ++I.applied_steps;
    I.last_lr = I.backward_hyper.lr;
    I.last_norm = norm;
    I.last_skipped = false;
    return true;
  }
  // Slices that received nothing this window (a unit that did not run) hold stale values.
  for (const zero::Bucket& b : I.layout.buckets) {
    EngineImpl::BucketState& s = I.buckets[static_cast<size_t>(b.index)];
    if (b.trainable && s.slice_fresh && !I.grads_in_acc) I.slice_of(b.index, I.grad_acc).zero_();
  }

  // One all-reduce carries the squared norm of this rank's slices and the count of non-finite
  // losses. Replicated buckets (stage 0) hold the same values on every rank: rank 0 speaks.
  at::Tensor local_sq = I.grad_acc.numel() > 0
                            ? at::linalg_vector_norm(I.grad_acc, 2, c10::nullopt, false, at::kFloat)
                                  .pow(2)
                                  .reshape({1})
                            : at::zeros({1}, I.grad_acc.options().dtype(at::kFloat));
  if (I.layout.replicated && I.rank != 0) local_sq.zero_();
  at::Tensor stats = at::cat({local_sq, I.nonfinite_losses.reshape({1})});
  I.comm->all_reduce(stats, ReduceOp::kSum)->wait();
  at::Tensor host = stats.to(at::kCPU);
  const double scaled_norm = std::sqrt(host[0].item<double>());
  const double bad_losses = host[1].item<double>();
  const double scale = I.scaler.scale();
  const bool overflow = !std::isfinite(scaled_norm);
  const bool fp16 = I.ds.fp16.enabled.value();
  I.nonfinite_losses.zero_();

  if (!fp16 && (overflow || bad_losses > 0)) {
    throw NumericError(fmt::format(
        "non-finite {} at optimizer step {} (micro-step {}, {}): training diverged or the data "
        "has a problem; lower the learning rate or check the inputs",
        bad_losses > 0 ? "loss" : "gradient norm", I.global_steps, I.micro_steps,
        c10::toString(I.compute)));
  }
  if (fp16) I.scaler.update(overflow);  // throws at the minimum scale
  auto clear = [&] {
    if (I.grads_in_acc) I.grad_acc.zero_();  // autograd accumulates into it in place
    for (EngineImpl::BucketState& s : I.buckets) {
      s.slice_fresh = true;
      if (s.flat_grad.defined() && !I.grads_in_acc) s.flat_grad.zero_();
    }
  };
  if (overflow) {
    I.last_skipped = true;
    I.last_norm = std::numeric_limits<double>::infinity();
    clear();
    log::info("fp16 overflow at step {}: skipped, loss scale now {}", I.global_steps,
              I.scaler.scale());
    return true;
  }

  // Unscale and clip with one factor (DeepSpeed: 1 / (scale · max(1, (norm + 1e-6) / clip))),
  // applied inside the optimizer's pass over the gradients.
  const double norm = scaled_norm * gradient_scale / scale;
  const double clip = I.ds.gradient_clipping.value();
  double coef = gradient_scale / scale;
  if (clip > 0.0 && (norm + 1e-6) / clip > 1.0) coef /= (norm + 1e-6) / clip;

  const UpdateHyper h = I.step_hyper(coef);
  if (I.offload_optimizer) {
    I.offloaded_step(h);
  } else {
    I.optimizer->step(I.grad_acc, h);
    for (const zero::Bucket& b : I.layout.buckets) {
      if (b.trainable) I.publish(b, I.slice_of(b.index, I.master));
    }
  }
  I.finish_publishing();
  ++I.applied_steps;
  I.last_lr = h.lr;
  I.last_norm = norm;
  I.last_skipped = false;
  clear();
  return true;
}

UpdateHyper zero::EngineImpl::step_hyper(double grad_scale) const {
  UpdateHyper h;
  h.lr = schedule.lr(applied_steps);
  h.beta1 = ds.optimizer.betas.value()[0];
  h.beta2 = ds.optimizer.betas.value()[1];
  h.eps = ds.optimizer.eps.value();
  h.weight_decay = ds.optimizer.weight_decay.value();
  h.momentum = ds.optimizer.momentum;
  h.bias_correction = ds.optimizer.bias_correction;
  h.grad_scale = grad_scale;
  return h;
}

void zero::EngineImpl::offloaded_step(const UpdateHyper& h) {
  // Pipelined per bucket: gradients come down through a few pinned host slots (bucket i into
  // slot i % slots, the copy of bucket i + slots queued once the CPU has read bucket i); as each
  // lands, the CPU updates it while the next ones are in flight, and its new masters go up
  // while the CPU moves on. At most two uploaded buckets wait to be published, bounding device
  // scratch.
  zero::CopyStream copies(device);
  std::vector<const zero::Bucket*> order;
  for (const zero::Bucket& b : layout.buckets) {
    if (b.trainable) order.push_back(&b);
  }
  const size_t slots = grad_slots.size();
  auto slot_of = [&](size_t i) {
    return grad_slots[i % slots].narrow(0, 0, order[i]->shard_numel);
  };
  std::vector<int64_t> down(order.size(), -1);
  for (size_t i = 0; i < std::min(slots, order.size()); ++i) {
    down[i] = copies.copy(slot_of(i), slice_of(order[i]->index, grad_acc));
  }
  optimizer->begin_step();
  struct Upload {
    const zero::Bucket* bucket;
    int64_t ticket;
    at::Tensor values;
  };
  std::deque<Upload> uploads;
  auto publish_oldest = [&] {
    Upload u = std::move(uploads.front());
    uploads.pop_front();
    copies.device_wait(u.ticket);
    publish(*u.bucket, u.values);
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const zero::Bucket& b = *order[i];
    copies.host_wait(down[i]);
    optimizer->update(slot_of(i), h, bucket_segments[static_cast<size_t>(b.index)], b.shard.offset);
    if (i + slots < order.size()) {
      down[i + slots] =
          copies.copy(slot_of(i + slots), slice_of(order[i + slots]->index, grad_acc));
    }
    at::Tensor mine = slice_of(b.index, master);
    if (b.sharded_params && offload_param) {
      publish(b, mine);  // host to host
      continue;
    }
    at::Tensor up =
        at::empty({b.shard_numel}, at::TensorOptions().dtype(at::kFloat).device(device));
    uploads.push_back(Upload{&b, copies.copy(up, mine), up});
    if (uploads.size() > 2) publish_oldest();
  }
  while (!uploads.empty()) publish_oldest();
}

void zero::EngineImpl::publish(const zero::Bucket& b, const at::Tensor& mine) {
  BucketState& s = buckets[static_cast<size_t>(b.index)];
  if (b.sharded_params) {
    s.param_shard.copy_(mine);
  } else if (layout.replicated || world == 1) {
    if (!s.flat_param.is_same(mine) && s.flat_param.data_ptr() != mine.data_ptr())
      s.flat_param.copy_(mine);
  } else {
    // All-gathers in flight are bounded by allgather_bucket_size elements.
    at::Tensor piece = mine.to(at::TensorOptions().dtype(compute).device(device));
    if (gathering_elements > 0 && gathering_elements + b.numel > ds.zero.allgather_bucket_size) {
      finish_publishing();
    }
    param_gathers.push_back(comm->all_gather(s.flat_param, piece));
    param_gather_inputs.push_back(piece);
    gathering_elements += b.numel;
  }
}

void zero::EngineImpl::finish_publishing() {
  for (WorkHandle& g : param_gathers) g->wait();
  param_gathers.clear();
  param_gather_inputs.clear();
  gathering_elements = 0;
}

double Engine::learning_rate() const {
  return impl_->last_lr;
}
double Engine::loss_scale() const {
  return impl_->scaler.scale();
}
double Engine::last_grad_norm() const {
  return impl_->last_norm;
}
bool Engine::last_step_skipped() const {
  return impl_->last_skipped;
}
int64_t Engine::global_step() const {
  return impl_->global_steps;
}
int64_t Engine::micro_step() const {
  return impl_->micro_steps;
}
int Engine::gradient_accumulation_steps() const {
  return impl_->accumulation;
}
at::ScalarType Engine::compute_dtype() const {
  return impl_->compute;
}
int Engine::stage() const {
  return impl_->stage;
}
bool Engine::updates_in_backward() const {
  return impl_->in_backward;
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

// This rank's pieces of the trainable parameters, each with its offset in the flat state.
std::vector<std::pair<StatePiece, int64_t>> held_pieces(const zero::EngineImpl& I) {
  const zero::Layout& L = I.layout;
  std::vector<std::pair<StatePiece, int64_t>> out;
  for (const zero::Bucket& b : L.buckets) {
    if (!b.trainable) continue;
    const int64_t lo = b.slice_begin(I.rank, L.replicated);
    for (size_t k = 0; k < b.params.size(); ++k) {
      const zero::ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
      const int64_t a = std::max(lo, b.offsets[k]);
      const int64_t e = std::min(lo + b.shard_numel, b.offsets[k] + p.numel);
      if (a >= e) continue;
      out.emplace_back(StatePiece{p.name, p.shape, a - b.offsets[k], e - a},
                       b.shard.offset + (a - lo));
    }
  }
  return out;
}

// The state tensors in state_kinds() order.
std::vector<at::Tensor> state_tensors(const zero::EngineImpl& I) {
  std::vector<at::Tensor> out{I.master};
  if (I.optimizer->state0().defined()) out.push_back(I.optimizer->state0());
  if (I.optimizer->state1().defined()) out.push_back(I.optimizer->state1());
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> Engine::trainable_parameters() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const zero::ParamInfo& p : impl_->layout.params) {
    if (p.trainable) out.emplace_back(p.name, p.shape);
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
  if (I.layout.replicated && I.rank != 0) return out;
  const std::vector<at::Tensor> tensors = state_tensors(I);
  for (auto& [piece, offset] : held_pieces(I)) {
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
  s.global_steps = I.global_steps;
  s.applied_steps = I.applied_steps;
  s.micro_steps = I.micro_steps;
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
  if (I.awaiting_step) throw InvalidArgument("Engine::load_state between backward() and step()");
  at::NoGradGuard no_grad;
  const std::vector<std::string> kinds = state_kinds();
  const std::vector<at::Tensor> tensors = state_tensors(I);
  std::string error;
  try {
    for (const auto& [piece, offset] : held_pieces(I)) {
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
  LossScaler::State ls;
  ls.cur_scale = state.loss_scale;
  ls.cur_iter = state.scaler_iter;
  ls.last_overflow_iter = state.scaler_last_overflow_iter;
  ls.cur_hysteresis = state.scaler_hysteresis;
  I.scaler.set_state(ls);
  // Saved at a boundary; with another accumulation count (another world size, same global
  // batch) the micro-step count restarts from the boundary in this run's terms.
  I.global_steps = state.global_steps;
  I.applied_steps = state.applied_steps;
  I.micro_steps = state.global_steps * I.accumulation;
  I.last_lr = I.schedule.lr(I.applied_steps);
  for (const zero::Bucket& b : I.layout.buckets) {
    if (b.trainable) I.publish(b, I.slice_of(b.index, I.master));
  }
  I.finish_publishing();
}

EngineMemory Engine::memory() const {
  const EngineImpl& I = *impl_;
  EngineMemory m;
  for (const EngineImpl::BucketState& s : I.buckets) {
    if (s.param_shard.defined()) m.compute_params += s.param_shard.nbytes();
    if (s.flat_param.defined() && !s.param_shard.defined())
      m.compute_params += s.flat_param.nbytes();
    if (s.flat_grad.defined()) m.gradients += s.flat_grad.nbytes();
  }
  m.gradients += I.grad_acc.nbytes();
  m.optimizer_state = I.optimizer->state_bytes(/*with_master=*/!I.master_aliases_params);
  m.gathered_now = I.gathered_now;
  m.gathered_peak = I.gathered_peak;
  auto count_host = [&](const at::Tensor& t) {
    if (!I.device.is_cuda() || !t.defined() || !t.is_cpu()) return;
    (t.is_pinned() ? m.host_pinned : m.host_pageable) += static_cast<int64_t>(t.nbytes());
  };
  for (const EngineImpl::BucketState& s : I.buckets) count_host(s.param_shard);
  count_host(I.master);
  count_host(I.optimizer->state0());
  count_host(I.optimizer->state1());
  for (const at::Tensor& slot : I.grad_slots) count_host(slot);
  return m;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::gather_full_parameters(
    bool trainable_only) {
  EngineImpl& I = *impl_;
  const zero::Layout& L = I.layout;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> full_of_bucket(L.buckets.size());
  for (const zero::Bucket& b : L.buckets) {
    if (trainable_only && !b.trainable) continue;
    at::Tensor full;
    if (b.trainable) {
      at::Tensor mine = I.master.narrow(0, b.shard.offset, b.shard_numel).to(I.device, at::kFloat);
      if (L.replicated) {
        full = mine;
      } else {
        full = at::empty({b.numel}, mine.options());
        I.comm->all_gather(full, mine)->wait();
      }
    } else if (b.sharded_params) {
      at::Tensor mine = I.buckets[static_cast<size_t>(b.index)].param_shard.to(I.device);
      full = at::empty({b.numel}, mine.options());
      I.comm->all_gather(full, mine)->wait();
    } else {
      full = I.buckets[static_cast<size_t>(b.index)].flat_param;
    }
    full_of_bucket[static_cast<size_t>(b.index)] = full;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < L.params.size(); ++i) {
    const zero::ParamInfo& p = L.params[i];
    const zero::Bucket& b = L.buckets[static_cast<size_t>(I.bucket_of_param[i])];
    if (trainable_only && !b.trainable) continue;
    const at::Tensor& full = full_of_bucket[static_cast<size_t>(b.index)];
    int64_t off = b.offsets[static_cast<size_t>(I.slot_of_param[i])];
    out.emplace_back(p.name, full.narrow(0, off, p.numel).view(p.shape).clone());
  }
  return out;
}

}  // namespace zt
