// Reading rank, world size and master address from torchrun / mpirun / srun variables.
#include <cstdlib>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "util/env.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

using Getenv = std::function<const char*(const char*)>;

int int_var(const Getenv& getenv, const char* name, int min, std::optional<int> fallback) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') {
    if (fallback) return *fallback;
    throw ConfigError(fmt::format("environment variable {} is not set", name));
  }
  return parse_env_int(name, v, min, std::numeric_limits<int>::max(), "an integer");
}

std::string string_var(const Getenv& getenv, const char* name, const std::string* fallback,
                       const char* why) {
  const char* v = getenv(name);
  if (v != nullptr && *v != '\0') return v;
  if (fallback) return *fallback;
  throw ConfigError(fmt::format("environment variable {} is not set; {}", name, why));
}

void check_ranks(const LaunchEnv& e, const char* rank_var, const char* size_var) {
  if (e.world_size < 1 || e.rank >= e.world_size) {
    throw ConfigError(
        fmt::format("{}={} is not below {}={}", rank_var, e.rank, size_var, e.world_size));
  }
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    char c = nodelist[end];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
  }
  std::string entry = nodelist.substr(0, end);
  size_t open = entry.find('[');
  if (open == std::string::npos) return entry;
  size_t close = entry.find(']', open);
  if (close == std::string::npos) {
    throw ConfigError(fmt::format("SLURM_JOB_NODELIST: unbalanced '[' in \"{}\"", nodelist));
  }
  std::string inside = entry.substr(open + 1, close - open - 1);
  size_t stop = inside.find_first_of(",-");
  return entry.substr(0, open) + inside.substr(0, stop) + entry.substr(close + 1);
}

LaunchEnv launch_env_from_environment(const Getenv& getenv_in) {
  Getenv getenv = getenv_in ? getenv_in : Getenv([](const char* n) { return std::getenv(n); });
  LaunchEnv e;
  auto master_port = [&](std::optional<int> fallback) {
    int port = int_var(getenv, "MASTER_PORT", 1, fallback);
    if (port > 65535) {
      throw ConfigError(
          fmt::format("environment variable MASTER_PORT: {} is not a TCP port", port));
    }
    return port;
  };
  if (getenv("RANK") != nullptr || getenv("WORLD_SIZE") != nullptr) {
    e.origin = "torchrun";
    e.rank = int_var(getenv, "RANK", 0, std::nullopt);
    e.world_size = int_var(getenv, "WORLD_SIZE", 1, std::nullopt);
    e.local_rank = int_var(getenv, "LOCAL_RANK", 0, e.rank);
    e.local_world_size = int_var(getenv, "LOCAL_WORLD_SIZE", 1, e.world_size);
    check_ranks(e, "RANK", "WORLD_SIZE");
    if (e.world_size > 1) {
      e.master_addr = string_var(getenv, "MASTER_ADDR", nullptr,
                                 "set it to the address of rank 0 (torchrun sets it)");
      e.master_port = master_port(std::nullopt);
    }
    const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store =
        agent != nullptr && (std::string_view(agent) == "True" ||
                             std::string_view(agent) == "true" || std::string_view(agent) == "1");
  } else if (getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    e.origin = "openmpi";
    e.rank = int_var(getenv, "OMPI_COMM_WORLD_RANK", 0, std::nullopt);
    e.world_size = int_var(getenv, "OMPI_COMM_WORLD_SIZE", 1, std::nullopt);
    e.local_rank = int_var(getenv, "OMPI_COMM_WORLD_LOCAL_RANK", 0, 0);
    e.local_world_size = int_var(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1);
    check_ranks(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    if (e.world_size > 1) {
      const char* why =
          "under mpirun set MASTER_ADDR and MASTER_PORT (e.g. mpirun -x MASTER_ADDR=host0 -x "
          "MASTER_PORT=29500)";
      e.master_addr = string_var(getenv, "MASTER_ADDR", nullptr, why);
      if (getenv("MASTER_PORT") == nullptr) {
        throw ConfigError(fmt::format("environment variable MASTER_PORT is not set; {}", why));
      }
      e.master_port = master_port(std::nullopt);
    }
  } else if (getenv("SLURM_PROCID") != nullptr) {
    e.origin = "slurm";
    e.rank = int_var(getenv, "SLURM_PROCID", 0, std::nullopt);
    e.world_size = int_var(getenv, "SLURM_NTASKS", 1, std::nullopt);
    e.local_rank = int_var(getenv, "SLURM_LOCALID", 0, 0);
    e.local_world_size = int_var(getenv, "SLURM_NTASKS_PER_NODE", 1, 1);
    check_ranks(e, "SLURM_PROCID", "SLURM_NTASKS");
    if (const char* addr = getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') {
      e.master_addr = addr;
    } else {
      const char* list = getenv("SLURM_JOB_NODELIST");
      if (list == nullptr) list = getenv("SLURM_NODELIST");
      if (list == nullptr && e.world_size > 1) {
        throw ConfigError("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; set MASTER_ADDR");
      }
      if (list != nullptr) e.master_addr = first_slurm_host(list);
    }
    e.master_port = master_port(29500);
  }
  return e;
}

}  // namespace zt
