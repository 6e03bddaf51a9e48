// Collective communication between ranks: the Communicator interface, its backends (NCCL on
// GPUs, Gloo on CPUs, a trivial one for a single rank) and start-up from the launcher's
// environment (torchrun, mpirun, srun).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zt {

enum class ReduceOp { kSum, kAvg, kMax };

/// A collective in flight. Owned by the caller; destroying an unwaited Work is allowed (the
/// collective still completes, and the backend keeps the tensors alive until it has). A Work
/// must not outlive the Communicator that issued it.
class Work {
 public:
  virtual ~Work() = default;
  /// Makes the result usable by the caller. On CPU this blocks until the collective finished.
  /// On CUDA it makes the caller's *current* stream wait for the collective (no host sync), so
  /// later kernels on that stream see the result. Idempotent. Throws DistributedError when the
  /// collective failed, timed out or a peer died.
  virtual void wait() = 0;
  /// Blocks the host until the collective finished (on CPU the same as wait()).
  virtual void synchronize() = 0;
};
using WorkHandle = std::unique_ptr<Work>;

enum class Backend { kAuto, kNccl, kGloo, kSelf };
const char* backend_name(Backend backend);

/// A group of ranks that run collectives together.
///
/// Collective-ness: every call below except rank()/world_size()/device()/backend() is a
/// collective: all ranks must issue the same calls in the same order with the same sizes and
/// dtypes (inputs may differ in content). A call implicitly synchronizes with the other ranks.
/// Threading: not thread-safe; issue all calls from one thread. Tensors must be contiguous and
/// live on `device()`; fp32, fp64, bf16, fp16 and int64 are supported (kAvg is not defined for
/// int64).
/// Ops return at once; the result is valid after `Work::wait()`. Tensors passed in must not be
/// modified until then. On CUDA they belong to the stream that is current at wait() (where they
/// were allocated): once wait() returned the backend lets go of them, and their memory may serve
/// later work on that stream.
///
/// Faults: a collective that fails, times out (`CommOptions::timeout`) or loses a peer throws
/// DistributedError from wait() or a later call. Its message names the rank(s) that failed first
/// (their own error, posted with post_failure) or stopped answering (no heartbeat through the
/// job's store), or says that the store itself (rank 0) is gone.
namespace comm {
class PeerWatch;
}

/// One collective as the GPU timed it (CommOptions::timeline; NCCL).
struct CollectiveTime {
  std::string op;     ///< "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"
  int64_t bytes = 0;  ///< of its larger buffer (the whole, not the shard)
  double in_flight_ms = 0;  ///< on the communication stream, from its start to its end
  /// How long the stream that waited for it (Work::wait) stood still at the wait, or how long
  /// the host blocked (Work::synchronize); 0 when it was done before it was needed, and when
  /// it was never waited on.
  double exposed_ms = 0;
};

class Communicator {
 public:
  virtual ~Communicator();

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual at::Device device() const = 0;
  virtual Backend backend() const = 0;

