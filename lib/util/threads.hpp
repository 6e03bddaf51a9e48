// How many threads host-side work of a training step may use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>

namespace zt {

/// Threads for host work the GPUs wait on — the offloaded optimizer step, random weights:
/// ZT_CPU_THREADS when set (≥ 1); otherwise the cores this process may run on (its affinity
/// mask) shared among the ranks on this machine (LOCAL_WORLD_SIZE, or Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE), and never fewer than LibTorch's intra-op thread count.
/// Launchers such as torchrun set OMP_NUM_THREADS=1 to keep ranks' compute threads apart; this
/// work would then run on one core of many (DeepSpeed's CPU Adam has that problem).
/// Thread-safe; reads the environment on every call.
int cpu_worker_threads();

/// Runs fn(lo, hi) over [0, n) cut into min(threads, n) contiguous ranges and returns when all
/// are done: the first range on the caller, range i + 1 always on worker i of a process-wide
/// pool of parked threads (started on first use, added to when a call wants more, never
/// stopped), so that calls made over and over — the offloaded optimizer's per-bucket updates —
/// pay no thread start-up, and a range of memory is worked on by the thread that worked on it
/// before (OpenMP's static schedule does the same). (In a library built without
/// -fopenmp, LibTorch's at::parallel_for runs on one thread.) Calls from several threads share
/// the pool one at a time; a call made from inside fn runs its ranges on its own thread; a
/// process forked from one that had a pool gets a pool of its own. fn must not throw: an
/// exception leaving a worker ends the process.
void run_ranges(int64_t n, int64_t threads, const std::function<void(int64_t, int64_t)>& fn);

template <typename Fn>
void parallel_ranges(int64_t n, int64_t threads, Fn&& fn) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    fn(int64_t{0}, n);
    return;
  }
  run_ranges(n, threads, std::function<void(int64_t, int64_t)>(std::forward<Fn>(fn)));
}

}  // namespace zt
