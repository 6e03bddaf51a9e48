// The engine's constructor, phase by phase: settings → parameters and layout → optimizer
// state → bucket values → the module's parameters bound into the buckets → the parts (the
// optimizer, the gradient strategy, offload, hooks, the unit gate).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/agreement.hpp"
#include "optim/schedule.hpp"
#include "util/capacity.hpp"
#include "util/device_stats.hpp"
#include "util/env.hpp"
#include "util/log.hpp"
#include "zero/copy_stream.hpp"
#include "zero/engine_impl.hpp"
#include "zero/offload.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using zero::EngineImpl;

namespace {

// Each parameter's unit: the first unit whose module holds it, and how many units hold it. One
// held by two units (tied weights) belongs to none (so it stays whole under stage 3) and its
// gradient may arrive once per unit that uses it.
struct UnitOf {
  int unit = -1;
  int holders = 0;
};

std::unordered_map<const void*, UnitOf> unit_of_parameters(const std::vector<UnitSpec>& units) {
  std::unordered_map<const void*, UnitOf> unit_of;
  for (size_t u = 0; u < units.size(); ++u) {
    if (!units[u].module) {
      throw InvalidArgument(
          fmt::format("EngineOptions::units[{}] ('{}') has no module", u, units[u].name));
    }
    for (const at::Tensor& p : units[u].module->parameters(true)) {
      auto [it, fresh] = unit_of.emplace(p.unsafeGetTensorImpl(), UnitOf{static_cast<int>(u), 0});
      it->second.holders += 1;
      if (!fresh) it->second.unit = -2;
    }
  }
  return unit_of;
}

// The module's parameters in registration order, with what the layout needs of each.
std::vector<zero::ParamInfo> describe_parameters(torch::nn::Module& model,
                                                 const std::vector<UnitSpec>& units) {
  const std::unordered_map<const void*, UnitOf> unit_of = unit_of_parameters(units);
  std::vector<zero::ParamInfo> params;
  bool any_trainable = false;
  for (const auto& item : model.named_parameters(true)) {
    zero::ParamInfo p;
    p.name = item.key();
    p.param = item.value();
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.trainable = p.param.requires_grad();
    p.raw = !at::isFloatingType(p.param.scalar_type());  // a quantized base's bytes
    p.decay = applies_weight_decay(p.name);
    auto it = unit_of.find(p.param.unsafeGetTensorImpl());
    p.unit = it == unit_of.end() ? -1 : std::max(-1, it->second.unit);
    p.holders = it == unit_of.end() ? 0 : it->second.holders;
    p.shared = p.holders > 1;
    any_trainable = any_trainable || p.trainable;
    params.push_back(std::move(p));
  }
  if (!any_trainable) throw ConfigError("Engine: the model has no trainable parameters");
  return params;
}

// A count of ranks from the environment variable `name`: 0 when unset or empty; anything but a
// decimal count from 1 to 2^20 is a ConfigError naming the variable (util/env.hpp).
int ranks_from_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  return parse_env_int(name, v, 1, 1 << 20, "a count of ranks");
}

// Ranks per node for the hierarchies: ZT_RANKS_PER_NODE (the stated override, for the emulated
// tier, where each rank plays a host of its own), else EngineOptions::ranks_per_node, else the
// launcher's LOCAL_WORLD_SIZE, else the whole job; one that does not divide the job is the whole
// job, with a warning.
int ranks_per_node(int option, int world) {
  int n = ranks_from_env("ZT_RANKS_PER_NODE");
  if (n <= 0) n = option;
  if (n <= 0) n = ranks_from_env("LOCAL_WORLD_SIZE");
  if (n <= 0) return world;
  if (world % n != 0) {
    log::warn(
        "{} ranks per node do not divide the {} ranks of the job: the hierarchies treat the "
        "job as one node",
        n, world);
    return world;
  }
  return n;
}

