// Agreement between ranks, the few shapes every collective decision in zerotrain takes: which
// ranks failed a step, a step run on every rank that fails everywhere if it fails anywhere, and
// a handful of scalars reduced in one all-reduce.
//
// Every function here is a collective: all ranks call it in the same order, each once.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "zerotrain/comm.hpp"

namespace zt::comm {

/// Every rank's verdict in one all-reduce: the ranks whose `ok` was false, in order (empty when
/// none was).
std::vector<int> failed_ranks(Communicator& comm, bool ok);

/// The ranks as "0, 2, 3", for messages.
std::string rank_list(const std::vector<int>& ranks);

/// Runs `fn` on this rank, then agrees: this rank's own error is rethrown as it was; when only
/// other ranks failed, DistributedError "<what> failed on rank(s) …; see the error there". So a
/// failure on one rank never leaves the others waiting in a later collective.
void on_every_rank(Communicator& comm, const std::string& what, const std::function<void()>& fn);

/// `values` reduced element-wise over the ranks with `op` (in fp64), back on the host.
std::vector<double> reduce_scalars(Communicator& comm, const std::vector<double>& values,
                                   ReduceOp op = ReduceOp::kSum);

}  // namespace zt::comm
