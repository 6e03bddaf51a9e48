// Signs of life between ranks (see peer_watch.hpp).
//
// The store is touched only by the beating thread: one client per thread, and a diagnosis that
// asks for samples never blocks longer than its own deadline, even when the store's server
// (rank 0) is stopped and a store call hangs.
#include "comm/peer_watch.hpp"

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/agreement.hpp"
#include "comm/rendezvous.hpp"
#include "zerotrain/error.hpp"

namespace zt::comm {

struct PeerWatch::State {
  LaunchEnv env;
  std::chrono::milliseconds interval{1000};
  std::string prefix;
  c10::intrusive_ptr<c10d::Store> store;  // the thread's alone
  // The rendezvous store, kept alive: on rank 0 it is the server every rank's client talks to.
  c10::intrusive_ptr<c10d::Store> rendezvous;

  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
  bool stopped = false;
  std::string to_post;  // "failed" or "noticed", then the message
  bool posted_failure = false;
  bool posted_notice = false;
  // A diagnosis: requests asked and answered, the counters of each sample, the failures seen.
  int64_t asked = 0, answered = 0;
  size_t wanted_samples = 3;
  std::vector<std::vector<int64_t>> samples;
  std::vector<std::string> failures;  // per rank: the posted message, or ""
  std::vector<bool> noticed;          // per rank: it saw a failure itself
  std::vector<bool> diagnosed;        // per rank: its diagnosis is done
  bool post_diagnosed = false;
  std::string store_error;

  std::string key(const char* what, int rank) const {
    return fmt::format("{}{}/{}", prefix, what, rank);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      std::string post = std::move(to_post);
      to_post.clear();
      const bool done = post_diagnosed;
      post_diagnosed = false;
      if (stopping && post.empty() && !done) break;  // a post made just before the end goes out
      const bool sampling = asked > answered;
      const size_t wanted = wanted_samples;
      lock.unlock();
      std::string error;
      std::vector<int64_t> counts;
      std::vector<std::string> failed;
      std::vector<bool> saw, finished;
      try {
        const int me = env.rank;
        if (!post.empty()) {
          const bool primary = post[0] == 'f';
          const std::string text = post.substr(1);
          store->set(key(primary ? "failed" : "noticed", me),
                     std::vector<uint8_t>(text.begin(), text.end()));
        }
        if (done) store->set(key("diagnosed", me), std::vector<uint8_t>{1});
        store->add(key("alive", me), 1);
        if (sampling) {
          for (int r = 0; r < env.world_size; ++r) {
            counts.push_back(store->add(key("alive", r), 0));
            std::string text;
            if (r != me && store->check({key("failed", r)})) {
              const std::vector<uint8_t> b = store->get(key("failed", r));
              text.assign(b.begin(), b.end());
            }
            failed.push_back(text);
            saw.push_back(r != me && store->check({key("noticed", r)}));
            finished.push_back(r != me && store->check({key("diagnosed", r)}));
          }
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      if (sampling && asked > answered) {
        if (!error.empty()) {
          store_error = error;
          answered = asked;
        } else {
          samples.push_back(std::move(counts));
          failures = std::move(failed);
          noticed = std::move(saw);
          diagnosed = std::move(finished);
          if (samples.size() >= wanted) answered = asked;
        }
        wake.notify_all();
      }
      // The first sample of a diagnosis at once; the others an interval apart.
      wake.wait_for(lock, interval, [&] {
        return stopping || !to_post.empty() || post_diagnosed ||
               (asked > answered && samples.empty());
      });
    }
    stopped = true;
    wake.notify_all();
  }
};

std::chrono::milliseconds heartbeat_interval() {
  const char* ms = std::getenv("ZT_HEARTBEAT_MS");
  const long v = ms ? std::atol(ms) : 0;
  return std::chrono::milliseconds(v > 0 ? v : 1000);
}

PeerWatch::PeerWatch(const LaunchEnv& env, std::chrono::milliseconds interval,
                     c10::intrusive_ptr<c10d::Store> store)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.rendezvous = std::move(store);
  s.env = env;
  s.interval = interval;
  s.prefix = key_prefix() + "peers/";
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(env.master_port);
  o.isServer = false;
  o.waitWorkers = false;
  // A store call that gets no answer (its server stopped) gives up after a few beats.
  o.timeout = std::max(std::chrono::milliseconds(3000), 3 * interval);
  try {
    s.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {}: cannot reach the job's store at {}:{}: {}",
                                       env.rank, env.master_addr, env.master_port, e.what()));
  }
  // The thread holds the state: if it is stuck in a store call when this object goes, it
  // still owns what it touches.
  std::thread([state = state_] { state->run(); }).detach();
}

