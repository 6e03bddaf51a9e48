// See sequence_parallel.hpp.
#include "model/sequence_parallel.hpp"

#include <vector>

#include "model/exchange.hpp"

namespace zt::model {

SequenceShard::SequenceShard(std::shared_ptr<Communicator> c, int64_t group_size)
    : comm(std::move(c)), size(group_size) {
  place = comm->rank() % size;
  first = comm->rank() - place;
}

at::Tensor SequenceShard::swap(const at::Tensor& chunks) const {
  const int64_t width = chunks.size(-1);
  const int64_t rows = chunks.numel() / width / size;  // per member, the same both ways
  std::vector<int64_t> counts(static_cast<size_t>(comm->world_size()), 0);
  for (int64_t j = 0; j < size; ++j) counts[static_cast<size_t>(first + j)] = rows;
  return exchange_rows(comm, chunks.contiguous().view({-1, width}), counts, counts)
      .view(chunks.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> SequenceShard::to_heads(const at::Tensor& q,
                                                                       const at::Tensor& k,
                                                                       const at::Tensor& v) const {
  const int64_t b = q.size(0), t = q.size(2), d = q.size(3);
  at::Tensor keys = k, values = v;
  if (k.size(1) < size) {  // fewer key/value heads than members: each replicated (ALST)
    keys = k.repeat_interleave(size / k.size(1), 1);
    values = v.repeat_interleave(size / v.size(1), 1);
  }
  const int64_t hq = q.size(1) / size, hk = keys.size(1) / size;
  // [B, h, t, D] → [size, B, h / size, t, D]: member j's heads first.
  const auto chunked = [&](const at::Tensor& x, int64_t per) {
    return x.reshape({b, size, per, t, d}).permute({1, 0, 2, 3, 4});
  };
  const at::Tensor got = swap(at::cat({chunked(q, hq), chunked(keys, hk), chunked(values, hk)}, 2));
  // Chunk j holds member j's positions of this rank's heads: [B, h, size·t, D].
  const at::Tensor all = got.permute({1, 2, 0, 3, 4}).reshape({b, hq + 2 * hk, size * t, d});
  return {all.narrow(1, 0, hq), all.narrow(1, hq, hk), all.narrow(1, hq + hk, hk)};
}

at::Tensor SequenceShard::to_positions(const at::Tensor& out) const {
  const int64_t b = out.size(0), h = out.size(1), t = out.size(2) / size, d = out.size(3);
  // Chunk j: member j's positions of this rank's heads.
  const at::Tensor got = swap(out.reshape({b, h, size, t, d}).permute({2, 0, 1, 3, 4}));
  // Chunk j: this rank's positions of member j's heads → [B, t, size·h, D].
  return got.permute({1, 3, 0, 2, 4}).reshape({b, t, size * h, d});
}

}  // namespace zt::model
