// Multi-rank tests: a visible test case runs a hidden one ("rank: ...") as N processes of this
// test binary with torchrun's variables, and fails with every rank's output if any rank fails.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/comm.hpp"
#include "zerotrain/launch.hpp"

namespace zt::test {

using Env = std::vector<std::pair<std::string, std::string>>;

/// Runs the hidden test `name` as `world` ranks and returns how they ended, with their logs.
struct RankRun {
  LaunchResult result;
  std::vector<std::string> logs;  ///< per rank
  std::string report() const;     ///< summary + every rank's log
};
/// With `one_node_per_rank`, each rank plays a node of its own (zt::emulated_node_env): several
/// ranks on one GPU over real NCCL.
RankRun launch_ranks(int world, const std::string& name,
                     std::chrono::seconds timeout = std::chrono::seconds(180), Env env = {},
                     std::chrono::seconds grace = std::chrono::seconds(30),
                     bool one_node_per_rank = false);

/// Checks (Catch CHECKs, the report as context) a run whose last rank exited with `code` on
/// purpose mid-run: no timeout, and every other rank exited 0 by itself, not by the launcher's
/// kill (the hidden tests exit 0 once they caught the error they expect).
void check_last_rank_died(const RankRun& run, int code);

/// launch_ranks + REQUIRE that every rank passed (the report is the failure message).
void run_ranks(int world, const std::string& name,
               std::chrono::seconds timeout = std::chrono::seconds(180), Env env = {},
               bool one_node_per_rank = false);

/// Loss curves of a rank test, one per setting it runs: rank 0 writes them with write_curves to
/// the file ZT_CURVES names, and curves_at_world runs the test at `world` ranks (run_ranks) and
/// reads them back.
void write_curves(int rank, const std::vector<std::vector<double>>& curves);
std::vector<std::vector<double>> curves_at_world(int world, const std::string& name,
                                                 std::chrono::seconds timeout);

/// A sweep of a parallel degree against world 1: for each (world, degree) of `settings` and each
/// run kind k, sets the environment variables `degree_env` = degree and `case_env` = kinds[k],
/// runs the rank test `name` at `world` (curves_at_world, 300 s) and CHECKs its one curve
/// against reference[k], point by point, to relative `epsilon`; then calls `after(world, degree,
/// k)` when given. Returns false (the caller's test ends there) when a world cannot run in this
/// build (skip_cpu_world).
struct DegreeSweep {
  std::string name, degree_env, case_env, degree_label;
  std::vector<std::pair<int, int>> settings;
  std::vector<std::string> kinds;
  std::vector<std::vector<double>> reference;
};
bool check_degree_sweep(const DegreeSweep& sweep, double epsilon = 1e-5,
                        const std::function<void(int world, int degree, size_t kind)>& after = {});

/// Whether `world` GPU ranks must play nodes of their own: fewer GPUs are visible than ranks
/// (then they all share GPU 0, as LOCAL_RANK 0 of their emulated nodes).
bool gpu_ranks_share_a_gpu(int world);

/// True (with a Catch warning) when `world` CPU ranks cannot run in this build: more than one
/// rank needs the Gloo backend, which LibTorch builds without Gloo headers (the GPU machine's
/// wheel) lack. CPU multi-rank tests return early then; CI always has Gloo.
bool skip_cpu_world(int world);

/// Inside a rank: joins the job from the environment with short test timeouts (collectives
/// 60 s, rendezvous 30 s, unless ZT_TEST_TIMEOUT_MS / ZT_TEST_RDZV_MS say otherwise).
std::unique_ptr<Communicator> join(Backend backend = Backend::kAuto, at::Device device = at::kCPU);

/// A fresh empty folder under the system temp dir, removed by remove_temp_dirs() when the
/// test program ends (ZT_KEEP_TEST_DIRS=1 keeps it for a post-mortem).
std::string temp_dir(const std::string& tag);

/// Removes the folders temp_dir() made in this process; the tests' main() calls it after the
/// session.
void remove_temp_dirs();

}  // namespace zt::test
