// A reward function in another program (reward_command): a long-lived process, started on
// first use with `/bin/sh -c COMMAND`, fed one JSON object per completion on its stdin and
// answering one line per completion on its stdout — a number, or null to leave it unscored
// (docs/grpo.md has the protocol). Rewards in Python, or any language, for the CLI.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "zerotrain/grpo.hpp"

namespace zt::train {

class RewardProcess {
 public:
  /// `command` runs under /bin/sh -c when first needed; each batch must be answered within
  /// `timeout_s` seconds. Its stderr is this process's.
  RewardProcess(std::string command, double timeout_s);
  /// Closes its stdin, gives it a second to exit, then kills it.
  ~RewardProcess();
  RewardProcess(const RewardProcess&) = delete;
  RewardProcess& operator=(const RewardProcess&) = delete;

  /// The rewards of `batch`, one per completion in order. A process that cannot start, exits,
  /// answers a line that is neither a number nor null, or does not answer within the timeout
  /// (then it is killed, and started anew for the next batch) is an Error naming the command
  /// and the completion it was answering.
  std::vector<std::optional<double>> score(const std::vector<RewardInput>& batch);

  /// A RewardFunction named "command" over a shared process.
  static RewardFunction function(const std::string& command, double timeout_s);

 private:
  void start();
  void stop() noexcept;
  std::string command_;
  double timeout_s_;
  pid_t pid_ = -1;
  int fd_ = -1;          ///< our end of the socket pair (the child's stdin and stdout)
  std::string pending_;  ///< read past the last full line
};

}  // namespace zt::train
