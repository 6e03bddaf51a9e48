// How parameters are laid out in flat buckets and sharded across ranks.
//
// Every bucket is a contiguous flat space of whole parameters (each aligned to kAlign elements),
// padded to a multiple of world × kAlign and cut into world equal slices; rank r owns slice r of
// every bucket. Replicated buckets (all of them on stage 0) are one slice that every rank owns
// whole. Local buckets (trainable rank-local parameters: an expert-parallel rank's experts) are
// cut among the ranks holding the same values instead (its peers), rank r owning the slice of its
// place among them. Reduce-scatter of a bucket therefore lands
// exactly in the owner's slice, and the rank's optimizer state is the concatenation of its slices
// of the trainable buckets.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "optim/shard_optimizer.hpp"

namespace zt::zero {

/// Alignment of parameters inside a bucket and of slices, in elements: 64 bytes in fp32,
/// 32 in bf16/fp16 — whole vector lanes for the kernels and aligned NCCL chunks.
constexpr int64_t kAlign = 16;

inline int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

struct ParamInfo {
  std::string name;
  at::Tensor param;  ///< the module's parameter object (its data is replaced, never the object)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool trainable = false;
  bool decay = true;
  int unit = -1;            ///< sharding unit, -1 when in none
  bool persistent = false;  ///< stage 3: kept whole on every rank
  /// Its values are this rank's own (EngineOptions::rank_local): never sharded (persistent
  /// under stage 3), read from the source on each rank; trainable ones in local buckets.
  bool rank_local = false;
  int holders = 0;      ///< how many units' modules hold it
  bool shared = false;  ///< held by two units (tied weights): gradients arrive more than once
  /// Bytes, not values (a quantized base, uint8): frozen, in buckets of their own that are
  /// never converted to another dtype, only copied, gathered and broadcast.
  bool raw = false;
};

/// One bucket's slice on this rank.
struct ShardLayout {
  int64_t offset = 0;   ///< where the slice starts in this rank's flat fp32 state
  int64_t numel = 0;    ///< elements in the slice, padding included
  int64_t padding = 0;  ///< elements of the slice that belong to no parameter
};

struct Bucket {
  int index = 0;
  bool trainable = false;
  bool sharded_params = false;  ///< stage 3 unit bucket: parameters exist only as shards
  int unit = -1;
  std::vector<int> params;       ///< ParamInfo indices in layout order
  std::vector<int64_t> offsets;  ///< per param, offset in the bucket's flat space
  int64_t numel = 0;             ///< padded flat size
  int64_t shard_numel = 0;       ///< numel / world (numel when replicated)
  ShardLayout shard;             ///< this rank's slice (trainable buckets)
  bool late = false;             ///< holds a shared parameter: reduced only after backward
  bool raw = false;              ///< holds raw parameters (ParamInfo::raw) only, as uint8
  bool replicated = false;       ///< one slice, owned whole by every rank
  /// Holds trainable rank-local parameters only: cut among, and reduced over, the ranks holding
  /// the same values (EngineOptions::local_split.peers), not the job.
  bool local = false;
  int owner =
      0;  ///< which slice this rank owns: its place in its shard group or among its peers, or 0
  /// Start of this rank's slice in the bucket's flat space.
  int64_t slice_begin() const { return owner * shard_numel; }
};

struct LayoutOptions {
  int stage = 0;
  int world = 1;
  int rank = 0;
  int64_t bucket_size = 500000000;         ///< reduce_bucket_size (elements)
  int64_t persistence_threshold = 100000;  ///< stage3_param_persistence_threshold
  int num_units = 0;
  /// The ranks holding this rank's rank-local values, and this rank's place among them.
  int local_peers = 1;
  int local_place = 0;
  /// The ranks a bucket is cut among otherwise (EngineSettings::shard_group): consecutive groups
  /// of this many, rank % shard_group the slice a rank owns. 0: the world.
  int shard_group = 0;
};

struct Layout {
  std::vector<ParamInfo> params;
  std::vector<Bucket> buckets;
  std::vector<std::vector<int>> unit_buckets;  ///< stage 3: the sharded buckets of each unit
  bool replicated = false;                     ///< stage 0: every rank holds whole buckets
  int64_t state_numel = 0;                     ///< this rank's flat fp32 state
  std::vector<Segment> segments;               ///< real elements of the state, with decay flags
  /// The local buckets' slices in the state: one run [begin, end) (empty when none).
  int64_t local_state_begin = 0, local_state_end = 0;
};

/// Builds buckets for `params` (in module registration order). Stages 0–2 and stage-3
/// persistent parameters: buckets of up to bucket_size elements in reverse registration order
/// (the order backward produces gradients), trainable, trainable rank-local and frozen apart.
/// Stage 3: one trainable and one frozen bucket per unit. Inside a bucket, decaying parameters
/// come first.
Layout build_layout(std::vector<ParamInfo> params, const LayoutOptions& options);

}  // namespace zt::zero
