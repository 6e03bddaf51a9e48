// Bucket construction and slice bookkeeping.
#include "zero/layout.hpp"

#include <algorithm>

namespace zt::zero {
namespace {

void finish_bucket(Bucket& b, const std::vector<ParamInfo>& params, const LayoutOptions& o) {
  // Decaying parameters first so each rank's slice has at most one run of each kind.
  std::stable_sort(b.params.begin(), b.params.end(), [&](int x, int y) {
    return params[static_cast<size_t>(x)].decay && !params[static_cast<size_t>(y)].decay;
  });
  int64_t offset = 0;
  for (int p : b.params) {
    b.offsets.push_back(offset);
    offset += round_up(params[static_cast<size_t>(p)].numel, kAlign);
  }
  const int group = o.shard_group > 0 ? o.shard_group : o.world;
  const int64_t parts = b.replicated ? 1 : b.local ? o.local_peers : group;
  b.owner = b.replicated ? 0 : b.local ? o.local_place : o.rank % group;
  b.numel = round_up(std::max<int64_t>(offset, 1), parts * kAlign);
  b.shard_numel = b.numel / parts;
}

}  // namespace

Layout build_layout(std::vector<ParamInfo> params, const LayoutOptions& o) {
  Layout L;
  L.params = std::move(params);
  L.replicated = o.stage == 0;
  const bool stage3 = o.stage == 3;

  // Stage 3: small parameters and those outside every unit stay whole (persistent).
  if (stage3) {
    for (ParamInfo& p : L.params) {
      p.persistent = p.unit < 0 || p.numel < o.persistence_threshold || p.rank_local;
    }
  }

  auto add_bucket = [&](std::vector<int> members, bool trainable, bool raw, bool local,
                        bool sharded, int unit) {
    if (members.empty()) return;
    Bucket b;
    b.index = static_cast<int>(L.buckets.size());
    b.trainable = trainable;
    b.raw = raw;
    b.sharded_params = sharded;
    b.unit = unit;
    b.local = local;
    b.replicated = L.replicated;
    b.params = std::move(members);
    for (int m : b.params) b.late = b.late || L.params[static_cast<size_t>(m)].shared;
    finish_bucket(b, L.params, o);
    L.buckets.push_back(std::move(b));
  };
  // The kinds of bucket: trainable values, trainable rank-local values, frozen values, frozen
  // bytes (raw parameters). Frozen rank-local values are never reduced: they mix with the rest.
  struct Kind {
    bool trainable, raw, local;
  };
  const Kind kinds[] = {
      {true, false, false}, {true, false, true}, {false, false, false}, {false, true, false}};
  auto of_kind = [](const ParamInfo& p, const Kind& k) {
    return p.trainable == k.trainable && p.raw == k.raw &&
           (!p.trainable || p.rank_local == k.local);
  };

  // Resident buckets by size, in reverse registration order.
  for (const Kind& kind : kinds) {
    std::vector<int> current;
    int64_t filled = 0;
    for (int i = static_cast<int>(L.params.size()) - 1; i >= 0; --i) {
      const ParamInfo& p = L.params[static_cast<size_t>(i)];
      if (!of_kind(p, kind) || (stage3 && !p.persistent)) continue;
      if (!current.empty() && filled + p.numel > o.bucket_size) {
        add_bucket(std::move(current), kind.trainable, kind.raw, kind.local, false, -1);
        current.clear();
        filled = 0;
      }
      current.push_back(i);
      filled += p.numel;
    }
    add_bucket(std::move(current), kind.trainable, kind.raw, kind.local, false, -1);
  }

  // Stage 3: the sharded buckets of each unit.
  if (stage3) {
    L.unit_buckets.assign(static_cast<size_t>(o.num_units), {});
    for (int u = 0; u < o.num_units; ++u) {
      for (const Kind& kind : kinds) {
        std::vector<int> members;
        for (int i = 0; i < static_cast<int>(L.params.size()); ++i) {
          const ParamInfo& p = L.params[static_cast<size_t>(i)];
          if (p.unit == u && !p.persistent && of_kind(p, kind)) members.push_back(i);
        }
        if (members.empty()) continue;
        L.unit_buckets[static_cast<size_t>(u)].push_back(static_cast<int>(L.buckets.size()));
        add_bucket(std::move(members), kind.trainable, kind.raw, kind.local, true, u);
      }
    }
  }

  // This rank's slices of the trainable buckets form its flat state; record where the real
  // elements are. Runs of the same decay setting merge across alignment padding (padding
  // stays zero under every update rule, so including it is harmless).
  for (Bucket& b : L.buckets) {
    if (!b.trainable) continue;
    b.shard.offset = L.state_numel;
    b.shard.numel = b.shard_numel;
    if (b.local) {
      if (L.local_state_end == L.local_state_begin) L.local_state_begin = L.state_numel;
      L.local_state_end = L.state_numel + b.shard_numel;
    }
    const int64_t lo = b.slice_begin(), hi = lo + b.shard_numel;
    int64_t real = 0;
    for (size_t k = 0; k < b.params.size(); ++k) {
      const ParamInfo& p = L.params[static_cast<size_t>(b.params[k])];
      int64_t begin = std::max(lo, b.offsets[k]), end = std::min(hi, b.offsets[k] + p.numel);
      if (begin >= end) continue;
      real += end - begin;
      Segment s{L.state_numel + (begin - lo), end - begin, p.decay};
      if (!L.segments.empty()) {
        Segment& last = L.segments.back();
        if (last.decay == s.decay && last.offset >= b.shard.offset) {
          last.length = s.offset + s.length - last.offset;
          continue;
        }
      }
      L.segments.push_back(s);
    }
    b.shard.padding = b.shard_numel - real;
    L.state_numel += b.shard_numel;
  }
  return L;
}

}  // namespace zt::zero