// The settings whose groups every rank must share, agreed in one all-reduce (the largest and
// the smallest value of each): a difference is a ConfigError on every rank, naming the setting.
void agree_on_hierarchy(Communicator& comm, const zero::EngineSettings& S, int per_node,
                        const std::string& source) {
  if (comm.world_size() == 1) return;
  const std::vector<std::pair<const char*, double>> items = {
      {"zero_optimization.stage", S.stage},
      {"zero_optimization.mics_shard_size", S.shard_group},
      {"zero_optimization.zero_hpz_partition_size", S.hpz_group},
      {"zero_optimization.zero_quantized_weights", S.quantized_weights ? 1.0 : 0.0},
      {"zero_optimization.zero_quantized_gradients", S.quantized_gradients ? 1.0 : 0.0},
      {"the ranks per node (ZT_RANKS_PER_NODE, EngineOptions::ranks_per_node, LOCAL_WORLD_SIZE)",
       per_node}};
  std::vector<double> values;
  for (const auto& item : items) values.push_back(item.second);
  for (const auto& item : items) values.push_back(-item.second);
  const std::vector<double> extremes = comm::reduce_scalars(comm, values, ReduceOp::kMax);
  for (size_t k = 0; k < items.size(); ++k) {
    const double most = extremes[k], least = -extremes[items.size() + k];
    if (most != least) {
      throw ConfigError(fmt::format(
          "{}: {} differs between the ranks ({} on some, {} on others; {} on rank {}): every "
          "rank must run with the same DeepSpeed config and launcher variables",
          source, items[k].first, least, most, items[k].second, comm.rank()));
    }
  }
}

// What to change when this rank's share of host memory cannot fit: on a CPU everything is
// there; on a GPU only what offload puts there.
std::string host_memory_fix(const zero::EngineSettings& S) {
  if (S.device.is_cpu()) {
    return "train an adapter (--finetuning_type lora) or a smaller model, or shard the state "
           "and weights with ZeRO stage 3 over ranks on more machines (each keeps 1/N of them)";
  }
  return "lower zero_optimization.offload_optimizer.ratio (the host's share) or drop "
         "offload_param, use more machines (each rank keeps 1/N with ZeRO), or train an adapter "
         "(--finetuning_type lora)";
}

}  // namespace

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

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const DeepSpeedConfig& ds,
               std::shared_ptr<Communicator> comm, EngineOptions options)
    : impl_(std::make_unique<EngineImpl>()) {
  EngineImpl& I = *impl_;
  if (!model) throw InvalidArgument("Engine: model is null");
  if (!comm) throw InvalidArgument("Engine: communicator is null");
  check_resolved(ds);
  I.options = std::move(options);
  I.model = std::move(model);
  I.comm = std::move(comm);
  I.learning_rate = I.options.learning_rate
                        ? I.options.learning_rate
                        : LrSchedule::from_deepspeed(ds, I.options.total_train_steps).function();
  I.collect_parameters(ds);
  I.check_state_fits();
  try {
    I.allocate_state();
    I.place_buckets();
    I.bind_parameters();
    I.create_parts();
  } catch (const c10::Error& e) {
    // check_state_fits counts what is known before allocating; the host can still run out
    // (other processes, buffers on top): said as an OutOfMemoryError, not the allocator's text.
    capacity::throw_if_host_allocation_failed(
        e.what_without_backtrace(),
        fmt::format("ZeRO stage {} over {} rank{}: allocating this rank's optimizer state and "
                    "weights ({:.2f}B trainable elements)",
                    I.S.stage, I.S.world, I.S.world == 1 ? "" : "s",
                    static_cast<double>(I.layout.state_numel) / 1e9),
        host_memory_fix(I.S));
    throw;
  }
  if (I.S.rank == 0) {
    for (const std::string& w : I.S.warnings) log::warn("{}", w);
    log::info(
        "engine: ZeRO stage {}, {} ranks, compute {}, {} buckets, {} state elements/rank{}{}{}{}",
        I.S.stage, I.S.world, c10::toString(I.S.compute), I.layout.buckets.size(),
        I.layout.state_numel,
        !I.S.offload_optimizer     ? std::string()
        : I.S.offload_ratio == 1.0 ? std::string(", optimizer offloaded")
                                   : fmt::format(", optimizer offloaded (ratio {}: state from "
                                                 "element {} updated on the device)",
                                                 I.S.offload_ratio, I.offload->device_from()),
        I.S.offload_param ? ", parameters offloaded" : "",
        I.S.in_backward() ? ", parameters updated during backward" : "",
        I.S.stage == 3 && !I.S.shard_units
            ? " (one rank: nothing to partition, units stay resident as in stage 2)"
            : "");
    std::vector<std::string> modes;
    if (I.hybrid()) modes.push_back(fmt::format("MiCS shard groups of {} ranks", I.S.shard_group));
    if (!I.hpz_peers.empty()) modes.push_back(fmt::format("hpZ groups of {}", I.hpz_peers.size()));
    if (I.S.quantized_weights) modes.emplace_back("int8 weight gathers (qwZ)");
    if (I.S.quantized_gradients) {
      modes.push_back(I.node_peers.empty()
                          ? std::string("int8 gradient reduce-scatters (qgZ)")
                          : fmt::format("int8 gradient reduce-scatters (qgZ) in two hops, nodes "
                                        "of {} ranks",
                                        I.node_peers.size()));
    }
    if (!modes.empty()) log::info("engine across nodes: {}", fmt::join(modes, ", "));
  }
}

