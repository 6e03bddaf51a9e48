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

std::string self_path() {
  char buf[4096] = {0};
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw InvalidArgument("cannot resolve /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

namespace {

void on_interrupt(int) {}  // a handler, not SIG_IGN: handlers do not survive exec into the ranks

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
  // Ctrl-C reaches the ranks through the terminal's process group; the launcher itself waits for
  // them to exit rather than dying first.
  std::signal(SIGINT, on_interrupt);
  LaunchResult r = launch_local(command, o);
  if (!r.ok()) {
    log_message(LogLevel::kError, "zerotrain launch: the job failed\n" + r.summary());
    return 1;
  }
  return 0;
}

}  // namespace zt::cli
