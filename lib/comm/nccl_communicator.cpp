// The GPU backend: NCCL on a communication stream of its own.
//
// Ordering without host syncs: each op records an event on the caller's compute stream and makes
// the communication stream wait on it (so the op sees every kernel that produced its inputs),
// launches NCCL on the communication stream, and records a completion event there.
// Work::wait() makes the caller's current stream wait on that event; only synchronize() blocks
// the host. A watchdog thread polls completion events and ncclCommGetAsyncError: an op that
// outlives the timeout, or an asynchronous NCCL error (a dead peer), aborts the communicator so
// that kernels stuck waiting for a peer exit, and every later call throws DistributedError
// instead of hanging; its message says which rank failed or stopped answering (PeerWatch).
// Tensors stay referenced until Work::wait() made the caller's stream wait for the op (or, for
// an op never waited on, until it completed), so the caching allocator never hands their memory
// to that stream while NCCL still uses it — and a host running ahead of the GPU does not keep
// every buffer it already let go of (ZeRO-3's gathered units) allocated.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "comm/backends.hpp"
#include "comm/cuda_glue.hpp"
#include "comm/rendezvous.hpp"
#include "comm/work.hpp"
#include "util/cuda_check.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0), "zerotrain needs NCCL 2.18 or newer");

namespace zt::comm {
namespace {

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

[[noreturn]] void throw_nccl(ncclResult_t r, ncclComm_t comm, const std::string& what,
                             const char* file, int line) {
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  throw DistributedError(fmt::format("{}: NCCL error '{}'{}{} (NCCL {}, {}:{})", what,
                                     ncclGetErrorString(r), detail && *detail ? ": " : "",
                                     detail ? detail : "", nccl_version(), file, line));
}

#define ZT_NCCL_CHECK(expr, comm, what)                                              \
  do {                                                                               \
    ncclResult_t zt_res_ = (expr);                                                   \
    if (zt_res_ != ncclSuccess) throw_nccl(zt_res_, comm, what, __FILE__, __LINE__); \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      throw InvalidArgument(fmt::format("NCCL: unsupported dtype {}", c10::toString(t)));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// An event destroyed when the last holder lets go (CUDA defers the release until it completed).
struct Event {
  cudaEvent_t handle = nullptr;
  explicit Event(bool timing = false) {
    ZT_CUDA_CHECK(cudaEventCreateWithFlags(&handle, timing ? 0 : cudaEventDisableTiming));
  }
  ~Event() { cudaEventDestroy(handle); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

class NcclCommunicator;

// The tensors of a collective in flight. Shared by its Work and the watchdog's pending list:
// wait() lets go of them (every later use or reuse of their memory on the caller's stream is
// ordered after the collective from then on), the watchdog when the collective completed.
using Held = std::shared_ptr<std::vector<at::Tensor>>;

// A timed collective (CommOptions::timeline): its start and end on the communication stream,
// and where the waiting stream arrived at its wait (or how long the host blocked).
struct Timed {
  std::string op;
  int64_t bytes = 0;
  std::shared_ptr<Event> start, done, arrival;
  double host_wait_ms = 0;
  bool waited = false;
};

class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, std::shared_ptr<Event> done, Held held,
           std::shared_ptr<Timed> timed)
      : owner_(owner), done_(std::move(done)), held_(std::move(held)), timed_(std::move(timed)) {}
  void wait() override;
  void synchronize() override;

 private:
  NcclCommunicator* owner_;
  std::shared_ptr<Event> done_;
  Held held_;
  std::shared_ptr<Timed> timed_;  // null unless the communicator times collectives
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                   const CommOptions& options, std::shared_ptr<PeerWatch> peers)
      : rank_(env.rank),
        world_(env.world_size),
        device_(options.device),
        timeout_(options.timeout),
        timeline_on_(options.timeline) {
    peers_ = std::move(peers);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // clear the sticky error of a machine without a driver
      throw DistributedError(
          fmt::format("rank {}: the NCCL backend needs a CUDA device, but none "
                      "is visible (CUDA_VISIBLE_DEVICES, driver?)",
                      rank_));
    }
    index_ = device_.has_index() ? device_.index() : 0;
    if (index_ >= count) {
      throw DistributedError(
          fmt::format("rank {}: CUDA device {} does not exist ({} visible)", rank_, index_, count));
    }
    ZT_CUDA_CHECK(cudaSetDevice(index_));
    int low = 0, high = 0;
    ZT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&low, &high));
    // High priority, so communication kernels are not starved by the compute stream.
    ZT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, high));

    ncclUniqueId id;
    const std::string key = key_prefix() + "nccl_unique_id";
    if (rank_ == 0) {
      ZT_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
      const auto* p = reinterpret_cast<const uint8_t*>(&id);
      if (world_ > 1) store->set(key, std::vector<uint8_t>(p, p + sizeof(id)));
    } else {
      std::vector<uint8_t> bytes;
      try {
        bytes = store->get(key);
      } catch (const std::exception& e) {
        throw DistributedError(with_diagnosis(
            fmt::format("rank {}: did not receive NCCL's id from rank 0: {}", rank_, e.what())));
      }
      if (bytes.size() != sizeof(id)) throw DistributedError("malformed NCCL id in the store");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    const ncclResult_t init = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
    if (init != ncclSuccess) {
      try {
        throw_nccl(init, nullptr,
                   fmt::format("rank {}: ncclCommInitRank ({} ranks)", rank_, world_), __FILE__,
                   __LINE__);
      } catch (const DistributedError& e) {
        throw DistributedError(with_diagnosis(e.what()));
      }
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (!aborted_) {
      cudaStreamSynchronize(stream_);
      ncclCommDestroy(comm_);
    }
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  at::Device device() const override { return device_; }
  Backend backend() const override { return Backend::kNccl; }

  WorkHandle all_reduce(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, device_, "all_reduce", "tensor");
    check_op(t, op, "all_reduce");
    return launch("all_reduce", {t}, [&] {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                           nccl_type(t.scalar_type()), nccl_op(op), comm_, stream_);
    });
  }

  WorkHandle reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_tensor(out, device_, "reduce_scatter", "output");
    check_tensor(in, device_, "reduce_scatter", "input");
    check_sizes(out, in, world_, "reduce_scatter");
    check_op(in, op, "reduce_scatter");
    return launch("reduce_scatter", {out, in}, [&] {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                               nccl_type(in.scalar_type()), nccl_op(op), comm_, stream_);
    });
  }

  WorkHandle all_gather(const at::Tensor& out, const at::Tensor& in) override {
    check_tensor(out, device_, "all_gather", "output");
    check_tensor(in, device_, "all_gather", "input");
    check_sizes(in, out, world_, "all_gather");
    return launch("all_gather", {out, in}, [&] {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                           nccl_type(in.scalar_type()), comm_, stream_);
    });
  }

  WorkHandle broadcast(const at::Tensor& t, int root) override {
    check_tensor(t, device_, "broadcast", "tensor");
    if (root < 0 || root >= world_) {
      throw InvalidArgument(fmt::format("broadcast: root {} is not a rank of {}", root, world_));
    }
    return launch("broadcast", {t}, [&] {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                           nccl_type(t.scalar_type()), root, comm_, stream_);
    });
  }

  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in,
                      const std::vector<int64_t>& recv_counts,
                      const std::vector<int64_t>& send_counts) override {
    // Point-to-point sends and receives in one NCCL group (NCCL has no all-to-all of its own).
    const ncclDataType_t type = nccl_type(in.scalar_type());
    const size_t size = in.element_size();
    return launch("all_to_all", {out, in}, [&] {
      ncclResult_t r = ncclGroupStart();
      int64_t sent = 0, received = 0;
      for (int q = 0; q < world_ && (r == ncclSuccess || r == ncclInProgress); ++q) {
        const int64_t s = send_counts[static_cast<size_t>(q)];
        const int64_t v = recv_counts[static_cast<size_t>(q)];
        if (s > 0) {
          r = ncclSend(static_cast<const char*>(in.data_ptr()) + sent * size,
                       static_cast<size_t>(s), type, q, comm_, stream_);
        }
        if (v > 0 && (r == ncclSuccess || r == ncclInProgress)) {
          r = ncclRecv(static_cast<char*>(out.data_ptr()) + received * size, static_cast<size_t>(v),
                       type, q, comm_, stream_);
        }
        sent += s;
        received += v;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  void barrier() override {
    // A one-element all-reduce, waited on by the host: NCCL has no barrier of its own.
    at::Tensor one = at::ones({1}, at::TensorOptions().device(device_).dtype(at::kFloat));
    all_reduce(one, ReduceOp::kSum)->synchronize();
  }

  // Throws the watchdog's error, if any.
  void check_healthy() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_.empty()) throw DistributedError(error_);
  }

  void raise_if_failed() override { check_healthy(); }

  std::vector<CollectiveTime> take_timeline() override {
    std::vector<CollectiveTime> out;
    for (const std::shared_ptr<Timed>& t : timeline_) {
      ZT_CUDA_CHECK(cudaEventSynchronize(t->done->handle));
      CollectiveTime c;
      c.op = t->op;
      c.bytes = t->bytes;
      float ms = 0;
      ZT_CUDA_CHECK(cudaEventElapsedTime(&ms, t->start->handle, t->done->handle));
      c.in_flight_ms = ms;
      if (t->arrival) {
        ZT_CUDA_CHECK(cudaEventSynchronize(t->arrival->handle));
        ZT_CUDA_CHECK(cudaEventElapsedTime(&ms, t->arrival->handle, t->done->handle));
        c.exposed_ms = std::max(0.0f, ms);
      } else {
        c.exposed_ms = t->host_wait_ms;
      }
      out.push_back(std::move(c));
    }
    timeline_.clear();
    return out;
  }

  void stream_wait(const std::shared_ptr<Event>& done, Timed* timed) {
    check_healthy();
    const cudaStream_t waiting = cuda_glue::current_stream(index_);
    if (timed != nullptr && !timed->waited) {
      timed->waited = true;
      timed->arrival = std::make_shared<Event>(true);
      ZT_CUDA_CHECK(cudaEventRecord(timed->arrival->handle, waiting));
    }
    ZT_CUDA_CHECK(cudaStreamWaitEvent(waiting, done->handle, 0));
  }

  void host_wait(const std::shared_ptr<Event>& done) {
    for (;;) {
      cudaError_t e = cudaEventQuery(done->handle);
      // An aborted collective completes too, with undefined results: say why instead.
      if (e == cudaSuccess) return check_healthy();
      if (e != cudaErrorNotReady) cuda::throw_error(e, "cudaEventQuery", __FILE__, __LINE__);
      check_healthy();  // the watchdog turns timeouts and dead peers into an error
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  struct Pending {
    std::shared_ptr<Event> done;
    Held keep_alive;
    std::chrono::steady_clock::time_point started;
    std::string what;
  };

  template <typename Launch>
  WorkHandle launch(const char* op, std::vector<at::Tensor> tensors, Launch&& nccl_call) {
    check_healthy();
    std::string what = fmt::format("nccl {} #{} on rank {} of {}", op, ++sequence_, rank_, world_);
    // The communication stream must see every kernel that wrote the inputs: an event on the
    // compute stream, waited on by the communication stream (no host sync).
    auto ready = std::make_shared<Event>();
    ZT_CUDA_CHECK(cudaEventRecord(ready->handle, cuda_glue::current_stream(index_)));
    ZT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready->handle, 0));
    std::shared_ptr<Timed> timed;
    if (timeline_on_) {
      timed = std::make_shared<Timed>();
      timed->op = op;
      for (const at::Tensor& t : tensors)
        timed->bytes = std::max(timed->bytes, static_cast<int64_t>(t.nbytes()));
      timed->start = std::make_shared<Event>(true);
      ZT_CUDA_CHECK(cudaEventRecord(timed->start->handle, stream_));
      timeline_.push_back(timed);
    }
    if (const ncclResult_t r = nccl_call(); r != ncclSuccess && r != ncclInProgress) {
      // A peer's failure can surface here, at the next enqueue, before the watchdog saw it:
      // the same diagnosis and abort as the watchdog's.
      const char* detail = ncclGetLastError(comm_);
      std::unique_lock<std::mutex> lock(mutex_);
      if (error_.empty()) {
        fail(lock,
             fmt::format("{}: NCCL error '{}'{}{} (NCCL {})", what, ncclGetErrorString(r),
                         detail && *detail ? ": " : "", detail ? detail : "", nccl_version()));
      }
      throw DistributedError(error_);
    }
    auto done = std::make_shared<Event>(timeline_on_);
    ZT_CUDA_CHECK(cudaEventRecord(done->handle, stream_));
    if (timed) timed->done = done;
    auto held = std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(Pending{done, held, std::chrono::steady_clock::now(), what});
    }
    wake_.notify_all();
    return std::make_unique<NcclWork>(this, done, std::move(held), std::move(timed));
  }

  // Called by the watchdog with `lock` (on mutex_) held: asks the store which rank failed or
  // stopped answering (a few heartbeats, without the lock), then aborts, so that kernels
  // waiting for a dead peer exit and every later call throws the error.
  // The first caller (the watchdog, or launch() when NCCL refuses an enqueue) diagnoses and
  // aborts; a second one waits for its error.
  void fail(std::unique_lock<std::mutex>& lock, const std::string& message) {
    if (failing_) {
      wake_.wait(lock, [&] { return !error_.empty(); });
      return;
    }
    failing_ = true;
    lock.unlock();
    const std::string said = with_diagnosis(message);
    lock.lock();
    error_ = said;
    log::error("{}", said);
    ncclCommAbort(comm_);
    aborted_ = true;
    pending_.clear();
    wake_.notify_all();
  }

  void watch() {
    cudaSetDevice(index_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      if (pending_.empty() || aborted_ || failing_) {
        wake_.wait_for(lock, std::chrono::milliseconds(100));
        continue;
      }
      // Completed ops release their tensors in issue order.
      cudaError_t query = cudaSuccess;
      while (!pending_.empty()) {
        query = cudaEventQuery(pending_.front().done->handle);
        if (query != cudaSuccess) break;
        pending_.pop_front();
      }
      if (query != cudaSuccess && query != cudaErrorNotReady) {
        fail(lock, fmt::format("{}: CUDA error '{}' while waiting for it", pending_.front().what,
                               cudaGetErrorString(query)));
        continue;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        fail(lock, fmt::format(
                       "rank {}: NCCL reported an asynchronous error '{}': {} — a peer may have "
                       "died; the communicator was aborted (NCCL {})",
                       rank_, ncclGetErrorString(async), ncclGetLastError(comm_), nccl_version()));
        continue;
      }
      if (!pending_.empty() &&
          std::chrono::steady_clock::now() - pending_.front().started > timeout_) {
        fail(lock,
             fmt::format("{} did not finish within the {} s timeout (ddp_timeout) — a peer is "
                         "stuck or dead; the communicator was aborted",
                         pending_.front().what,
                         std::chrono::duration_cast<std::chrono::seconds>(timeout_).count()));
        continue;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      lock.lock();
    }
  }

  int rank_;
  int world_;
  at::Device device_;
  int index_ = 0;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int64_t sequence_ = 0;
  bool timeline_on_ = false;
  std::vector<std::shared_ptr<Timed>> timeline_;  // since the last take_timeline()

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::string error_;
  bool aborted_ = false;
  bool failing_ = false;  // fail() is under way
  bool stopping_ = false;
  std::thread watchdog_;
};

void NcclWork::wait() {
  owner_->stream_wait(done_, timed_.get());
  // The caller's stream now waits for the collective: its tensors may go back to the caching
  // allocator (as c10d's TORCH_NCCL_AVOID_RECORD_STREAMS does). Held until completion instead,
  // every unit a host running ahead of the GPU gathered would stay allocated.
  if (held_) held_->clear();
}

void NcclWork::synchronize() {
  const auto start = std::chrono::steady_clock::now();
  owner_->host_wait(done_);
  if (timed_ && !timed_->waited) {
    timed_->waited = true;
    timed_->host_wait_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  }
  if (held_) held_->clear();
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const LaunchEnv& env,
                                                     const CommOptions& options,
                                                     std::shared_ptr<PeerWatch> peers) {
  return std::make_unique<NcclCommunicator>(store, env, options, std::move(peers));
}

}  // namespace zt::comm
