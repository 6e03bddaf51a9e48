// A backend-independent check of every collective against values computed on the host.
#pragma once

#include "zerotrain/comm.hpp"

namespace zt::test {

/// Runs all_reduce (sum/avg/max), reduce_scatter (sum/avg/max), all_gather, uneven all_gather
/// (with an empty contribution), broadcast from the last rank, several ops in flight waited
/// in reverse order, and a barrier, in `dtype` on the communicator's device; REQUIREs exact
/// results (all values are small integers or halves, exact in bf16/fp16). Collective.
void check_collectives(Communicator& comm, at::ScalarType dtype);

}  // namespace zt::test