Engine::~Engine() {
  if (impl_ && impl_->options.gate != nullptr) impl_->options.gate->attach(nullptr);
}

namespace zero {

EngineImpl::EngineImpl() = default;
EngineImpl::~EngineImpl() = default;

namespace {

// EngineOptions::local_split as this rank sees it: its block among the holders, its peers.
void check_local_split(const EngineOptions::LocalSplit& split, int rank, int world) {
  auto ranks_ok = [&](const std::vector<int>& ranks) {
    return std::all_of(ranks.begin(), ranks.end(), [&](int r) { return r >= 0 && r < world; });
  };
  const bool holders_ok =
      split.holders.empty()
          ? split.blocks == 1 && split.index == 0
          : static_cast<int64_t>(split.holders.size()) == split.blocks && split.index >= 0 &&
                std::is_sorted(split.holders.begin(), split.holders.end()) &&
                split.index < split.blocks &&
                split.holders[static_cast<size_t>(split.index)] == rank && ranks_ok(split.holders);
  const bool peers_ok =
      split.peers.empty() ||
      (std::is_sorted(split.peers.begin(), split.peers.end()) && ranks_ok(split.peers) &&
       std::find(split.peers.begin(), split.peers.end(), rank) != split.peers.end());
  if (!holders_ok || !peers_ok || split.blocks < 1) {
    throw InvalidArgument(fmt::format(
        "Engine: EngineOptions::local_split (block {} of {}, holders [{}], peers [{}]) does not "
        "fit rank {} of {}: the holders list one rank per block in ascending order, this rank at "
        "its own block, and the peers (ascending) include this rank",
        split.index, split.blocks, fmt::join(split.holders, ", "), fmt::join(split.peers, ", "),
        rank, world));
  }
}

}  // namespace

// Settings and layout. With a ParameterSource the module's own values are placeholders and
// are never moved.
void EngineImpl::collect_parameters(const DeepSpeedConfig& ds) {
  std::vector<ParamInfo> params = describe_parameters(*model, options.units);
  if (options.rank_local) {
    check_local_split(options.local_split, comm->rank(), comm->world_size());
    for (ParamInfo& p : params) {
      if (!options.rank_local(p.name)) continue;
      if (!options.source) {
        throw InvalidArgument(fmt::format(
            "Engine: '{}' is this rank's own (EngineOptions::rank_local), but there is no source "
            "to read each rank's values from (without one rank 0's would be broadcast)",
            p.name));
      }
      if (p.shape.empty()) {
        throw InvalidArgument(fmt::format(
            "Engine: '{}' is this rank's own (EngineOptions::rank_local) but a scalar: a share "
            "is a block of the whole along dim 0",
            p.name));
      }
      p.rank_local = true;
    }
  }
  local_peers = options.local_split.peers;
  if (local_peers.empty()) local_peers = {comm->rank()};
  local_leader = local_peers.front() == comm->rank();
  EngineFacts facts;
  facts.world = comm->world_size();
  facts.rank = comm->rank();
  facts.device = comm->device();
  // Every rank learns whether any refused the settings before the first collective, then that
  // all chose the same hierarchy: a rank of another config or environment would otherwise pair
  // its exchanges with the wrong ones.
  int per_node = 0;
  comm::on_every_rank(*comm, "resolving the engine's settings", [&] {
    S = resolve_settings(ds, options, facts);
    const bool hierarchy = S.quantized_gradients || S.shard_group < S.world || S.hpz_group > 1;
    per_node = hierarchy ? ranks_per_node(options.ranks_per_node, S.world) : S.world;
  });
  agree_on_hierarchy(*comm, S, per_node, ds.source);
  // A group must lie within a node or be whole nodes; one that straddles nodes would send
  // across them the traffic it exists to keep inside.
  for (const auto& [key, group] : {std::pair<const char*, int>{"mics_shard_size", S.shard_group},
                                   {"zero_hpz_partition_size", S.hpz_group}}) {
    if (group > 1 && group < S.world && per_node % group != 0 && group % per_node != 0) {
      throw ConfigError(fmt::format(
          "{}: zero_optimization.{}: groups of {} ranks straddle the nodes of {} ranks (ranks per "
          "node from ZT_RANKS_PER_NODE, the launcher or LOCAL_WORLD_SIZE); set a divisor or a "
          "multiple of {}",
          ds.source, key, group, per_node, per_node));
    }
  }
  // Module::to replaces each parameter's data in place: `params` still holds the same objects.
  if (!options.source) model->to(S.device);
  if (S.fp16) scaler = LossScaler(S.scaler);

  LayoutOptions lo;
  lo.stage = S.layout_stage;
  lo.world = S.world;
  lo.rank = S.rank;
  lo.bucket_size = S.bucket_size;
  lo.persistence_threshold = S.persistence_threshold;
  lo.num_units = static_cast<int>(options.units.size());
  lo.local_peers = static_cast<int>(local_peers.size());
  lo.local_place = static_cast<int>(std::find(local_peers.begin(), local_peers.end(), S.rank) -
                                    local_peers.begin());
  lo.shard_group = S.shard_group;
  // MiCS: the consecutive ranks sharing one copy, and the ranks holding the same slice of it.
  shard_peers.clear();
  replica_peers.clear();
  const int first = S.rank - S.rank % S.shard_group;
  for (int r = first; r < first + S.shard_group; ++r) shard_peers.push_back(r);
  for (int r = S.rank % S.shard_group; r < S.world; r += S.shard_group) replica_peers.push_back(r);
  node_peers.clear();
  place_peers.clear();
  if (S.quantized_gradients) {
    if (per_node > 1 && per_node < S.world) {
      const int node = S.rank - S.rank % per_node;
      for (int r = node; r < node + per_node; ++r) node_peers.push_back(r);
      for (int r = S.rank % per_node; r < S.world; r += per_node) place_peers.push_back(r);
    }
  }
  hpz_peers.clear();
  if (S.hpz_group > 1 && S.shard_units) {
    for (int r = S.rank - S.rank % S.hpz_group; r < S.rank - S.rank % S.hpz_group + S.hpz_group;
         ++r) {
      hpz_peers.push_back(r);
    }
  }
  layout = build_layout(std::move(params), lo);
  slots.assign(layout.params.size(), ParamSlot{});
  for (const Bucket& b : layout.buckets) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      ParamSlot& slot = slots[static_cast<size_t>(b.params[k])];
      slot.bucket = b.index;
      slot.offset = b.offsets[k];
    }
  }
}