PeerWatch::~PeerWatch() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  // A rank that posted a failure of its own stays a few beats, so that its peers can read it
  // (rank 0 serves the store: once it exits, nothing can be read).
  if (s.posted_failure) s.wake.wait_for(lock, 4 * s.interval, [&] { return s.stopped; });
  s.stopping = true;
  s.wake.notify_all();
  s.wake.wait_for(lock, 2 * s.interval, [&] { return s.stopped; });
}

void PeerWatch::post_failure(const std::string& message) noexcept {
  try {
    State& s = *state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.posted_failure || s.posted_notice) return;
    s.posted_failure = true;
    std::string line = message.substr(0, message.find('\n'));
    if (line.size() > 300) line = line.substr(0, 297) + "...";
    s.to_post = "f" + line;
    s.wake.notify_all();
  } catch (...) {
  }
}

namespace {

// Asks the thread for `count` samples an interval apart; false when they did not come in time
// (a store call hangs). Called with `lock` held.
bool take_samples(PeerWatch::State& s, std::unique_lock<std::mutex>& lock, size_t count) {
  s.samples.clear();
  s.failures.clear();
  s.noticed.clear();
  s.diagnosed.clear();
  s.store_error.clear();
  s.wanted_samples = count;
  const int64_t ticket = ++s.asked;
  s.wake.notify_all();
  return s.wake.wait_for(lock,
                         static_cast<int64_t>(count + 3) * s.interval + std::chrono::seconds(3),
                         [&] { return s.answered >= ticket || s.stopped; }) &&
         !s.stopped;
}

}  // namespace

std::string PeerWatch::diagnose() noexcept {
  try {
    State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    if (s.stopped) return {};
    if (!s.posted_failure && !s.posted_notice) {
      s.posted_notice = true;  // so that the others do not take this rank's exit for the cause
      s.to_post = "n";
    }
    const bool answered = take_samples(s, lock, 3);
    const std::string store = fmt::format("{}:{}", s.env.master_addr, s.env.master_port);
    const std::string server =
        s.env.agent_store ? "torchrun's agent on rank 0's node" : "rank 0, which serves it,";
    if (!answered || !s.store_error.empty()) {
      return fmt::format(
          "the job's store at {} does not answer{}: {} died, was stopped or cannot be reached",
          store, s.store_error.empty() ? "" : " (" + s.store_error + ")", server);
    }
    if (s.samples.size() < 2) return {};
    std::vector<int> stale, failed, alive;
    std::string reasons;
    for (int r = 0; r < s.env.world_size; ++r) {
      const auto rank = static_cast<size_t>(r);
      if (r == s.env.rank) continue;
      if (!s.failures[rank].empty()) {
        failed.push_back(r);
        reasons += fmt::format("{}rank {} failed first: {}", reasons.empty() ? "" : "; ", r,
                               s.failures[rank]);
      } else if (s.samples.front()[rank] == s.samples.back()[rank] && !s.noticed[rank]) {
        stale.push_back(r);
      } else {
        alive.push_back(r);
      }
    }
    if (!stale.empty()) {
      const double seconds = std::chrono::duration<double>(s.interval).count() *
                             static_cast<double>(s.samples.size() - 1);
      reasons += fmt::format(
          "{}rank(s) {} stopped answering (no sign of life for {:.1f} s: killed, stopped or hung, "
          "or its host is down)",
          reasons.empty() ? "" : "; ", rank_list(stale), seconds);
    }
    s.post_diagnosed = true;
    s.wake.notify_all();
    // Rank 0 serves the store: it stays until the ranks still alive have read what they need
    // (a few seconds at most), or their diagnoses would find the store gone.
    if (s.env.rank == 0 && !s.env.agent_store) {
      const auto until = std::chrono::steady_clock::now() + 10 * s.interval;
      while (std::chrono::steady_clock::now() < until && take_samples(s, lock, 1) &&
             s.store_error.empty()) {
        bool all = true;
        for (int r : alive) all = all && s.diagnosed[static_cast<size_t>(r)];
        if (all) break;
        s.wake.wait_for(lock, s.interval / 2);
      }
    }
    return reasons;
  } catch (...) {
    return {};
  }
}

}  // namespace zt::comm
