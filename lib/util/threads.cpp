#include "util/threads.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

namespace zt {
namespace {

int positive_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && n > 0 && n < 1 << 16 ? static_cast<int>(n) : 0;
}

// The workers of run_ranges, one job at a time. Ranges are dealt statically, as OpenMP's
// static schedule does: the caller runs range 0 and worker i always runs range i + 1, so
// memory a call's range first touched is used by the same thread in later calls over the same
// split (on a machine of several NUMA nodes, local to it). The caller publishes the job under
// `m_`, wakes the workers and waits until each worker with a range has run it; no worker can
// see a finished job, because the next is published only after every assigned one is done.
class RangePool {
 public:
  void run(int64_t n, int64_t parts, const std::function<void(int64_t, int64_t)>& fn) {
    std::lock_guard<std::mutex> one_job(submit_);
    grow(parts - 1);
    Job job{&fn, n, parts, (n + parts - 1) / parts};
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      unfinished_ = parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    in_job = true;
    fn(0, std::min(n, job.per));
    in_job = false;
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [&] { return unfinished_ == 0; });
    job_ = nullptr;
  }

  static thread_local bool in_job;  ///< this thread runs a range (nested calls run inline)

 private:
  struct Job {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, parts, per;
  };

  void grow(int64_t wanted) {
    while (static_cast<int64_t>(workers_) < wanted) {
      const int64_t range = static_cast<int64_t>(workers_) + 1;
      std::thread([this, range] { work(range); }).detach();  // parked between jobs
      ++workers_;
    }
  }

  void work(int64_t range) {
    in_job = true;
    uint64_t seen = 0;
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (job_ == nullptr || range >= job_->parts) continue;  // no range for this worker
        job = job_;
      }
      const int64_t lo = std::min(job->n, range * job->per),
                    hi = std::min(job->n, (range + 1) * job->per);
      if (lo < hi) (*job->fn)(lo, hi);
      std::lock_guard<std::mutex> lock(m_);
      if (--unfinished_ == 0) done_.notify_all();
    }
  }

  std::mutex submit_, m_;
  std::condition_variable wake_, done_;
  size_t workers_ = 0;
  uint64_t generation_ = 0;
  Job* job_ = nullptr;
  int64_t unfinished_ = 0;
};

thread_local bool RangePool::in_job = false;

// Never destroyed: its workers never stop. A process forked from one that had a pool has
// none of the parent's workers (fork copies only the calling thread), so its child handler
// starts an empty pool for it; the parent's copy is left unused.
std::atomic<RangePool*> the_pool{nullptr};

void fresh_pool_after_fork() {
  the_pool.store(new RangePool());
}

RangePool& range_pool() {
  static const bool once = [] {
    the_pool.store(new RangePool());
    ::pthread_atfork(nullptr, nullptr, fresh_pool_after_fork);
    return true;
  }();
  (void)once;
  return *the_pool.load();
}

}  // namespace

void run_ranges(int64_t n, int64_t threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t parts = std::max<int64_t>(1, std::min(threads, n));
  if (parts == 1 || RangePool::in_job) {
    const int64_t per = (n + parts - 1) / parts;
    for (int64_t lo = 0; lo < n; lo += per) fn(lo, std::min(n, lo + per));
    return;
  }
  range_pool().run(n, parts, fn);
}

int cpu_worker_threads() {
  if (int n = positive_env("ZT_CPU_THREADS")) return n;
  int cores = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = std::max(1, CPU_COUNT(&set));
  int local = positive_env("LOCAL_WORLD_SIZE");
  if (local == 0) local = positive_env("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local == 0) local = 1;
  return std::max(at::get_num_threads(), std::max(1, cores / local));
}

}  // namespace zt