// Refuses, before any of it is allocated, what this rank keeps that cannot fit: in host memory
// (on a CPU everything, on a GPU what offload puts there), then the optimizer state on the GPU.
// Said in GiB with what to change, instead of the allocator's text halfway through set-up.
void EngineImpl::check_state_fits() const {
  // The compute copy of the weights the host keeps: whole buckets, or this rank's shards of
  // stage-3 units (where the masters are the compute copy, the state leaves them out).
  double weights = 0;
  for (const Bucket& b : layout.buckets) {
    if (!S.device.is_cpu() && !(b.sharded_params && S.offload_param)) continue;
    weights += static_cast<double>(b.sharded_params ? b.shard_numel : b.numel) *
               static_cast<double>(c10::elementSize(stored_dtype(b)));
  }
  const double host_state = host_state_bytes(S, layout.state_numel);
  capacity::check_free(
      host_state + weights, capacity::host_available_bytes(), "the host",
      fmt::format("ZeRO stage {} over {} rank{}: this rank's {:.1f} GiB of optimizer state for "
                  "{:.2f}B trainable elements (gradients, {} masters, the optimizer's moments{}) "
                  "and {:.1f} GiB of weights in {}",
                  S.stage, S.world, S.world == 1 ? "" : "s", host_state / (1 << 30),
                  static_cast<double>(layout.state_numel) / 1e9, c10::toString(S.master_dtype),
                  S.device.is_cpu() ? "" : ": the offloaded share", weights / (1 << 30),
                  c10::toString(S.compute)),
      host_memory_fix(S));
  if (!S.device.is_cuda()) return;
  const int device = S.device.has_index() ? S.device.index() : 0;
  const double need = device_state_bytes(S, layout.state_numel);
  const double free = static_cast<double>(device_stats::usable_memory(device)) -
                      static_cast<double>(device_stats::allocated(device));
  const std::string fix =
      S.offload_optimizer
          ? "raise zero_optimization.offload_optimizer.ratio toward 1 (the host's share), use "
            "more ranks, or train an adapter (--finetuning_type lora)"
          : fmt::format(
                "offload it to the host (\"offload_optimizer\": {{\"device\": \"cpu\"}} "
                "in zero_optimization), {}, or train an adapter (--finetuning_type lora)",
                S.stage == 0 ? "use ZeRO stage 1 or higher over more ranks (each then "
                               "keeps 1/N of it)"
                             : "use more ranks (each keeps 1/N of it)");
  capacity::check_free(
      need, free, S.device.str(),
      fmt::format("ZeRO stage {} over {} rank{}: the optimizer state of this rank's {:.2f}B "
                  "trainable elements (gradients, {} masters, the optimizer's moments)",
                  S.stage, S.world, S.world == 1 ? "" : "s",
                  static_cast<double>(layout.state_numel) / 1e9, c10::toString(S.master_dtype)),
      fix);
}

