// Constructors of the backends that exist only in some builds (see build_config.hpp).
#pragma once

#include <memory>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zerotrain/comm.hpp"

namespace zt::comm {

class PeerWatch;

/// An in-process store for a single rank (c10d HashStore).
c10::intrusive_ptr<c10d::Store> local_store();

/// Gloo through c10d's ProcessGroupGloo (CPU). Built where Gloo headers exist (ZT_WITH_GLOO).
/// `peers` (null at one rank) becomes the communicator's peers_.
std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const LaunchEnv& env,
                                                     const CommOptions& options,
                                                     std::shared_ptr<PeerWatch> peers);

/// NCCL with its own communication stream (ZT_WITH_NCCL).
std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const LaunchEnv& env,
                                                     const CommOptions& options,
                                                     std::shared_ptr<PeerWatch> peers);

}  // namespace zt::comm
