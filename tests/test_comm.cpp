// Communicator backends on CPU: Gloo at world sizes 1, 2 and 4 (real processes), the
// single-rank backend, rendezvous failures (missing rank, port taken) and dead peers.
#include "support/catch.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "support/collectives.hpp"
#include "support/faults.hpp"
#include "support/ranks.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/error.hpp"

using namespace zt;
using Catch::Contains;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                             at::kLong};

int env_int(const char* name) {
  return std::atoi(std::getenv(name));
}

}  // namespace

// ---- every op and dtype -----------------------------------------------------------------------

TEST_CASE("rank: gloo collectives", "[.rank]") {
  auto comm = test::join(Backend::kGloo);
  REQUIRE(comm->world_size() == env_int("WORLD_SIZE"));
  REQUIRE(comm->rank() == env_int("RANK"));
  for (at::ScalarType dtype : kDtypes) test::check_collectives(*comm, dtype);
}

TEST_CASE("gloo: every collective and dtype at world sizes 1, 2 and 4", "[comm][gloo]") {
  if (!backend_available(Backend::kGloo)) {
    CHECK_THROWS_AS(test::join(Backend::kGloo), ConfigError);
    return;
  }
  for (int world : {1, 2, 4}) test::run_ranks(world, "rank: gloo collectives");
}

TEST_CASE("self backend: every collective and dtype at world size 1", "[comm]") {
  LaunchEnv single;
  auto comm = create_communicator(single, CommOptions{});
  CHECK(comm->backend() == Backend::kSelf);
  for (at::ScalarType dtype : kDtypes) test::check_collectives(*comm, dtype);
}

TEST_CASE("a CUDA device without an index is the rank's local GPU", "[comm]") {
  // Tensors made on "cuda" are on "cuda:N"; a communicator left on "cuda" refused them all.
  LaunchEnv env;
  env.local_rank = 0;
  CommOptions o;
  o.backend = Backend::kSelf;
  o.device = at::Device(at::kCUDA);
  CHECK(create_communicator(env, o)->device() == at::Device(at::kCUDA, 0));
  o.device = at::Device(at::kCUDA, 0);
  CHECK(create_communicator(env, o)->device() == at::Device(at::kCUDA, 0));
}

TEST_CASE("collectives reject bad arguments with InvalidArgument", "[comm][errors]") {
  auto comm = create_communicator(LaunchEnv{}, CommOptions{});
  at::Tensor f = at::zeros({4});
  CHECK_THROWS_AS(comm->all_reduce(at::zeros({4}, at::kInt)), InvalidArgument);
  CHECK_THROWS_AS(comm->all_reduce(at::zeros({4, 4}).t()), InvalidArgument);  // non-contiguous
  CHECK_THROWS_AS(comm->all_reduce(at::zeros({4}, at::kLong), ReduceOp::kAvg), InvalidArgument);
  CHECK_THROWS_AS(comm->reduce_scatter(at::zeros({3}), f), InvalidArgument);
  CHECK_THROWS_AS(comm->all_gather(f, at::zeros({4}, at::kBFloat16)), InvalidArgument);
  CHECK_THROWS_AS(comm->broadcast(f, 1), InvalidArgument);
  CHECK_THROWS_AS(comm->all_gather_uneven(f, f, {4, 4}), InvalidArgument);
}

TEST_CASE("the NCCL backend needs a CUDA device and says so", "[comm][errors]") {
  CommOptions o;
  o.backend = Backend::kNccl;
  o.device = at::Device(at::kCUDA, 0);
  if (!backend_available(Backend::kNccl)) {
    CHECK_THROWS_AS(create_communicator(LaunchEnv{}, o), ConfigError);
  } else if (!ZT_TORCH_CUDA) {
    // Built (CUDA + NCCL compile and link on CI) but no GPU can be used here.
    CHECK_THROWS_WITH(create_communicator(LaunchEnv{}, o), Contains("CUDA device"));
  }
  o.device = at::kCPU;
  if (backend_available(Backend::kNccl)) {
    CHECK_THROWS_WITH(create_communicator(LaunchEnv{}, o), Contains("needs a CUDA device"));
  } else {  // a build without NCCL (e.g. the sanitizer build) says that first
    CHECK_THROWS_WITH(create_communicator(LaunchEnv{}, o), Contains("no nccl backend"));
  }
}