// The masters and the gradient accumulator: this rank's slices of the trainable buckets.
void EngineImpl::allocate_state() {
  const Layout& L = layout;
  bucket_segments.resize(L.buckets.size());
  for (const Bucket& b : L.buckets) {
    if (!b.trainable) continue;
    for (const Segment& seg : L.segments) {
      if (seg.offset >= b.shard.offset && seg.offset < b.shard.offset + b.shard_numel) {
        bucket_segments[static_cast<size_t>(b.index)].push_back(seg);
      }
    }
  }
  const auto dev = at::TensorOptions().device(S.device);
  if (S.offload_optimizer) {
    master =
        OffloadedOptimizer::allocate_master(L.state_numel, S.device.is_cuda(), bucket_segments);
  } else {
    master = at::zeros({L.state_numel}, dev.dtype(S.master_dtype));
  }
  grad_acc = at::zeros({S.in_backward() ? 0 : L.state_numel}, dev.dtype(S.master_dtype));
}

// Sharded buckets are read only in their slice, so no rank ever holds the whole model. For a
// GPU one staging buffer serves all buckets (fresh pages for every bucket cost more in page
// faults than the reads on a 7B model).
at::Tensor read_bucket(ParameterSource& source, const Layout& L, const Bucket& b, int64_t begin,
                       int64_t len, const at::Device& device, at::Tensor& staging,
                       const std::function<void(int64_t elements)>& on_read) {
  at::Tensor host;
  if (b.raw) {
    host = at::empty({len}, at::TensorOptions().dtype(at::kByte));
  } else if (device.is_cpu()) {
    host = at::empty({len}, at::TensorOptions().dtype(at::kFloat));
  } else {
    if (staging.numel() < len) staging = at::empty({len}, at::TensorOptions().dtype(at::kFloat));
    host = staging.narrow(0, 0, len);
  }
  // Parameters lie in increasing offsets; only the alignment padding between them (and after
  // the last) is zeroed here, the rest is written by the reads.
  int64_t filled = begin;
  for (size_t k = 0; k < b.params.size(); ++k) {
    const ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
    const int64_t a = std::max(begin, b.offsets[k]);
    const int64_t e = std::min(begin + len, b.offsets[k] + p.numel);
    if (a >= e) continue;
    if (a > filled) host.narrow(0, filled - begin, a - filled).zero_();
    source.read(p.name, p.shape, a - b.offsets[k], host.narrow(0, a - begin, e - a));
    filled = e;
    if (on_read) on_read(e - a);
  }
  if (begin + len > filled) host.narrow(0, filled - begin, begin + len - filled).zero_();
  return host.to(device);  // a blocking copy: the staging buffer is free again
}

