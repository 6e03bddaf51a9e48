#include "support/ranks.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <fmt/format.h>
#include "support/catch.hpp"
#include "util/files.hpp"

namespace zt::test {

namespace {

// The folders this process made. Never destroyed: remove_temp_dirs() empties it.
std::vector<std::string>& made_dirs() {
  static auto* made = new std::vector<std::string>();
  return *made;
}

}  // namespace

std::string temp_dir(const std::string& tag) {
  static int counter = 0;
  auto dir = std::filesystem::temp_directory_path() /
             fmt::format("zt-{}-{}-{}", tag, static_cast<long>(::getpid()), ++counter);
  files::remove_tree(dir.string());
  std::filesystem::create_directories(dir);
  made_dirs().push_back(dir.string());
  return dir.string();
}

void remove_temp_dirs() {
  const char* keep = std::getenv("ZT_KEEP_TEST_DIRS");
  if (keep && std::string(keep) == "1") return;
  for (const std::string& dir : made_dirs()) {
    try {
      files::remove_tree(dir);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  made_dirs().clear();
}

std::string RankRun::report() const {
  std::string out = result.summary();
  for (size_t r = 0; r < logs.size(); ++r) {
    out += fmt::format("\n----- rank {} output -----\n{}", r, logs[r]);
  }
  return out;
}

RankRun launch_ranks(int world, const std::string& name, std::chrono::seconds timeout, Env env,
                     std::chrono::seconds grace, bool one_node_per_rank) {
  char exe[4096] = {0};
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  REQUIRE(n > 0);
  LocalLaunchOptions o;
  o.nproc = world;
  o.timeout = timeout;
  o.grace = grace;
  o.one_node_per_rank = one_node_per_rank;
  o.output_dir = temp_dir("ranks");
  o.env = std::move(env);
  o.env.emplace_back("OMP_NUM_THREADS", "1");
  RankRun run;
  run.result = launch_local({exe, name}, o);
  for (const RankExit& r : run.result.ranks) {
    std::ifstream in(r.log_path);
    std::stringstream ss;
    ss << in.rdbuf();
    run.logs.push_back(ss.str());
  }
  return run;
}

void run_ranks(int world, const std::string& name, std::chrono::seconds timeout, Env env,
               bool one_node_per_rank) {
  INFO("world size " << world << ", test '" << name << "'"
                     << (one_node_per_rank ? ", one node per rank" : ""));
  RankRun run = launch_ranks(world, name, timeout, std::move(env), std::chrono::seconds(30),
                             one_node_per_rank);
  INFO(run.report());
  REQUIRE(run.result.ok());
}

void check_last_rank_died(const RankRun& run, int code) {
  INFO(run.report());
  CHECK_FALSE(run.result.timed_out);
  const size_t last = run.result.ranks.size() - 1;
  for (size_t r = 0; r < last; ++r) {
    CHECK(run.result.ranks[r].exit_code == 0);
    CHECK_FALSE(run.result.ranks[r].killed_by_launcher);
  }
  CHECK(run.result.ranks[last].exit_code == code);
}

bool gpu_ranks_share_a_gpu(int world) {
  return static_cast<int>(at::getNumGPUs()) < world;
}

bool skip_cpu_world(int world) {
  if (world <= 1 || backend_available(Backend::kGloo)) return false;
  WARN("skipped: " << world << " CPU ranks need the Gloo backend, which this build lacks");
  return true;
}

std::unique_ptr<Communicator> join(Backend backend, at::Device device) {
  CommOptions o;
  o.backend = backend;
  o.device = device;
  const char* t = std::getenv("ZT_TEST_TIMEOUT_MS");
  const char* r = std::getenv("ZT_TEST_RDZV_MS");
  o.timeout = std::chrono::milliseconds(t ? std::atol(t) : 60000);
  o.rendezvous_timeout = std::chrono::milliseconds(r ? std::atol(r) : 30000);
  return create_communicator(launch_env_from_environment(), o);
}

void write_curves(int rank, const std::vector<std::vector<double>>& curves) {
  if (rank != 0) return;
  std::ofstream out(std::getenv("ZT_CURVES"));
  for (const auto& c : curves) {
    for (double v : c) out << fmt::format("{:.17g} ", v);
    out << "\n";
  }
}

std::vector<std::vector<double>> curves_at_world(int world, const std::string& name,
                                                 std::chrono::seconds timeout) {
  const std::string path = temp_dir("curves") + "/curves.txt";
  run_ranks(world, name, timeout, {{"ZT_CURVES", path}});
  std::ifstream in(path);
  std::vector<std::vector<double>> curves;
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    curves.emplace_back();
    for (double v; words >> v;) curves.back().push_back(v);
  }
  return curves;
}

bool check_degree_sweep(const DegreeSweep& sweep, double epsilon,
                        const std::function<void(int world, int degree, size_t kind)>& after) {
  for (const auto& [world, degree] : sweep.settings) {
    if (skip_cpu_world(world)) return false;
    setenv(sweep.degree_env.c_str(), std::to_string(degree).c_str(), 1);
    for (size_t k = 0; k < sweep.kinds.size(); ++k) {
      INFO("world " << world << ", " << sweep.degree_label << " " << degree << ", run "
                    << sweep.kinds[k]);
      setenv(sweep.case_env.c_str(), sweep.kinds[k].c_str(), 1);
      const std::vector<std::vector<double>> curves =
          curves_at_world(world, sweep.name, std::chrono::seconds(300));
      REQUIRE(curves.size() == 1);
      REQUIRE(curves[0].size() == sweep.reference[k].size());
      for (size_t i = 0; i < curves[0].size(); ++i) {
        CHECK(curves[0][i] == Approx(sweep.reference[k][i]).epsilon(epsilon));
      }
      if (after) after(world, degree, k);
    }
  }
  return true;
}

}  // namespace zt::test
