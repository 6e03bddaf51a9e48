// How many threads host-side work of a training step may use.
#pragma once

namespace zt {

/// Threads for host work the GPUs wait on — the offloaded optimizer step, random weights:
/// ZT_CPU_THREADS when set (≥ 1); otherwise the cores this process may run on (its affinity
/// mask) shared among the ranks on this machine (LOCAL_WORLD_SIZE, or Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE), and never fewer than LibTorch's intra-op thread count.
/// Launchers such as torchrun set OMP_NUM_THREADS=1 to keep ranks' compute threads apart; this
/// work would then run on one core of many (DeepSpeed's CPU Adam has that problem).
/// Thread-safe; reads the environment on every call.
int cpu_worker_threads();

}  // namespace zt
