// A rank that fails mid-run (see faults.hpp).
#include "support/faults.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "support/catch.hpp"
#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/launch.hpp"

extern char** environ;

namespace zt::test {

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

// What a survivor's message must say of the culprit.
bool names_culprit(const std::string& msg, const std::string& fault, int culprit) {
  if (fault == "throw") {
    return msg.find(fmt::format("rank {} failed first: bad batch on purpose", culprit)) !=
           std::string::npos;
  }
  if (culprit == 0 && msg.find("rank 0, which serves it,") != std::string::npos) return true;
  return msg.find(fmt::format("rank(s) {} stopped answering", culprit)) != std::string::npos;
}

}  // namespace

TEST_CASE("rank: peer fault", "[.rank]") {
  const std::string fault = std::getenv("ZT_FAULT");
  const std::string device = std::getenv("ZT_DEVICE");
  const int culprit = env_int("ZT_CULPRIT");
  const int timeout_s = env_int("ZT_FAULT_TIMEOUT_S");
  const bool cuda = device == "cuda";
  auto comm = join(cuda ? Backend::kNccl : Backend::kGloo,
                   cuda ? at::Device(at::kCUDA, static_cast<int16_t>(env_int("LOCAL_RANK")))
                        : at::Device(at::kCPU));
  const auto options = at::TensorOptions().device(comm->device());
  at::Tensor t = at::ones({1 << 16}, options);
  comm->all_reduce(t)->synchronize();
  REQUIRE(t[0].item<float>() == static_cast<float>(comm->world_size()));
  if (comm->rank() == culprit) {
    if (fault == "kill") ::raise(SIGKILL);
    if (fault == "stop") {
      // A survivor ends it after the test (the launcher would wait for it until its timeout).
      std::FILE* f =
          std::fopen((std::string(std::getenv("ZT_TEST_DIR")) + "/stopped").c_str(), "w");
      if (f) {
        std::fprintf(f, "%ld\n", static_cast<long>(::getpid()));
        std::fclose(f);
      }
      ::raise(SIGSTOP);
    }
    comm->post_failure("bad batch on purpose\nsecond line");
    std::fflush(stdout);
    // The post is sent by the heartbeat thread; a failing rank's destructor stays a moment so
    // that its peers can read it (as Trainer's errors do through their normal exit).
    comm.reset();
    std::_Exit(3);
  }
  // Survivors: the destructors are skipped (_Exit), since tearing down a group with a dead
  // member is not what this test is about.
  const auto start = std::chrono::steady_clock::now();
  std::string msg;
  try {
    for (int i = 0; i < 100000; ++i) {
      comm->all_reduce(t)->wait();
      // What a training step does with a result: read it on the host.
      if (i % 16 == 0) (void)t[0].item<float>();
      comm->raise_if_failed();
    }
  } catch (const DistributedError& e) {
    msg = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool named = names_culprit(msg, fault, culprit);
  const bool timely = seconds < timeout_s + 15;
  std::printf("rank %d after %.1f s: %s\nnamed=%d timely=%d\n", comm->rank(), seconds, msg.c_str(),
              named, timely);
  std::fflush(stdout);
  if (fault == "stop" && comm->rank() == (culprit == 0 ? 1 : 0)) {
    long pid = 0;
    if (std::FILE* f =
            std::fopen((std::string(std::getenv("ZT_TEST_DIR")) + "/stopped").c_str(), "r")) {
      if (std::fscanf(f, "%ld", &pid) != 1) pid = 0;
      std::fclose(f);
    }
    if (pid > 0) ::kill(static_cast<pid_t>(pid), SIGKILL);
  }
  std::_Exit(named && timely ? 0 : 1);
}

void check_peer_fault(int world, const std::string& fault, int culprit, const std::string& device,
                      int timeout_s) {
  INFO(fault << " rank " << culprit << " of " << world << " on " << device);
  const bool nodes = device == "cuda" && gpu_ranks_share_a_gpu(world);
  RankRun run = launch_ranks(world, "rank: peer fault", std::chrono::seconds(timeout_s + 90),
                             {{"ZT_FAULT", fault},
                              {"ZT_DEVICE", device},
                              {"ZT_CULPRIT", std::to_string(culprit)},
                              {"ZT_FAULT_TIMEOUT_S", std::to_string(timeout_s)},
                              {"ZT_TEST_TIMEOUT_MS", std::to_string(timeout_s * 1000)},
                              {"ZT_TEST_DIR", temp_dir("fault")}},
                             std::chrono::seconds(timeout_s + 60), nodes);
  INFO(run.report());
  CHECK_FALSE(run.result.timed_out);
  for (int r = 0; r < world; ++r) {
    const RankExit& x = run.result.ranks[static_cast<size_t>(r)];
    INFO("rank " << r);
    if (r == culprit) {
      if (fault == "kill" || fault == "stop") CHECK(x.signal == SIGKILL);
      if (fault == "throw") CHECK(x.exit_code == 3);
      continue;
    }
    CHECK(x.exit_code == 0);
    CHECK_FALSE(x.killed_by_launcher);
  }
}

namespace {

// Starts `argv` with this process's environment plus `env`, its output into `log`.
pid_t spawn(const std::vector<std::string>& argv, const Env& env, const std::string& log) {
  // This process's environment less the names `env` sets (getenv takes the first entry), then
  // `env` itself, where a later entry of a name replaces an earlier one.
  std::vector<std::string> strings;
  auto named = [](const std::string& entry, const std::string& name) {
    return entry.size() > name.size() && entry.compare(0, name.size(), name) == 0 &&
           entry[name.size()] == '=';
  };
  for (char** e = environ; *e != nullptr; ++e) {
    bool set_here = false;
    for (const auto& kv : env) set_here = set_here || named(*e, kv.first);
    if (!set_here) strings.emplace_back(*e);
  }
  for (const auto& kv : env) {
    strings.erase(std::remove_if(strings.begin(), strings.end(),
                                 [&](const std::string& entry) { return named(entry, kv.first); }),
                  strings.end());
    strings.push_back(kv.first + "=" + kv.second);
  }
  std::vector<char*> envp, args;
  for (std::string& s : strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  std::fflush(stdout);  // or the child writes this process's buffered output again
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::FILE* out = std::freopen(log.c_str(), "w", stdout);
    if (out != nullptr) ::dup2(::fileno(stdout), 2);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

std::string last_error_line(const std::string& log) {
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find("error") != std::string::npos) last = line;
  }
  return last;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

void check_stopped_trainer(const std::string& cli, const std::string& dir, int world, int culprit,
                           const std::string& device, int timeout_s) {
  INFO("a " << world << "-rank run on " << device << " with rank " << culprit << " stopped");
  const std::vector<std::string> flags = tiny_run_flags(
      dir, {"--per_device_train_batch_size", "2", "--max_steps", "100000", "--logging_steps", "1",
            "--save_steps", "2", "--device", device, "--ddp_timeout", std::to_string(timeout_s)});
  std::vector<std::string> argv{cli, "train"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  const int port = pick_free_port();
  const bool nodes = device == "cuda" && gpu_ranks_share_a_gpu(world);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    Env env{{"RANK", std::to_string(r)},       {"WORLD_SIZE", std::to_string(world)},
            {"LOCAL_RANK", std::to_string(r)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
            {"MASTER_ADDR", "127.0.0.1"},      {"MASTER_PORT", std::to_string(port)},
            {"OMP_NUM_THREADS", "1"}};
    if (nodes) {
      for (const auto& kv : emulated_node_env(r)) env.push_back(kv);
    }
    pids.push_back(spawn(argv, env, fmt::format("{}/rank{}.log", dir, r)));
  }
  auto ended = [&](int r, int& status) {
    return ::waitpid(pids[static_cast<size_t>(r)], &status, WNOHANG) ==
           pids[static_cast<size_t>(r)];
  };
  // Wait for step 3 in the log (rank 0 writes it), then stop the culprit.
  const auto started = std::chrono::steady_clock::now();
  while (logged_losses(dir + "/out").size() < 3 &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(240)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool training = logged_losses(dir + "/out").size() >= 3;
  ::kill(pids[static_cast<size_t>(culprit)], SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  std::vector<int> statuses(static_cast<size_t>(world), -1);
  std::vector<double> seconds(static_cast<size_t>(world), -1);
  int waiting = world - 1;
  while (waiting > 0 &&
         std::chrono::steady_clock::now() - stopped < std::chrono::seconds(timeout_s + 60)) {
    for (int r = 0; r < world; ++r) {
      int status = 0;
      if (r == culprit || statuses[static_cast<size_t>(r)] != -1 || !ended(r, status)) continue;
      statuses[static_cast<size_t>(r)] = status;
      seconds[static_cast<size_t>(r)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
      --waiting;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t pid : pids) ::kill(pid, SIGKILL);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    if (statuses[static_cast<size_t>(r)] == -1) ::waitpid(pids[static_cast<size_t>(r)], &status, 0);
  }
  std::string logs;
  for (int r = 0; r < world; ++r) {
    logs +=
        fmt::format("----- rank {} -----\n{}\n", r, read_all(fmt::format("{}/rank{}.log", dir, r)));
  }
  INFO(logs);
  REQUIRE(training);
  for (int r = 0; r < world; ++r) {
    if (r == culprit) continue;
    INFO("rank " << r << " ended after " << seconds[static_cast<size_t>(r)] << " s");
    const int status = statuses[static_cast<size_t>(r)];
    REQUIRE(status != -1);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) != 0));
    CHECK(seconds[static_cast<size_t>(r)] < timeout_s + 15);
    const std::string last = last_error_line(fmt::format("{}/rank{}.log", dir, r));
    INFO("last error line: " << last);
    CHECK(last.find(fmt::format("rank(s) {} stopped answering", culprit)) != std::string::npos);
    CHECK(last.find("diverged") == std::string::npos);
  }
  // The latest complete checkpoint resumes, at one rank.
  std::vector<std::string> resume = argv;
  const int64_t done = logged_losses(dir + "/out").rbegin()->first;
  for (const std::string& f :
       {std::string("--resume_from_checkpoint"), std::string("True"), std::string("--max_steps"),
        std::to_string(done + 2), std::string("--ddp_timeout"), std::string("60")}) {
    resume.push_back(f);
  }
  const pid_t again = spawn(resume, {{"OMP_NUM_THREADS", "1"}}, dir + "/resume.log");
  int status = 0;
  ::waitpid(again, &status, 0);
  INFO(read_all(dir + "/resume.log"));
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}

}  // namespace zt::test
