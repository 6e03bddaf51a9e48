// See quantized.hpp.
#include "comm/quantized.hpp"

#include <fmt/format.h>

#include <numeric>

#include "comm/groups.hpp"
#include "comm/work.hpp"
#include "zerotrain/error.hpp"

namespace zt::comm {
namespace {

int64_t blocks_of(int64_t n) {
  return (n + kQuantBlock - 1) / kQuantBlock;
}

std::vector<int> whole_job(const Communicator& comm, const std::vector<int>& group) {
  if (!group.empty()) return group;
  std::vector<int> all(static_cast<size_t>(comm.world_size()));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// Checks that `many` holds `members` × `one` elements (the exchange's other side), naming `op`;
// a group of one copies `from` into `to` and is done (nothing travels, nothing is quantized).
WorkHandle checked_or_alone(const char* op, const char* many_name, const at::Tensor& many,
                            const at::Tensor& one, int64_t members, const at::Tensor& to,
                            const at::Tensor& from) {
  if (many.numel() != members * one.numel()) {
    throw InvalidArgument(fmt::format("{}: the {} has {} elements, not {} × {} (the group's)", op,
                                      many_name, many.numel(), members, one.numel()));
  }
  if (members > 1) return nullptr;
  to.view({-1}).copy_(from.reshape({-1}));
  return std::make_unique<DoneWork>();
}

std::vector<int64_t> counts_for(const Communicator& comm, const std::vector<int>& group,
                                int64_t each) {
  std::vector<int64_t> counts(static_cast<size_t>(comm.world_size()), 0);
  for (int q : group) counts[static_cast<size_t>(q)] = each;
  return counts;
}

}  // namespace

int64_t quantized_bytes(int64_t n) {
  return blocks_of(n) * (kQuantBlock + 4);
}

at::Tensor quantize_blocks(const at::Tensor& values) {
  const int64_t rows = values.dim() > 1 ? values.size(0) : 1;
  const int64_t n = values.numel() / std::max<int64_t>(1, rows), blocks = blocks_of(n);
  at::Tensor x = values.reshape({rows, n}).to(at::kFloat);
  if (blocks * kQuantBlock != n) x = at::constant_pad_nd(x, {0, blocks * kQuantBlock - n});
  x = x.view({rows, blocks, kQuantBlock});
  const at::Tensor amax = x.abs().amax({2}, /*keepdim=*/true);
  // A block of zeros keeps scale 1 (its values are 0 whatever the scale); NaN and inf pass on.
  const at::Tensor scale = at::where(amax.eq(0), at::ones_like(amax), amax / 127.0);
  const at::Tensor q = (x / scale).round().clamp(-127, 127).to(at::kChar);
  return at::cat({q.view({rows, blocks * kQuantBlock}).view(at::kByte),
                  scale.view({rows, blocks}).contiguous().view(at::kByte)},
                 1);
}

at::Tensor dequantize_blocks(const at::Tensor& bytes, int64_t n) {
  const int64_t blocks = blocks_of(n), values = blocks * kQuantBlock;
  const at::Tensor b = bytes.reshape({-1, quantized_bytes(n)});
  const int64_t rows = b.size(0);
  const at::Tensor q = b.narrow(1, 0, values).contiguous().view(at::kChar).to(at::kFloat);
  const at::Tensor scale = b.narrow(1, values, blocks * 4).contiguous().view(at::kFloat);
  return (q.view({rows, blocks, kQuantBlock}) * scale.view({rows, blocks, 1}))
      .view({rows, values})
      .narrow(1, 0, n);
}

WorkHandle quantized_all_gather(Communicator& comm, const at::Tensor& output,
                                const at::Tensor& input, const std::vector<int>& group) {
  const std::vector<int> members = whole_job(comm, group);
  const int64_t m = static_cast<int64_t>(members.size()), n = input.numel();
  if (WorkHandle alone =
          checked_or_alone("quantized_all_gather", "output", output, input, m, output, input)) {
    return alone;
  }
  const at::Tensor sent = quantize_blocks(input.reshape({1, n})).view({-1});
  at::Tensor received = at::empty({m * sent.numel()}, sent.options());
  WorkHandle work = group.empty() ? comm.all_gather(received, sent)
                                  : group_all_gather(comm, received, sent, members);
  return std::make_unique<ThenWork>(std::move(work), [output, received, sent, n]() mutable {
    output.view({-1}).copy_(dequantize_blocks(received, n).reshape({-1}));
  });
}

WorkHandle quantized_reduce_scatter(Communicator& comm, const at::Tensor& output,
                                    const at::Tensor& input, const std::vector<int>& group) {
  const std::vector<int> members = whole_job(comm, group);
  const int64_t m = static_cast<int64_t>(members.size()), n = output.numel();
  if (WorkHandle alone =
          checked_or_alone("quantized_reduce_scatter", "input", input, output, m, output, input)) {
    return alone;
  }
  const at::Tensor sent = quantize_blocks(input.reshape({m, n})).view({-1});
  at::Tensor received = at::empty_like(sent);
  const std::vector<int64_t> counts = counts_for(comm, members, quantized_bytes(n));
  WorkHandle work = comm.all_to_all(received, sent, counts, counts);
  return std::make_unique<ThenWork>(std::move(work), [output, received, sent, m, n]() mutable {
    output.view({-1}).copy_(dequantize_blocks(received.view({m, -1}), n).sum(0));
  });
}

}  // namespace zt::comm
