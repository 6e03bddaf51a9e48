// What the engine does, decided once: a pure function of the resolved DeepSpeed config, the
// caller's EngineOptions and the world, with no tensors and no side effects (unit-tested in
// tests/test_engine_settings.cpp). Every mode the engine's parts branch on is a field here.
#pragma once

#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "kernels/update.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"

namespace zt::zero {

/// How gradients get from autograd into this rank's fp32 accumulator slices (one part each,
/// lib/zero/gradients_*.cpp).
enum class GradientPath {
  kAllReduce,      ///< stage 0: flat gradients, all-reduced in place at the window's end
  kFlatScatter,    ///< stage 1: flat gradients, reduce-scattered at the window's end
  kStaged,         ///< stages 2/3: staged per bucket, reduce-scattered every micro-step
  kOneRank,        ///< one rank: no collective; gradients copied into the accumulator
  kInAccumulator,  ///< one rank, same dtype: each .grad is a view into the accumulator
  kInBackward,     ///< the optimizer runs inside backward; there is no accumulator
};

/// What is true of the world and the model before any tensor is placed.
struct EngineFacts {
  int world = 1;
  int rank = 0;
  at::Device device = at::kCPU;
};

struct EngineSettings {
  int stage = 0, world = 1, rank = 0, accumulation = 1;
  at::Device device = at::kCPU;
  bool fp16 = false, bf16 = false;
  at::ScalarType compute = at::kFloat;       ///< dtype of the module's parameters
  at::ScalarType wire = at::kFloat;          ///< dtype of gradient reductions
  at::ScalarType master_dtype = at::kFloat;  ///< fp32, or bf16 (bf16_master_weights_and_grads)
  at::ScalarType state_dtype = at::kFloat;   ///< the optimizer's moments
  GradientPath gradients = GradientPath::kAllReduce;
  bool overlap = false;  ///< reduce buckets while backward runs
  bool use_reduce_scatter = true;
  /// Ranks a bucket's state and (stage 3) parameters are cut among: the world, or MiCS's groups
  /// of consecutive ranks (mics_shard_size), each group holding a whole copy.
  int shard_group = 1;
  /// ZeRO++ hpZ (zero_hpz_partition_size): stage 3's secondary copy of the gathered parameters
  /// cut among this many consecutive ranks; 1: none.
  int hpz_group = 1;
  /// ZeRO++ qwZ: stage 3's parameter gathers in blockwise int8 (lib/comm/quantized.hpp).
  bool quantized_weights = false;
  /// ZeRO++ qgZ: gradient reduce-scatters (stages 1-3) in blockwise int8, in two hops where
  /// the job spans several nodes (within the node, then across).
  bool quantized_gradients = false;
  double pre_scale = 1.0, post_scale = 1.0;  ///< around each gradient reduction (product 1/world)
  bool offload_optimizer = false, offload_param = false;
  /// With offload_optimizer: the share of the state the CPU holds (offload_optimizer.ratio).
  double offload_ratio = 1.0;
  bool checkpointing = false;  ///< recompute units in backward
  /// Stage 3 keeps unit parameters as shards, gathered per unit call. Not at one rank without
  /// parameter offload: the shard would be the whole parameter, so there is nothing to gather or
  /// release, and stage 3 runs as stage 2 (the same math; recomputation only if asked for).
  bool shard_units = false;
  int layout_stage =
      0;  ///< the stage the bucket layout is built for (2 where stage 3 shards nothing)
  /// The master slice IS the compute copy (bf16 masters where a rank keeps whole buckets).
  bool master_aliases_params = false;
  double clip = 0.0;        ///< gradient_clipping (0: none)
  int64_t bucket_size = 1;  ///< reduce_bucket_size, elements
  int64_t allgather_bucket_size = 1;
  int64_t persistence_threshold = 0;
  int64_t prefetch_elements = 0, max_live_elements = 0;
  UpdateHyper hyper;  ///< the optimizer's hyper-parameters; lr and grad_scale are set per step
  OptimizerType optimizer = OptimizerType::kAdamW;
  LossScalerParams scaler{false, 1.0, 1000, 1, false, 1.0};  ///< fp16 only
  /// Things the caller should be told (the engine logs them on rank 0).
  std::vector<std::string> warnings;

  bool in_backward() const { return gradients == GradientPath::kInBackward; }
  bool grads_in_acc() const { return gradients == GradientPath::kInAccumulator; }
  bool replicated() const { return stage == 0; }  ///< every rank keeps whole buckets
};

/// Decides everything. Throws ConfigError for a combination that cannot run (naming the
/// config file and keys); `ds` must be resolved.
EngineSettings resolve_settings(const DeepSpeedConfig& ds, const EngineOptions& options,
                                const EngineFacts& facts);

/// Bytes of optimizer state this rank keeps on its device for `state_numel` elements of its
/// trainable slices: the gradient accumulator, the masters and the optimizer's moments, less
/// the share offload_optimizer keeps on the host. A lower bound of what the engine allocates
/// there (the compute copy of the parameters and the buckets in flight come on top).
double device_state_bytes(const EngineSettings& s, int64_t state_numel);

/// Bytes of optimizer state this rank keeps in host memory, a lower bound as device_state_bytes:
/// on a CPU all of it, on a GPU the share offload_optimizer keeps on the host (fp32 masters and
/// moments).
double host_state_bytes(const EngineSettings& s, int64_t state_numel);

/// Whether EngineOptions::update_in_backward can be honoured without changing the math, and if
/// not, the first reason why not ("" when it can). Exposed for the eligibility table's tests.
std::string update_in_backward_blocker(const EngineSettings& s);

}  // namespace zt::zero