  /// In place: `tensor` becomes the elementwise reduction over ranks.
  virtual WorkHandle all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  /// `input` has world_size × output.numel() elements; rank r receives the reduction of
  /// input[r·n, (r+1)·n) over ranks in `output`.
  virtual WorkHandle reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                    ReduceOp op = ReduceOp::kSum) = 0;
  /// `output` has world_size × input.numel() elements; rank r's input lands at [r·n, (r+1)·n).
  virtual WorkHandle all_gather(const at::Tensor& output, const at::Tensor& input) = 0;
  /// In place: every rank's `tensor` becomes root's.
  virtual WorkHandle broadcast(const at::Tensor& tensor, int root) = 0;
  /// Returns when every rank has reached the barrier (blocking).
  virtual void barrier() = 0;

  /// All-gather of different sizes: rank r contributes counts[r] elements (its `input`), and
  /// `output` (sum of counts) receives them in rank order. Implemented by padding to the
  /// largest count, so it costs world_size × max(counts) elements of traffic.
  WorkHandle all_gather_uneven(const at::Tensor& output, const at::Tensor& input,
                               const std::vector<int64_t>& counts);

  /// All-to-all of different sizes: `input` holds, in rank order, send_counts[q] elements for
  /// rank q, and `output` receives, in rank order, recv_counts[q] elements from rank q. Rank r's
  /// send_counts[q] must equal rank q's recv_counts[r] (callers exchange their counts first, with
  /// an all_to_all of fixed sizes); a count may be 0, so ranks outside a group exchange nothing.
  /// Both tensors contiguous, of one dtype, with exactly the counts' sums of elements.
  WorkHandle all_to_all(const at::Tensor& output, const at::Tensor& input,
                        const std::vector<int64_t>& recv_counts,
                        const std::vector<int64_t>& send_counts);

  /// Throws the DistributedError of a collective that failed on this communicator, if one did.
  /// On NCCL a failed collective is aborted, and the results of collectives in flight then are
  /// undefined: a caller that reads a result through a host copy of its own (not
  /// Work::synchronize()) calls this before trusting the values. Not a collective; cheap.
  virtual void raise_if_failed() {}

  /// The collectives issued since the last call, in issue order, when CommOptions::timeline is
  /// on (NCCL; empty otherwise). Blocks until they finished. Not a collective.
  virtual std::vector<CollectiveTime> take_timeline() { return {}; }

  /// Tells the other ranks, through the job's store, that this rank is failing with `message`
  /// (its first line), so that the error a collective then raises on them names this rank and
  /// why. For errors of this rank's own (a bad batch, out of memory), not for DistributedError.
  /// Not a collective; never throws; does nothing at world size 1.
  void post_failure(const std::string& message) noexcept;

 protected:
  /// all_to_all after its checks: the backend's exchange (counts valid, tensors flat-viewable).
  virtual WorkHandle exchange(const at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& recv_counts,
                              const std::vector<int64_t>& send_counts) = 0;
  /// The job's signs of life (null at world size 1), handed to the backend by
  /// create_communicator.
  std::shared_ptr<comm::PeerWatch> peers_;
  /// `error`, then what the store says of the other ranks, as one line (blocks a few heartbeat
  /// intervals while it watches them). Never throws.
  std::string with_diagnosis(const std::string& error) noexcept;
};

/// Where this process sits in the job, as the launcher described it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun's agent already serves the store on master_port (TORCHELASTIC_USE_AGENT_STORE).
  bool agent_store = false;
  /// "torchrun", "openmpi", "slurm" or "single" (no launcher variables).
  std::string origin = "single";
};

/// Reads the launcher's variables: torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
/// MASTER_PORT; else OMPI_COMM_WORLD_* (MASTER_ADDR/PORT required); else SLURM_* (address from
/// the first host of SLURM_JOB_NODELIST, port 29500 by default); else a single process.
/// `getenv` is injectable for tests. Throws ConfigError naming a missing or malformed variable.
LaunchEnv launch_env_from_environment(
    const std::function<const char*(const char*)>& getenv = nullptr);

/// The first host name of a SLURM node list such as "gpu[03-05,9],cpu1" (→ "gpu03").
std::string first_slurm_host(const std::string& nodelist);

struct CommOptions {
  Backend backend =
      Backend::kAuto;  ///< kAuto: NCCL when `device` is CUDA, else Gloo (self at 1 rank)
  /// For CUDA, the device of this rank; "cuda" without an index means GPU `local_rank`, as the
  /// trainer picks it, so that every tensor the trainer makes on it matches the communicator's.
  at::Device device = at::kCPU;
  std::chrono::milliseconds timeout = std::chrono::seconds(1800);            ///< ddp_timeout
  std::chrono::milliseconds rendezvous_timeout = std::chrono::seconds(300);  ///< start-up
  /// Time every collective (Communicator::take_timeline). Costs two events per collective.
  /// create_communicator turns it on when ZT_COMM_TIMELINE is set.
  bool timeline = false;
};

/// Joins the job described by `env`: rendezvous through a c10d TCPStore on master_addr:
/// master_port (rank 0 serves it unless torchrun's agent does; a single rank needs none), then
/// builds the backend. Collective over all ranks. Throws DistributedError naming the address,
/// port and the ranks that never arrived when the rendezvous times out, or the port cannot be
/// served; ConfigError when the backend is not built in.
///
/// A job of several ranks talks over sockets, and a write to the socket of a peer that died
/// raises SIGPIPE, whose default action ends this process silently (c10d's Gloo transport and
/// store do not all write with MSG_NOSIGNAL; Python ignores SIGPIPE for them). So where
/// SIGPIPE still has its default action, the first multi-rank communicator sets it to ignored,
/// process-wide, and such a write fails with EPIPE — a DistributedError naming the peer. A
/// handler the host program installed is left as it is.
std::unique_ptr<Communicator> create_communicator(const LaunchEnv& env, const CommOptions& options);

/// Which backends this build of libzerotrain contains.
bool backend_available(Backend backend);

}  // namespace zt
