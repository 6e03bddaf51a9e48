// Launcher variables (torchrun / mpirun / srun) and the local multi-process launcher.
#include "support/catch.hpp"

#include <fstream>
#include <map>
#include <sstream>

#include "support/ranks.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/launch.hpp"

using namespace zt;
using Catch::Contains;

namespace {

std::function<const char*(const char*)> env_of(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("torchrun variables", "[launch]") {
  LaunchEnv e = launch_env_from_environment(env_of({{"RANK", "3"},
                                                    {"WORLD_SIZE", "8"},
                                                    {"LOCAL_RANK", "1"},
                                                    {"LOCAL_WORLD_SIZE", "2"},
                                                    {"MASTER_ADDR", "10.0.0.1"},
                                                    {"MASTER_PORT", "29555"},
                                                    {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  CHECK(e.origin == "torchrun");
  CHECK(e.rank == 3);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.master_addr == "10.0.0.1");
  CHECK(e.master_port == 29555);
  CHECK(e.agent_store);
}

TEST_CASE("no launcher: one process", "[launch]") {
  LaunchEnv e = launch_env_from_environment(env_of({}));
  CHECK(e.origin == "single");
  CHECK(e.world_size == 1);
  CHECK(e.rank == 0);
}

TEST_CASE("Open MPI variables need MASTER_ADDR and MASTER_PORT", "[launch]") {
  LaunchEnv e = launch_env_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                                    {"MASTER_ADDR", "h0"},
                                                    {"MASTER_PORT", "1234"}}));
  CHECK(e.origin == "openmpi");
  CHECK(e.rank == 2);
  CHECK(e.world_size == 4);
  CHECK(e.master_addr == "h0");
  CHECK(e.master_port == 1234);
  CHECK_THROWS_WITH(
      launch_env_from_environment(env_of(
          {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h0"}})),
      Contains("MASTER_PORT"));
  CHECK_THROWS_WITH(launch_env_from_environment(
                        env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
                    Contains("MASTER_ADDR"));
}

TEST_CASE("SLURM variables: address from the node list, port 29500", "[launch]") {
  LaunchEnv e = launch_env_from_environment(env_of({{"SLURM_PROCID", "5"},
                                                    {"SLURM_NTASKS", "8"},
                                                    {"SLURM_LOCALID", "1"},
                                                    {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"}}));
  CHECK(e.origin == "slurm");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.master_addr == "gpu07");
  CHECK(e.master_port == 29500);
  CHECK(first_slurm_host("node1,node2") == "node1");
  CHECK(first_slurm_host("a-[3-5]-ib") == "a-3-ib");
  CHECK(first_slurm_host("single") == "single");
  CHECK_THROWS_AS(first_slurm_host("bad[1-2"), ConfigError);
}

TEST_CASE("malformed launcher variables name the variable", "[launch][errors]") {
  CHECK_THROWS_WITH(launch_env_from_environment(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}})),
                    Contains("RANK") && Contains("\"x\""));
  CHECK_THROWS_WITH(
      launch_env_from_environment(
          env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})),
      Contains("RANK=2 is not below WORLD_SIZE=2"));
  CHECK_THROWS_WITH(launch_env_from_environment(
                        env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}})),
                    Contains("MASTER_ADDR"));
  CHECK_THROWS_WITH(
      launch_env_from_environment(env_of(
          {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})),
      Contains("MASTER_PORT"));
}

TEST_CASE("launch_local gives each rank torchrun's variables and its own log", "[launch]") {
  LocalLaunchOptions o;
  o.nproc = 3;
  o.output_dir = test::temp_dir("launch");
  o.env = {{"ZT_EXTRA", "x"}};
  LaunchResult r = launch_local(
      {"/bin/sh", "-c", "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$MASTER_ADDR/$MASTER_PORT/$ZT_EXTRA"},
      o);
  REQUIRE(r.ok());
  std::string port;
  for (int rank = 0; rank < 3; ++rank) {
    std::string line = slurp(r.ranks[static_cast<size_t>(rank)].log_path);
    CHECK_THAT(line, Contains(std::to_string(rank) + "/3/" + std::to_string(rank) + "/127.0.0.1/"));
    CHECK_THAT(line, Contains("/x"));
  }
}

TEST_CASE("launch_local kills the other ranks after one fails", "[launch]") {
  LocalLaunchOptions o;
  o.nproc = 3;
  o.grace = std::chrono::milliseconds(300);
  o.output_dir = test::temp_dir("launch");
  auto start = std::chrono::steady_clock::now();
  LaunchResult r =
      launch_local({"/bin/sh", "-c", "if [ $RANK = 1 ]; then exit 3; fi; exec sleep 60"}, o);
  auto took = std::chrono::steady_clock::now() - start;
  CHECK_FALSE(r.ok());
  CHECK(r.first_failed_rank == 1);
  CHECK(r.ranks[1].exit_code == 3);
  CHECK(r.ranks[0].killed_by_launcher);
  CHECK(r.ranks[2].killed_by_launcher);
  CHECK(took < std::chrono::seconds(20));
  CHECK_THAT(r.summary(), Contains("rank 1: exit 3"));
}

TEST_CASE("launch_local kills everything at its timeout", "[launch]") {
  LocalLaunchOptions o;
  o.nproc = 2;
  o.timeout = std::chrono::milliseconds(300);
  o.output_dir = test::temp_dir("launch");
  LaunchResult r = launch_local({"/bin/sh", "-c", "exec sleep 60"}, o);
  CHECK(r.timed_out);
  CHECK_FALSE(r.ok());
  CHECK(r.ranks[0].signal == 9);
}
