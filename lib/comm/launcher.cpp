// launch_local: N ranks as child processes, torchrun-style, killed together on failure.
#include "zerotrain/launch.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

extern char** environ;

namespace zt {

namespace {

// The running launch's process group (the first rank's pid), 0 when none: read by signal_ranks
// from signal handlers.
std::atomic<pid_t> g_rank_group{0};

}  // namespace

void signal_ranks(int sig) {
  const pid_t group = g_rank_group.load();
  if (group > 0) ::kill(-group, sig);
}

int pick_free_port(const std::string& addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw DistributedError(fmt::format("socket(): {}", std::strerror(errno)));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1)
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    int err = errno;
    ::close(fd);
    throw DistributedError(
        fmt::format("cannot bind a free port on {}: {}", addr, std::strerror(err)));
  }
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

std::vector<std::pair<std::string, std::string>> emulated_node_env(int rank) {
  return {{"LOCAL_RANK", "0"},
          {"LOCAL_WORLD_SIZE", "1"},
          {"GROUP_RANK", std::to_string(rank)},
          {"NCCL_HOSTID", fmt::format("zt-node-{}", rank)},
          {"NCCL_P2P_DISABLE", "1"},
          {"NCCL_SHM_DISABLE", "1"},
          {"NCCL_SOCKET_IFNAME", "lo"}};
}

std::string LaunchResult::summary() const {
  std::string out;
  for (const RankExit& r : ranks) {
    if (!out.empty()) out += "\n";
    if (r.signal != 0) {
      out += fmt::format("rank {}: killed by signal {}{}", r.rank, r.signal,
                         r.killed_by_launcher ? " (by the launcher)" : "");
    } else {
      out += fmt::format("rank {}: exit {}", r.rank, r.exit_code);
    }
  }
  if (timed_out) out += "\n(the launch timed out)";
  return out;
}

namespace {

// The environment every rank inherits: this process's, without the launcher's own variables
// (and those `options.env` sets), plus `options.env`.
std::vector<std::string> inherited_environment(const LocalLaunchOptions& options) {
  static const char* kOwned[] = {
      "RANK=",        "LOCAL_RANK=",  "WORLD_SIZE=", "LOCAL_WORLD_SIZE=",
      "MASTER_ADDR=", "MASTER_PORT=", "GROUP_RANK=", "TORCHELASTIC_USE_AGENT_STORE="};
  std::vector<std::string> base_env;
  for (char** e = environ; *e != nullptr; ++e) {
    bool owned = false;
    for (const char* k : kOwned) owned = owned || std::strncmp(*e, k, std::strlen(k)) == 0;
    for (const auto& kv : options.env) {
      owned = owned || std::strncmp(*e, (kv.first + "=").c_str(), kv.first.size() + 1) == 0;
    }
    if (options.one_node_per_rank) {
      for (const auto& kv : emulated_node_env(0)) {
        owned = owned || std::strncmp(*e, (kv.first + "=").c_str(), kv.first.size() + 1) == 0;
      }
    }
    if (!owned) base_env.emplace_back(*e);
  }
  for (const auto& kv : options.env) base_env.push_back(kv.first + "=" + kv.second);
  return base_env;
}

void kill_started(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    if (p > 0) ::kill(p, SIGKILL);
  }
}