// ---- rendezvous failures ----------------------------------------------------------------------

TEST_CASE("rank: missing peer", "[.rank]") {
  // ZT_TEST_ABSENT names the rank that never joins; the others must fail in time, naming it.
  const int absent = env_int("ZT_TEST_ABSENT");
  if (env_int("RANK") == absent) return;
  auto start = std::chrono::steady_clock::now();
  try {
    test::join(Backend::kGloo);
    FAIL("joined without the absent rank");
  } catch (const DistributedError& e) {
    std::string msg = e.what();
    INFO(msg);
    CHECK_THAT(msg, Contains("127.0.0.1:" + std::string(std::getenv("MASTER_PORT"))));
    if (absent != 0) CHECK_THAT(msg, Contains("rank(s) " + std::to_string(absent) + " of"));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
}

TEST_CASE("a rank that never arrives fails the others with a clear timeout", "[comm][errors]") {
  if (!backend_available(Backend::kGloo)) return;
  for (int absent : {1, 0}) {
    INFO("absent rank " << absent);
    test::run_ranks(2, "rank: missing peer", std::chrono::seconds(60),
                    {{"ZT_TEST_ABSENT", std::to_string(absent)}, {"ZT_TEST_RDZV_MS", "3000"}});
  }
  test::run_ranks(4, "rank: missing peer", std::chrono::seconds(60),
                  {{"ZT_TEST_ABSENT", "2"}, {"ZT_TEST_RDZV_MS", "3000"}});
}

TEST_CASE("rank: port taken", "[.rank]") {
  // Another job's rendezvous store holds the port before rank 0 starts its own: rank 0 cannot
  // bind, rank 1 reaches the other store and waits there in vain. Rank 0 opens that store on a
  // port the kernel picks and tells rank 1 through a file, so no other test can hold it
  // meanwhile. (A raw socket that never answers is no good holder: LibTorch 1.13's store client
  // keeps a listener thread on it that throws from inside LibTorch — std::terminate — when the
  // holder goes away, a crash no caller can catch and not what this test is about.)
  const std::string port_file = std::string(std::getenv("ZT_TEST_DIR")) + "/port";
  const std::string done = port_file + ".rank1_done";
  c10::intrusive_ptr<c10d::TCPStore> holder;
  if (env_int("RANK") == 0) {
    c10d::TCPStoreOptions o;
    o.port = 0;
    o.isServer = true;
    o.waitWorkers = false;
    holder = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    std::ofstream(port_file + ".tmp") << holder->getPort();
    std::rename((port_file + ".tmp").c_str(), port_file.c_str());
  }
  std::string port;
  for (int i = 0; i < 500 && port.empty(); ++i) {
    std::ifstream in(port_file);
    in >> port;
    if (port.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE_FALSE(port.empty());
  ::setenv("MASTER_PORT", port.c_str(), 1);
  auto start = std::chrono::steady_clock::now();
  try {
    test::join(Backend::kGloo);
    FAIL("joined although the port was taken");
  } catch (const DistributedError& e) {
    std::string msg = e.what();
    INFO(msg);
    CHECK_THAT(msg, Contains("127.0.0.1:" + port));
    if (env_int("RANK") == 0) CHECK_THAT(msg, Contains("in use"));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  // The holder stays until rank 1 has given up too.
  if (env_int("RANK") == 1) std::ofstream(done) << 1;
  for (int i = 0; i < 2000 && holder && !std::ifstream(done).good(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

TEST_CASE("a port already taken is reported by every rank within the timeout", "[comm][errors]") {
  if (!backend_available(Backend::kGloo)) return;
  test::run_ranks(2, "rank: port taken", std::chrono::seconds(60),
                  {{"ZT_TEST_RDZV_MS", "3000"}, {"ZT_TEST_DIR", test::temp_dir("port")}});
}

// ---- a rank dies mid-run ------------------------------------------------------------------------

TEST_CASE("rank: peer dies", "[.rank]") {
  auto comm = test::join(Backend::kGloo);
  at::Tensor t = at::ones({1000});
  comm->all_reduce(t)->wait();
  CHECK(t[0].item<float>() == static_cast<float>(comm->world_size()));
  if (comm->rank() == comm->world_size() - 1) std::_Exit(17);  // dies without a goodbye
  // The survivors report by exit code: destructors are skipped (_Exit) because tearing down a
  // group with a dead member is not what this test is about.
  auto start = std::chrono::steady_clock::now();
  bool caught = false;
  try {
    for (int i = 0; i < 100; ++i) comm->all_reduce(t)->wait();
  } catch (const DistributedError& e) {
    std::string msg = e.what();
    caught = msg.find("all_reduce") != std::string::npos;
    std::printf("rank %d caught: %s\n", comm->rank(), msg.c_str());
  }
  bool timely = std::chrono::steady_clock::now() - start < std::chrono::seconds(30);
  std::printf("caught=%d timely=%d\n", caught, timely);
  std::fflush(stdout);
  std::_Exit(caught && timely ? 0 : 1);
}

// A write into a pipe nobody reads, as a socket write to a dead peer is: with SIGPIPE at its
// default action the process would die of the signal; after joining it fails with EPIPE. A rank
// whose host installed a handler of its own (ZT_HOST_SIGPIPE) finds that handler still in place.
namespace {
volatile sig_atomic_t host_sigpipes = 0;
void count_sigpipe(int) {
  host_sigpipes = host_sigpipes + 1;
}
}  // namespace

TEST_CASE("rank: a write to a closed peer", "[.rank]") {
  const bool host_handler = std::getenv("ZT_HOST_SIGPIPE") != nullptr;
  // Launched ranks inherit an ignored SIGPIPE: start from the default, as a C++ program does.
  ::signal(SIGPIPE, host_handler ? count_sigpipe : SIG_DFL);
  auto comm = test::join(Backend::kGloo);
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  ::close(fds[0]);
  const char byte = 1;
  errno = 0;
  const ssize_t n = ::write(fds[1], &byte, 1);
  const int err = errno;
  ::close(fds[1]);
  CHECK(n == -1);
  CHECK(err == EPIPE);
  CHECK(host_sigpipes == (host_handler ? 1 : 0));
  comm->barrier();
}

TEST_CASE("a rank's write to a dead peer's socket is an error, not a silent death by SIGPIPE",
          "[comm][errors]") {
  if (!backend_available(Backend::kGloo)) return;
  test::run_ranks(2, "rank: a write to a closed peer", std::chrono::seconds(60));
  test::run_ranks(2, "rank: a write to a closed peer", std::chrono::seconds(60),
                  {{"ZT_HOST_SIGPIPE", "1"}});
}

TEST_CASE("a rank that dies mid-run fails the others with DistributedError, no hang",
          "[comm][errors]") {
  if (!backend_available(Backend::kGloo)) return;
  for (int world : {2, 4}) {
    test::RankRun run =
        test::launch_ranks(world, "rank: peer dies", std::chrono::seconds(90),
                           {{"ZT_TEST_TIMEOUT_MS", "20000"}}, std::chrono::seconds(60));
    test::check_last_rank_died(run, 17);
  }
}

// ---- which rank failed --------------------------------------------------------------------------

// Every survivor's error names the rank that was killed, stopped (hung) or failed with an error
// of its own, within the collective timeout + 15 s (tests/support/faults.cpp).
TEST_CASE("a killed rank is named by every other rank", "[comm][errors][faults]") {
  if (!backend_available(Backend::kGloo)) return;
  test::check_peer_fault(2, "kill", 1, "cpu", 5);
  test::check_peer_fault(4, "kill", 2, "cpu", 5);
}

TEST_CASE("a killed rank 0, which serves the store, is named by every other rank",
          "[comm][errors][faults]") {
  if (!backend_available(Backend::kGloo)) return;
  test::check_peer_fault(2, "kill", 0, "cpu", 5);
}

TEST_CASE("a stopped (hung) rank is named by every other rank after the timeout",
          "[comm][errors][faults]") {
  if (!backend_available(Backend::kGloo)) return;
  test::check_peer_fault(2, "stop", 1, "cpu", 5);
  test::check_peer_fault(4, "stop", 3, "cpu", 5);
}

TEST_CASE("a rank that fails with its own error is named, with the error, by every other rank",
          "[comm][errors][faults]") {
  if (!backend_available(Backend::kGloo)) return;
  test::check_peer_fault(2, "throw", 1, "cpu", 5);
  test::check_peer_fault(4, "throw", 2, "cpu", 5);
}
