// zerotrain launch: N local ranks, as `torchrun --standalone --nproc_per_node N` would start
// (or `deepspeed --num_gpus N` / `--include localhost:...` on one machine).
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

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

// This executable, for running its own commands as ranks.
std::string self_executable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw IoError("zerotrain launch: cannot find this program (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

int parse_int(const std::string& flag, const std::string& value) {
  return static_cast<int>(parse_integer(flag, value, 0, 65535));
}

bool parse_bool(const std::string& flag, const std::string& value) {
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  throw ConfigError("--" + flag + ": expected true or false, found \"" + value + "\"");
}

// DeepSpeed's --include for this machine: "localhost:0,2" (or this host's name) → the GPU ids.
// Several hosts ("a:0@b:1") are refused: zerotrain launch starts the ranks of one machine.
std::vector<int> included_devices(const std::string& value) {
  if (value.find('@') != std::string::npos) {
    throw ConfigError("--include " + value +
                      ": zerotrain launch starts the ranks of one machine; for several nodes "
                      "start one launcher per node (torchrun, srun and mpirun variables are read)");
  }
  const size_t colon = value.find(':');
  const std::string host = value.substr(0, colon);
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  if (host != "localhost" && host != "127.0.0.1" && host != name) {
    throw ConfigError("--include " + value + ": '" + host + "' is not this machine (" + name +
                      "); zerotrain launch starts local ranks only");
  }
  if (colon == std::string::npos || colon + 1 == value.size()) {
    throw ConfigError("--include " + value +
                      ": name the GPUs, as in localhost:0,1 (or use --num_gpus N)");
  }
  std::vector<int> ids;
  size_t at = colon + 1;
  while (at <= value.size()) {
    const size_t comma = std::min(value.find(',', at), value.size());
    const int id = parse_int("include", value.substr(at, comma - at));
    if (std::find(ids.begin(), ids.end(), id) != ids.end()) {
      throw ConfigError("--include " + value + ": GPU " + std::to_string(id) + " twice");
    }
    ids.push_back(id);
    at = comma + 1;
  }
  return ids;
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
        "  --master_port P     the rendezvous port [default: a free one]\n"
        "  --one_node_per_rank true   each rank plays a node of its own (several ranks on one\n"
        "                      GPU over real NCCL, through sockets on loopback; for tests)\n"
        "The deepspeed launcher's spelling is accepted too:\n"
        "  --num_gpus N        as --nproc_per_node\n"
        "  --include localhost:0,2   one rank per listed GPU (CUDA_VISIBLE_DEVICES is set to "
        "them)\n"
        "  --num_nodes 1       (one machine only)\n"
        "Without a count, one rank per GPU CUDA_VISIBLE_DEVICES lists (deepspeed's default), else "
        "1.\n"
        "PROGRAM `train` is this program's own train command (`deepspeed train.py ARGS` becomes\n"
        "`zerotrain launch train ARGS`).\n",
        stdout);
    return 0;
  }
  LocalLaunchOptions o;
  bool counted = false, included = false;  // --nproc_per_node / --num_gpus, --include
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
    if (name == "nproc_per_node" || name == "nproc-per-node" || name == "num_gpus" ||
        name == "num-gpus") {
      o.nproc = parse_int(name, value);
      counted = true;
    } else if (name == "include") {
      const std::vector<int> ids = included_devices(value);
      std::string list;
      for (int id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
      o.nproc = static_cast<int>(ids.size());
      o.env.emplace_back("CUDA_VISIBLE_DEVICES", list);
      included = true;
    } else if (name == "num_nodes" || name == "num-nodes") {
      if (parse_int(name, value) != 1) {
        throw ConfigError("--num_nodes " + value +
                          ": zerotrain launch starts the ranks of one machine; for several "
                          "nodes start one launcher per node (torchrun, srun and mpirun "
                          "variables are read)");
      }
    } else if (name == "master_port" || name == "master-port") {
      o.master_port = parse_int(name, value);
    } else if (name == "master_addr" || name == "master-addr") {
      o.master_addr = value;
    } else if (name == "one_node_per_rank" || name == "one-node-per-rank") {
      o.one_node_per_rank = parse_bool(name, value);
    } else {
      throw ConfigError(
          "zerotrain launch: unknown option --" + name +
          " (known: --nproc_per_node, --master_addr, --master_port, --one_node_per_rank; "
          "deepspeed's "
          "--num_gpus, --include, --num_nodes)");
    }
  }
  if (counted && included) {
    throw ConfigError(
        "zerotrain launch: --include already says how many ranks; drop "
        "--num_gpus / --nproc_per_node (deepspeed refuses the two together too)");
  }
  Args command(args.begin() + static_cast<long>(i), args.end());
  if (command.empty()) throw ConfigError("zerotrain launch: no command to run after the options");
  // `zerotrain launch ... train ARGS` runs this program's own train command, as `deepspeed ...
  // train.py ARGS` runs the script.
  if (command[0] == "train") command.insert(command.begin(), self_executable());
  // deepspeed's default: one rank per visible GPU, as CUDA_VISIBLE_DEVICES lists them.
  if (!counted && !included) {
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible && *visible) {
      o.nproc = static_cast<int>(std::count(visible, visible + std::strlen(visible), ',')) + 1;
    }
  }
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
  if (g_signal != 0) {  // the user's (or scheduler's) signal, passed on: no failure of the job
    log_message(LogLevel::kWarning,
                fmt::format("zerotrain launch: stopped by signal {} ({}), passed on to the ranks\n",
                            static_cast<int>(g_signal), strsignal(g_signal)) +
                    r.summary());
    return 128 + g_signal;
  }
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
