// Signs of life between ranks, so that a failed collective names the rank that failed.
//
// A collective that fails only says that a peer went away ("Connection closed by remote peer",
// a timeout); it does not say which. Every rank of a multi-rank job therefore beats a counter in
// the rendezvous store (a client connection and a thread of its own), and a rank that fails for
// a reason of its own posts that reason there. When a collective fails, the rank asks what the
// store knows: who posted a failure, whose counter stopped, or that the store itself does not
// answer (rank 0, which serves it, died or stopped).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zerotrain/comm.hpp"

namespace zt::comm {

class PeerWatch {
 public:
  /// Connects its own client to the job's store and starts beating every `interval`. Holds
  /// `store` — the rendezvous store; on rank 0 the server itself — for as long as it lives, so
  /// the store outlives start-up whatever the backend keeps (NCCL keeps none). Throws
  /// DistributedError when the store cannot be reached.
  PeerWatch(const LaunchEnv& env, std::chrono::milliseconds interval,
            c10::intrusive_ptr<c10d::Store> store);
  /// Stops the beating thread. Never blocks longer than a few intervals: a thread stuck in a
  /// store that does not answer is left to end with the process.
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  /// Posts that this rank is failing with `message` (its first line, shortened), for the other
  /// ranks' diagnosis. Not a collective; never throws; only a rank's first post counts.
  void post_failure(const std::string& message) noexcept;

  /// What the store says of the other ranks, as a sentence for an error message ("rank 1
  /// stopped answering ..."; "rank 2 failed first: ..."), or "" when every other rank still
  /// beats and none posted a failure. Watches the counters for about three intervals, so it
  /// blocks that long (at most a few intervals more when the store does not answer). Never
  /// throws. Thread-safe.
  std::string diagnose() noexcept;

  struct State;  ///< shared with the beating thread

 private:
  std::shared_ptr<State> state_;
};

/// The heartbeat interval: ZT_HEARTBEAT_MS when set (tests), else 1 s.
std::chrono::milliseconds heartbeat_interval();

}  // namespace zt::comm
