// Starting the ranks of a job on this machine, as `torchrun --nproc_per_node N` does.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace zt {

struct LocalLaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  ///< 0: a free port is chosen
  /// Kill every rank after this long; zero means no limit.
  std::chrono::milliseconds timeout{0};
  /// After the first rank fails, the others get this long to notice and exit on their own (so
  /// their own error messages are seen) before they are killed.
  std::chrono::milliseconds grace = std::chrono::seconds(30);
  /// When set, rank R's stdout and stderr go to `<output_dir>/rank<R>.log`; otherwise they are
  /// inherited from the launcher.
  std::string output_dir;
  /// Extra environment variables for every rank (added to the launcher's own).
  std::vector<std::pair<std::string, std::string>> env;
  /// Each rank plays a node of its own (emulated_node_env): several ranks on one GPU over real
  /// NCCL, connected by sockets on loopback as the ranks of a multi-node Ethernet job are. For
  /// tests of the multi-rank GPU path on a one-GPU machine; never a speed figure.
  bool one_node_per_rank = false;
};

/// The variables that make rank `rank` of a job look like the only rank of a node of its own:
/// LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK=rank, and for NCCL a host id of its own
/// (NCCL_HOSTID; NCCL refuses two ranks on one GPU of one host), no peer-to-peer or shared
/// memory transport, sockets on the loopback interface. The one place these live: the
/// launcher's one_node_per_rank, `zerotrain launch --one_node_per_rank` and the GPU tests use it.
std::vector<std::pair<std::string, std::string>> emulated_node_env(int rank);

struct RankExit {
  int rank = 0;
  int exit_code = -1;  ///< -1 when killed by a signal
  int signal = 0;      ///< the signal that ended it, or 0
  bool killed_by_launcher = false;
  std::string log_path;  ///< when output_dir was set
};

struct LaunchResult {
  std::vector<RankExit> ranks;
  bool timed_out = false;
  int first_failed_rank = -1;  ///< -1 when all ranks exited with 0
  bool ok() const { return first_failed_rank < 0 && !timed_out; }
  /// A one-line summary per rank, e.g. "rank 1: exit 3".
  std::string summary() const;
};

/// Runs `command` (argv[0] searched in PATH) as `nproc` processes with torchrun's variables
/// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and waits for all
/// of them. The ranks form a process group of their own (so a signal meant for them never
/// reaches the launcher's caller or its other children: see signal_ranks) and die with the
/// launcher (PR_SET_PDEATHSIG). Blocking; not collective; call from one thread at a time.
/// Throws InvalidArgument for an empty command or nproc < 1.
LaunchResult launch_local(const std::vector<std::string>& command,
                          const LocalLaunchOptions& options);

/// Sends `sig` to the process group of the ranks launch_local is running, and to nothing else;
/// does nothing when none runs. Async-signal-safe: for the launcher's own signal handlers.
void signal_ranks(int sig);

/// A TCP port on `addr` that was free a moment ago (bound to port 0, then released).
int pick_free_port(const std::string& addr = "127.0.0.1");

}  // namespace zt
