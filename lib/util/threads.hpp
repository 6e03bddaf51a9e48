// How many threads host-side work of a training step may use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace zt {

/// Threads for host work the GPUs wait on — the offloaded optimizer step, random weights:
/// ZT_CPU_THREADS when set (≥ 1); otherwise the cores this process may run on (its affinity
/// mask) shared among the ranks on this machine (LOCAL_WORLD_SIZE, or Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE), and never fewer than LibTorch's intra-op thread count.
/// Launchers such as torchrun set OMP_NUM_THREADS=1 to keep ranks' compute threads apart; this
/// work would then run on one core of many (DeepSpeed's CPU Adam has that problem).
/// Thread-safe; reads the environment on every call.
int cpu_worker_threads();

/// Runs fn(lo, hi) over [0, n) cut into min(threads, n) contiguous ranges, each on its own
/// std::thread except the first, which runs on the caller; returns when all are done. (In a
/// library built without -fopenmp, LibTorch's at::parallel_for runs on one thread.) fn must not
/// throw: an exception leaving a std::thread ends the process.
template <typename Fn>
void parallel_ranges(int64_t n, int64_t threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t parts = std::max<int64_t>(1, std::min(threads, n));
  const int64_t per = (n + parts - 1) / parts;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < parts; ++t) {
    const int64_t lo = std::min(n, t * per), hi = std::min(n, (t + 1) * per);
    if (lo < hi) pool.emplace_back([&fn, lo, hi] { fn(lo, hi); });
  }
  fn(int64_t{0}, std::min(n, per));
  for (std::thread& th : pool) th.join();
}

}  // namespace zt