// Forks and executes every rank into one process group (the first rank's pid). Everything a
// child needs is built before fork(): only async-signal-safe calls after it.
std::vector<pid_t> start_ranks(const std::vector<std::string>& command,
                               const LocalLaunchOptions& options, int port,
                               const LaunchResult& result) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::vector<std::string> base_env = inherited_environment(options);
  std::vector<std::vector<std::string>> env_strings(static_cast<size_t>(options.nproc));
  std::vector<std::vector<char*>> envps(static_cast<size_t>(options.nproc));
  for (int r = 0; r < options.nproc; ++r) {
    auto& es = env_strings[static_cast<size_t>(r)];
    es = base_env;
    es.push_back(fmt::format("RANK={}", r));
    es.push_back(fmt::format("WORLD_SIZE={}", options.nproc));
    es.push_back(fmt::format("MASTER_ADDR={}", options.master_addr));
    es.push_back(fmt::format("MASTER_PORT={}", port));
    if (options.one_node_per_rank) {
      // The launcher's own values of these names were dropped by inherited_environment; one
      // that options.env sets comes first and wins (getenv takes the first).
      for (const auto& [k, v] : emulated_node_env(r)) es.push_back(k + "=" + v);
    } else {
      es.push_back(fmt::format("LOCAL_RANK={}", r));
      es.push_back(fmt::format("GROUP_RANK=0"));
      es.push_back(fmt::format("LOCAL_WORLD_SIZE={}", options.nproc));
    }
    for (std::string& s : es) envps[static_cast<size_t>(r)].push_back(s.data());
    envps[static_cast<size_t>(r)].push_back(nullptr);
  }

  // Made before fork(): only async-signal-safe calls in the child.
  const std::string cannot_exec = fmt::format(
      "zerotrain launch: cannot execute '{}': not found on PATH or not executable; check the "
      "program's name after --\n",
      command[0]);
  std::vector<pid_t> pids(static_cast<size_t>(options.nproc), -1);
  const pid_t parent = ::getpid();
  pid_t group = 0;
  for (int r = 0; r < options.nproc; ++r) {
    int log_fd = -1;
    if (!options.output_dir.empty()) {
      const std::string& path = result.ranks[static_cast<size_t>(r)].log_path;
      log_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (log_fd < 0) {
        kill_started(pids);
        throw InvalidArgument(fmt::format("cannot create '{}': {}", path, std::strerror(errno)));
      }
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, group);  // both sides set it, so no signal can come before it holds
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(125);
      if (log_fd >= 0) {
        ::dup2(log_fd, 1);
        ::dup2(log_fd, 2);
      }
      ::execvpe(argv[0], argv.data(), envps[static_cast<size_t>(r)].data());
      ssize_t ignored = ::write(2, cannot_exec.data(), cannot_exec.size());
      (void)ignored;
      ::_exit(127);
    }
    if (log_fd >= 0) ::close(log_fd);
    if (pid < 0) {
      kill_started(pids);
      throw InvalidArgument(fmt::format("fork() failed: {}", std::strerror(errno)));
    }
    ::setpgid(pid, group);
    if (group == 0) {
      group = pid;
      g_rank_group.store(group);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  return pids;
}

// Waits for every rank; after the first failure the others get `options.grace`, then SIGKILL
// (as on timeout).
void supervise(std::vector<pid_t>& pids, const LocalLaunchOptions& options, LaunchResult& result) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  Clock::time_point kill_at = Clock::time_point::max();  // after the first failure + grace
  int running = options.nproc;
  while (running > 0) {
    for (int r = 0; r < options.nproc; ++r) {
      pid_t& pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      pid_t got = ::waitpid(pid, &status, WNOHANG);
      if (got == 0) continue;
      RankExit& x = result.ranks[static_cast<size_t>(r)];
      if (got < 0) {
        x.exit_code = -1;
      } else if (WIFEXITED(status)) {
        x.exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        x.signal = WTERMSIG(status);
      }
      pid = -1;
      --running;
      bool failed = x.exit_code != 0 || x.signal != 0;
      if (failed && result.first_failed_rank < 0 && !x.killed_by_launcher) {
        result.first_failed_rank = r;
        kill_at = Clock::now() + options.grace;
      }
    }
    auto now = Clock::now();
    bool timeout = options.timeout.count() > 0 && now - start > options.timeout;
    if (timeout) result.timed_out = true;
    if (timeout || now >= kill_at) {
      for (int r = 0; r < options.nproc; ++r) {
        if (pids[static_cast<size_t>(r)] > 0) {
          ::kill(pids[static_cast<size_t>(r)], SIGKILL);
          result.ranks[static_cast<size_t>(r)].killed_by_launcher = true;
        }
      }
      kill_at = Clock::time_point::max();
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

LaunchResult launch_local(const std::vector<std::string>& command,
                          const LocalLaunchOptions& options) {
  if (command.empty()) throw InvalidArgument("launch_local: empty command");
  if (options.nproc < 1) throw InvalidArgument("launch_local: nproc must be at least 1");
  const int port =
      options.master_port > 0 ? options.master_port : pick_free_port(options.master_addr);
  LaunchResult result;
  for (int r = 0; r < options.nproc; ++r) {
    RankExit x;
    x.rank = r;
    if (!options.output_dir.empty()) {
      x.log_path = fmt::format("{}/rank{}.log", options.output_dir, r);
    }
    result.ranks.push_back(x);
  }
  std::vector<pid_t> pids = start_ranks(command, options, port, result);
  struct ClearGroup {
    ~ClearGroup() { g_rank_group.store(0); }
  } clear_group;
  supervise(pids, options, result);
  return result;
}

}  // namespace zt
