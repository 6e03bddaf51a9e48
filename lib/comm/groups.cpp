// See groups.hpp.
#include "comm/groups.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "comm/work.hpp"
#include "zerotrain/error.hpp"

namespace zt::comm {
namespace {

void check_group(const Communicator& comm, const std::vector<int>& group, const char* op) {
  const bool sorted = std::is_sorted(group.begin(), group.end()) &&
                      std::adjacent_find(group.begin(), group.end()) == group.end();
  const bool inside = !group.empty() && group.front() >= 0 && group.back() < comm.world_size();
  if (!sorted || !inside || std::find(group.begin(), group.end(), comm.rank()) == group.end()) {
    throw InvalidArgument(fmt::format(
        "{}: the group [{}] must list distinct ranks of the {} in ascending order, rank {} among "
        "them",
        op, fmt::join(group, ", "), comm.world_size(), comm.rank()));
  }
}

// `chunk` elements to (and from) every member of the group, none to anyone else.
std::vector<int64_t> group_counts(const Communicator& comm, const std::vector<int>& group,
                                  int64_t chunk) {
  std::vector<int64_t> counts(static_cast<size_t>(comm.world_size()), 0);
  for (int q : group) counts[static_cast<size_t>(q)] = chunk;
  return counts;
}

}  // namespace

WorkHandle group_reduce_scatter(Communicator& comm, const at::Tensor& output,
                                const at::Tensor& input, const std::vector<int>& group) {
  check_group(comm, group, "group_reduce_scatter");
  const int64_t members = static_cast<int64_t>(group.size()), chunk = output.numel();
  if (input.numel() != members * chunk) {
    throw InvalidArgument(fmt::format(
        "group_reduce_scatter: the input has {} elements, not {} × {} (the group's chunks)",
        input.numel(), members, chunk));
  }
  if (members == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return std::make_unique<DoneWork>();
  }
  const std::vector<int64_t> counts = group_counts(comm, group, chunk);
  at::Tensor received = at::empty({members * chunk}, input.options());
  WorkHandle work = comm.all_to_all(received, input.reshape({-1}), counts, counts);
  return std::make_unique<ThenWork>(std::move(work), [output, received, members, chunk]() mutable {
    output.view({-1}).copy_(received.view({members, chunk}).sum(0, false, at::kFloat));
  });
}

WorkHandle group_all_reduce(Communicator& comm, const at::Tensor& tensor,
                            const std::vector<int>& group) {
  check_group(comm, group, "group_all_reduce");
  const int64_t members = static_cast<int64_t>(group.size());
  if (members == 1) return std::make_unique<DoneWork>();
  const int64_t n = tensor.numel();
  const int64_t chunk = (n + members - 1) / members;
  at::Tensor flat = tensor.view({-1});
  at::Tensor padded = flat;
  if (chunk * members != n) {
    padded = at::zeros({chunk * members}, tensor.options());
    padded.narrow(0, 0, n).copy_(flat);
  }
  // Each member sums its chunk, then sends the sum to every member (into place in `padded`,
  // whose chunk of this rank's own was consumed by the first exchange, which has been waited on).
  at::Tensor mine = at::empty({chunk}, tensor.options());
  group_reduce_scatter(comm, mine, padded, group)->wait();
  WorkHandle gathered = group_all_gather(comm, padded, mine, group);
  if (padded.is_same(flat)) return gathered;
  return std::make_unique<ThenWork>(
      std::move(gathered), [flat, padded, n]() mutable { flat.copy_(padded.narrow(0, 0, n)); });
}

WorkHandle group_all_gather(Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                            const std::vector<int>& group) {
  check_group(comm, group, "group_all_gather");
  const int64_t members = static_cast<int64_t>(group.size());
  if (output.numel() != members * input.numel()) {
    throw InvalidArgument(fmt::format(
        "group_all_gather: the output has {} elements, not {} × {} (the group's inputs)",
        output.numel(), members, input.numel()));
  }
  if (members == 1) {
    output.view({-1}).copy_(input.reshape({-1}));
    return std::make_unique<DoneWork>();
  }
  const int64_t n = input.numel();
  at::Tensor sent = input.reshape({1, n}).expand({members, n}).contiguous();
  const std::vector<int64_t> counts = group_counts(comm, group, n);
  return comm.all_to_all(output, sent, counts, counts);  // the backend keeps `sent` alive
}

}  // namespace zt::comm
