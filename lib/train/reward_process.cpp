// The reward command's process (see reward_process.hpp): a socket pair as its stdin and stdout
// (sends never raise SIGPIPE), written and read through poll() against one deadline per batch.
#include "train/reward_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "config/training_options.hpp"
#include "zerotrain/error.hpp"

namespace zt::train {

namespace {

std::string json_line(const RewardInput& r) {
  rapidjson::StringBuffer buf;
  rapidjson::Writer<rapidjson::StringBuffer> w(buf);
  w.StartObject();
  w.Key("prompt");
  w.String(r.prompt.data(), static_cast<rapidjson::SizeType>(r.prompt.size()));
  w.Key("completion");
  w.String(r.completion.data(), static_cast<rapidjson::SizeType>(r.completion.size()));
  w.Key("completion_ids");
  w.StartArray();
  for (int64_t t : r.completion_ids) w.Int64(t);
  w.EndArray();
  for (const auto& [name, value] : r.columns) {
    if (name == "prompt" || name == "completion" || name == "completion_ids") continue;
    w.Key(name.data(), static_cast<rapidjson::SizeType>(name.size()));
    w.String(value.data(), static_cast<rapidjson::SizeType>(value.size()));
  }
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize()) + "\n";
}

std::string trimmed(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\r')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r')) --e;
  return s.substr(b, e - b);
}

}  // namespace

RewardProcess::RewardProcess(std::string command, double timeout_s)
    : command_(std::move(command)), timeout_s_(timeout_s) {}

RewardProcess::~RewardProcess() {
  stop();
}

RewardFunction RewardProcess::function(const std::string& command, double timeout_s) {
  auto process = std::make_shared<RewardProcess>(command, timeout_s);
  return {"command",
          [process](const std::vector<RewardInput>& batch) { return process->score(batch); }};
}

void RewardProcess::start() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    throw Error(fmt::format("reward_command '{}': cannot make its pipes: {}", command_,
                            std::strerror(errno)));
  }
  const char* shell = "/bin/sh";
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls from here
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(125);
    ::dup2(sv[1], 0);
    ::dup2(sv[1], 1);
    ::execl(shell, "sh", "-c", command_.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(sv[1]);
  if (pid < 0) {
    ::close(sv[0]);
    throw Error(
        fmt::format("reward_command '{}': fork() failed: {}", command_, std::strerror(errno)));
  }
  pid_ = pid;
  fd_ = sv[0];
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
  pending_.clear();
}

void RewardProcess::stop() noexcept {
  if (fd_ >= 0) {
    ::shutdown(fd_, SHUT_WR);  // end of its input: a well-behaved program exits
  }
  if (pid_ > 0) {
    int status = 0;
    bool gone = false;
    for (int i = 0; i < 20 && !gone; ++i) {
      gone = ::waitpid(pid_, &status, WNOHANG) == pid_;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!gone) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  pid_ = -1;
  pending_.clear();
}

std::vector<std::optional<double>> RewardProcess::score(const std::vector<RewardInput>& batch) {
  if (pid_ < 0) start();
  // What the program wrote since the last batch was answered, nobody having asked: it is out of
  // step with its input (it answers some completion twice, or prints something else too).
  for (;;) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN)) break;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) break;  // an end or error shows when this batch is sent or read
    pending_.append(buf, static_cast<size_t>(n));
  }
  if (!pending_.empty()) {
    const std::string extra = trimmed(pending_.substr(0, pending_.find('\n')));
    stop();
    throw Error(fmt::format(
        "reward_command '{}' wrote \"{}\" after answering the last batch, more lines than "
        "completions (one line each: a number, or null; docs/grpo.md); it was stopped",
        command_, extra.substr(0, 60)));
  }
  std::string out;
  for (const RewardInput& r : batch) out += json_line(r);
  size_t sent = 0;
  std::vector<std::optional<double>> rewards;
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000.0));
  // How the process ended, when it did (waiting briefly for it), else `otherwise`.
  const auto ended = [&](const std::string& otherwise) {
    int status = 0;
    for (int i = 0; i < 20; ++i) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                 : fmt::format("was killed by signal {}", WTERMSIG(status));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return otherwise;
  };
  const auto fail = [&](const std::string& why) {
    const std::string message = fmt::format(
        "reward_command '{}' {} while answering completion {} of {} (one line each: "
        "a number, or null; docs/grpo.md)",
        command_, why, rewards.size(), batch.size());
    stop();
    return Error(message);
  };
  while (rewards.size() < batch.size()) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      throw fail(
          fmt::format("gave no answer within reward_timeout {} s (it was stopped)", timeout_s_));
    }
    pollfd p{fd_, static_cast<short>(POLLIN | (sent < out.size() ? POLLOUT : 0)), 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno != EINTR)
      throw fail(fmt::format("poll failed: {}", std::strerror(errno)));
    if (ready <= 0) continue;
    if ((p.revents & POLLOUT) && sent < out.size()) {
      const ssize_t n = ::send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        throw fail(ended("stopped reading its input"));
      }
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        throw fail(ended("closed its output"));
      }
      if (n > 0) pending_.append(buf, static_cast<size_t>(n));
      size_t eol;
      while (rewards.size() < batch.size() && (eol = pending_.find('\n')) != std::string::npos) {
        const std::string line = trimmed(pending_.substr(0, eol));
        pending_.erase(0, eol + 1);
        if (line == "null" || line == "None") {
          rewards.push_back(std::nullopt);
          continue;
        }
        // Decimal text, as Python prints a float; hexadecimal, inf and nan are refused.
        const std::optional<double> v = config::parse_double_text(line);
        if (!v) {
          throw fail(
              fmt::format("answered \"{}\", not a finite decimal number", line.substr(0, 60)));
        }
        rewards.push_back(*v);
      }
    }
  }
  if (!pending_.empty()) {
    const std::string extra = trimmed(pending_.substr(0, pending_.find('\n')));
    throw fail(fmt::format("answered {} completions, then \"{}\": more lines than completions",
                           batch.size(), extra.substr(0, 60)));
  }
  return rewards;
}

}  // namespace zt::train