// Every bucket's initial values, in fp32 (raw buckets: bytes): from the source, or assembled from
// the module and broadcast from rank 0, so all ranks start from the same weights whatever the stage
// and world size; then each rank keeps what its stage keeps.
void EngineImpl::place_buckets() {
  const Layout& L = layout;
  const auto dev32 = at::TensorOptions().dtype(at::kFloat).device(S.device);
  buckets.resize(L.buckets.size());
  at::NoGradGuard no_grad;
  at::Tensor staging;
  // What this rank reads of the source (its parameters' elements, not the padding between
  // them), for EngineOptions::on_load_progress.
  int64_t to_read = 0, read = 0;
  for (const Bucket& b : L.buckets) {
    const int64_t begin = b.sharded_params ? b.slice_begin() : 0;
    const int64_t end = begin + (b.sharded_params ? b.shard_numel : b.numel);
    for (size_t k = 0; k < b.params.size(); ++k) {
      const int64_t numel = L.params[static_cast<size_t>(b.params[k])].numel;
      to_read +=
          std::max<int64_t>(0, std::min(end, b.offsets[k] + numel) - std::max(begin, b.offsets[k]));
    }
  }
  const auto on_read = [&](int64_t elements) {
    read += elements;
    if (options.on_load_progress) options.on_load_progress(read, to_read);
  };
  for (const Bucket& b : L.buckets) {
    BucketState& s = buckets[static_cast<size_t>(b.index)];
    const int64_t lo = b.slice_begin();
    at::Tensor slice;  // this rank's slice of the bucket, fp32, on the device
    at::Tensor full;   // the whole bucket when this rank keeps it whole
    if (options.source) {
      const bool whole = !b.sharded_params;
      at::Tensor values = read_bucket(*options.source, L, b, whole ? 0 : lo,
                                      whole ? b.numel : b.shard_numel, S.device, staging, on_read);
      full = whole ? values : at::Tensor();
      slice = whole ? full.narrow(0, lo, b.shard_numel) : values;
    } else {
      full = at::zeros({b.numel}, dev32.dtype(b.raw ? at::kByte : at::kFloat));
      for (size_t k = 0; k < b.params.size(); ++k) {
        const ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
        full.narrow(0, b.offsets[k], p.numel).copy_(p.param.reshape({-1}));
      }
      comm->broadcast(full, 0)->wait();
      slice = full.narrow(0, lo, b.shard_numel);
    }
    if (b.trainable) master.narrow(0, b.shard.offset, b.shard_numel).copy_(slice);
    if (b.sharded_params) {
      if (S.offload_param) {
        // Allocated pinned, then filled: Tensor::to() would drop the pinned_memory request (its
        // copy pins only for non-blocking copies out of a GPU), and every gather would then
        // come up from pageable memory at a fraction of the bandwidth.
        s.param_shard =
            at::empty({b.shard_numel},
                      at::TensorOptions().dtype(stored_dtype(b)).pinned_memory(S.device.is_cuda()));
        s.param_shard.copy_(slice);
      } else {
        s.param_shard = slice.to(stored_dtype(b)).clone();
      }
      continue;
    }
    s.flat_param = b.trainable && S.master_aliases_params
                       ? master.narrow(0, b.shard.offset, b.numel)
                       : full.to(stored_dtype(b));
    if (b.trainable && S.grads_in_acc()) {
      s.flat_grad = grad_acc.narrow(0, b.shard.offset, b.numel);
    } else if (b.trainable && S.stage <= 1 && !S.in_backward()) {
      s.flat_grad = at::zeros({b.numel}, s.flat_param.options());
    }
  }
  options.on_load_progress = nullptr;  // the caller's, for the construction only
}

