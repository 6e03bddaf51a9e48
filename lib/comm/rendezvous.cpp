// Rendezvous through a c10d TCPStore with timeouts that name what is missing.
#include "comm/rendezvous.hpp"

#include <algorithm>
#include <thread>

#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt::comm {

std::string key_prefix() {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return fmt::format("zt/{}/", restart ? restart : "0");
}

namespace {

// A write to a dead peer's socket must fail with EPIPE, not end this process (comm.hpp).
void ignore_default_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout,
                                           std::chrono::milliseconds op_timeout) {
  ignore_default_sigpipe();
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  const std::string where = fmt::format("{}:{}", env.master_addr, env.master_port);
  const bool serve = env.rank == 0 && !env.agent_store;

  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = serve;
  opts.waitWorkers = false;  // arrival is checked below, where missing ranks can be named
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    if (serve) {
      throw DistributedError(fmt::format(
          "rank 0 cannot serve the rendezvous store on {}: {} — is the port already in use? "
          "Choose a free MASTER_PORT.",
          where, e.what()));
    }
    throw DistributedError(fmt::format(
        "rank {} cannot reach the rendezvous store at {} within {} s: {} — is rank 0 running, "
        "and are MASTER_ADDR/MASTER_PORT right?",
        env.rank, where, timeout.count() / 1000, e.what()));
  }

  const std::string prefix = key_prefix() + "arrived/";
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(prefix + std::to_string(r));
  // When rank 0 gives up it posts whom it waited for under `gave_up`, and keeps its store
  // alive until every rank that did arrive has read it (or a grace period passes), so all
  // ranks report the same missing ranks however their clocks started.
  const std::string gave_up = key_prefix() + "rendezvous_gave_up";
  const std::string read_prefix = key_prefix() + "gave_up_read/";
  std::vector<int> missing;  // refreshed now and then, in case the store vanishes
  auto refresh_missing = [&] {
    std::vector<int> now_missing;
    for (int r = 0; r < env.world_size; ++r) {
      if (!store->check({keys[static_cast<size_t>(r)]})) now_missing.push_back(r);
    }
    missing = std::move(now_missing);
  };
  auto missing_text = [&] {
    return missing.empty()
               ? std::string("none known")
               : fmt::format("rank(s) {} of {}", fmt::join(missing, ", "), env.world_size);
  };
  const std::string advice =
      "check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE";
  try {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    std::string me = fmt::format("{} pid {}", host, static_cast<long>(getpid()));
    store->set(keys[static_cast<size_t>(env.rank)], std::vector<uint8_t>(me.begin(), me.end()));
    auto next_refresh = Clock::now();
    while (!store->check(keys)) {
      if (!serve && store->check({gave_up})) {
        std::vector<uint8_t> posted = store->get(gave_up);
        store->set(read_prefix + std::to_string(env.rank), std::vector<uint8_t>{1});
        throw DistributedError(fmt::format(
            "rendezvous at {} failed on rank {}: rank 0 timed out after {} s waiting for {} — {}",
            where, env.rank, timeout.count() / 1000, std::string(posted.begin(), posted.end()),
            advice));
      }
      if (Clock::now() >= next_refresh) {
        refresh_missing();
        next_refresh = Clock::now() + std::chrono::milliseconds(200);
      }
      if (Clock::now() >= deadline) {
        refresh_missing();
        if (serve) {
          const std::string text = missing_text();
          store->set(gave_up, std::vector<uint8_t>(text.begin(), text.end()));
          const auto grace = Clock::now() + std::chrono::seconds(3);
          for (int r = 1; r < env.world_size; ++r) {
            if (std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
            const std::string read_key = read_prefix + std::to_string(r);
            while (!store->check({read_key}) && Clock::now() < grace) {
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
          }
        }
        throw DistributedError(
            fmt::format("rendezvous at {} timed out after {} s on rank {}: {} never arrived — {}",
                        where, timeout.count() / 1000, env.rank, missing_text(), advice));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format(
        "rendezvous at {} failed on rank {}: lost the store ({}) — rank 0 gave up or died; "
        "still missing when last checked: {}",
        where, env.rank, e.what(), missing_text()));
  }
  store->setTimeout(op_timeout);
  log::debug("rank {}/{} joined the rendezvous at {}", env.rank, env.world_size, where);
  return store;
}

}  // namespace zt::comm

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/backends.hpp"

namespace zt::comm {

c10::intrusive_ptr<c10d::Store> local_store() {
  return c10::make_intrusive<c10d::HashStore>();
}

}  // namespace zt::comm
