// Start-up: the c10d store every rank meets at, and the check that every rank arrived.
#pragma once

#include <chrono>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zerotrain/comm.hpp"

namespace zt::comm {

/// Serves (rank 0, unless torchrun's agent does) or joins the TCPStore at
/// env.master_addr:env.master_port, then waits until every rank has announced itself. Collective.
/// Throws DistributedError naming the address, port and missing ranks after `timeout`.
/// The returned store's own timeout is set to `op_timeout` for later use by the backends.
c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout,
                                           std::chrono::milliseconds op_timeout);

/// A prefix for this job's keys, so torchrun restarts on the agent's store do not collide.
std::string key_prefix();

}  // namespace zt::comm
