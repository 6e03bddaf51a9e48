// Collectives among a group of ranks on a communicator of the whole job, built from all_to_all:
// a rank exchanges data only with the members of its own group, and every rank of the job makes
// the same call at the same point (each with its own group). The groups must partition the job
// (rank q is in rank r's group exactly when r is in q's), as expert parallelism's do: the ranks
// that hold the same experts, and the ranks whose experts together make the whole.
//
// Collective over the whole communicator; same threading as Communicator.
#pragma once

#include <vector>

#include "zerotrain/comm.hpp"

namespace zt::comm {

/// Sums `tensor` in place over the ranks of `group` (ascending, this rank among them):
/// group_reduce_scatter then group_all_gather (each member sums 1/size of the elements). The
/// first is waited on before this returns (on CUDA: on the current stream), the second is the
/// handle's. A group of one exchanges nothing.
WorkHandle group_all_reduce(Communicator& comm, const at::Tensor& tensor,
                            const std::vector<int>& group);

/// `input` has group.size() × output.numel() elements; the member at place j of the group
/// receives in `output` the sum (in fp32, rounded once) of every member's chunk j. One all_to_all;
/// the sum runs at wait(). A group of one copies.
WorkHandle group_reduce_scatter(Communicator& comm, const at::Tensor& output,
                                const at::Tensor& input, const std::vector<int>& group);

/// `output` (group.size() × input.numel() elements) receives every member's `input`, in group
/// order. A group of one copies.
WorkHandle group_all_gather(Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                            const std::vector<int>& group);

}  // namespace zt::comm
