// zerotrain launch: N local ranks, as `torchrun --standalone --nproc_per_node N` would start.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include "commands.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/launch.hpp"
#include "zerotrain/log.hpp"

namespace zt::cli {

namespace {

// The launcher outlives its ranks: a signal sent to it alone (kill, a scheduler's SIGTERM) is
// passed on to the whole process group, the ranks included; one the terminal sent to the group
// already reached them and is not repeated (a second SIGINT would end a rank at once).
extern "C" void forward_signal(int sig, siginfo_t* info, void*) {
  if (info != nullptr && info->si_code == SI_USER && info->si_pid != ::getpid()) ::kill(0, sig);
}

int parse_int(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < 0 || v > 65535) {
    throw ConfigError("--" + flag + ": expected a non-negative integer, found \"" + value + "\"");
  }
  return static_cast<int>(v);
}

}  // namespace

int cmd_launch(const Args& args) {
  LocalLaunchOptions o;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;
    std::string name = a.substr(2), value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    } else {
      if (i + 1 >= args.size()) throw ConfigError("--" + name + " needs a value");
      value = args[++i];
    }
    if (name == "nproc_per_node" || name == "nproc-per-node") {
      o.nproc = parse_int(name, value);
    } else if (name == "master_port" || name == "master-port") {
      o.master_port = parse_int(name, value);
    } else if (name == "master_addr" || name == "master-addr") {
      o.master_addr = value;
    } else {
      throw ConfigError("zerotrain launch: unknown option --" + name +
                        " (known: --nproc_per_node, --master_addr, --master_port)");
    }
  }
  Args command(args.begin() + static_cast<long>(i), args.end());
  if (command.empty()) throw ConfigError("zerotrain launch: no command to run after the options");
  if (o.nproc < 1) throw ConfigError("--nproc_per_node must be at least 1");
  // The launcher waits for its ranks to exit rather than dying first (a handler, not SIG_IGN:
  // handlers do not survive exec into the ranks).
  struct sigaction action {};
  action.sa_sigaction = forward_signal;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  LaunchResult r = launch_local(command, o);
  if (r.ok()) return 0;
  log_message(LogLevel::kError, "zerotrain launch: the job failed\n" + r.summary());
  if (r.timed_out) return 124;
  // The first failing rank's own status (2 for a configuration error, 130 when cancelled...).
  for (const RankExit& e : r.ranks) {
    if (e.rank != r.first_failed_rank) continue;
    return e.exit_code > 0 ? e.exit_code : 128 + e.signal;
  }
  return 1;
}

}  // namespace zt::cli