// Points the module's parameters (and, where gradients live in flat buckets, their .grad)
// into the buckets; stage-3 unit parameters stay empty until their unit gathers them.
void EngineImpl::bind_parameters() {
  at::NoGradGuard no_grad;
  for (const Bucket& b : layout.buckets) {
    BucketState& s = buckets[static_cast<size_t>(b.index)];
    for (size_t k = 0; k < b.params.size(); ++k) {
      const ParamInfo& p = layout.params[static_cast<size_t>(b.params[k])];
      at::Tensor param = p.param;
      if (b.sharded_params) {
        param.set_data(at::empty({0}, at::TensorOptions().dtype(stored_dtype(b)).device(S.device)));
      } else {
        param.set_data(s.flat_param.narrow(0, b.offsets[k], p.numel).view(p.shape));
      }
      if (s.flat_grad.defined()) {
        param.mutable_grad() = s.flat_grad.narrow(0, b.offsets[k], p.numel).view(p.shape);
      }
    }
  }
}

void EngineImpl::create_parts() {
  // A trainable bucket step() all-gathers waits for the next forward when every parameter in it
  // belongs to a unit (none is read before its unit runs) and step() publishes it from the
  // device masters.
  step_gather_unit.assign(layout.buckets.size(), -1);
  const bool defer = options.overlap_step_gather && !options.units.empty() &&
                     !S.offload_optimizer && !S.in_backward();
  for (const Bucket& b : layout.buckets) {
    if (!defer || !b.trainable || b.sharded_params || b.replicated || S.world == 1) continue;
    int first = std::numeric_limits<int>::max();
    for (int p : b.params) first = std::min(first, layout.params[static_cast<size_t>(p)].unit);
    if (first >= 0 && !b.params.empty()) step_gather_unit[static_cast<size_t>(b.index)] = first;
  }
  const std::vector<std::vector<Segment>> none;
  optimizer =
      std::make_unique<ShardOptimizer>(S.optimizer, master, layout.segments, S.hyper.momentum,
                                       S.state_dtype, S.offload_optimizer ? bucket_segments : none);
  gradients = make_gradient_strategy(*this);
  if (S.offload_optimizer) offload = std::make_unique<OffloadedOptimizer>(*this);
  const auto dev32 = at::TensorOptions().dtype(at::kFloat).device(S.device);
  units.resize(options.units.size());
  if (S.shard_units && S.offload_param && S.world == 1 && S.device.is_cuda())
    param_uploads = std::make_unique<CopyStream>(S.device);
  if (options.offload_activations) {
    int64_t limit = options.offload_activations_host_bytes;
    if (limit <= 0) {  // three quarters of what the host has, shared by the node's ranks
      const double ranks = std::max(1, ranks_from_env("LOCAL_WORLD_SIZE"));
      const double available = capacity::host_available_bytes();
      limit = available > 0 ? static_cast<int64_t>(0.75 * available / ranks)
                            : std::numeric_limits<int64_t>::max();
    }
    activation_host = std::make_shared<ActivationHost>(S.device, limit);
  }
  dummy = at::zeros({}, dev32).requires_grad_(true);
  if (options.recompute_keep_bytes != EngineOptions::kAutoKeep) {
    keep_budget->fixed = std::max<int64_t>(0, options.recompute_keep_bytes);
  } else if (S.device.is_cuda() && !S.offload_param) {
    keep_budget->memory = [device = S.device.has_index() ? S.device.index() : 0] {
      return DeviceMemory{device_stats::allocated(device), device_stats::peak_reserved(device),
                          device_stats::usable_memory(device)};
    };
  }
  steps.nonfinite_losses = at::zeros({}, dev32);
  install_hooks();
  if (options.gate != nullptr) options.gate->attach(this);
  steps.last_lr = learning_rate(0);
}

}  // namespace zero
}  // namespace zt
