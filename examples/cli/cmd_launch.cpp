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

// The launcher outlives its ranks and passes on what it is sent (a scheduler's SIGTERM, the
// terminal's SIGINT) to them alone: they run in a process group of their own, so the caller
// and its other children are never touched. The launcher then exits with the status its ranks
// ended with (128 + the signal for one that a signal ended).
volatile std::sig_atomic_t g_signal = 0;
extern "C" void forward_signal(int sig) {
  g_signal = sig;
  signal_ranks(sig);
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
  // Help only among the launcher's own options: a --help after the command is the command's.
  bool help = false;
  for (size_t k = 0; k < args.size() && args[k] != "--" && args[k].rfind("-", 0) == 0; ++k) {
    help = help || args[k] == "--help" || args[k] == "-h";
    if (args[k].find('=') == std::string::npos && args[k] != "--help" && args[k] != "-h")
      ++k;  // its value
  }
  if (help) {
    std::fputs(
        "usage: zerotrain launch [--nproc_per_node N] [--master_addr A] [--master_port P] [--] "
        "PROGRAM ARGS...\n\n"
        "Starts N local ranks of PROGRAM with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,\n"
        "MASTER_ADDR, MASTER_PORT), waits for them and exits with the first failing rank's "
        "status.\n"
        "  --nproc_per_node N  ranks on this machine [default: 1]\n"
        "  --master_addr A     the rendezvous address [default: 127.0.0.1]\n"
        "  --master_port P     the rendezvous port [default: a free one]\n",
        stdout);
    return 0;
  }
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
  action.sa_handler = forward_signal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}) sigaction(sig, &action, nullptr);
  LaunchResult r = launch_local(command, o);
  if (r.ok()) return g_signal != 0 ? 128 + g_signal : 0;
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
