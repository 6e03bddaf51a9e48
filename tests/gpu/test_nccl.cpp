// The NCCL backend on the GPU machine: every collective and dtype at world size 1, ordering
// against the compute stream, and — when more than one GPU is visible — all GPUs as ranks.
#include "support/catch.hpp"

#include <ATen/Context.h>

#include <cstdlib>

#include "support/collectives.hpp"
#include "support/ranks.hpp"
#include "zerotrain/error.hpp"

using namespace zt;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                             at::kLong};

std::unique_ptr<Communicator> nccl_single() {
  CommOptions o;
  o.backend = Backend::kNccl;
  o.device = at::Device(at::kCUDA, 0);
  return create_communicator(LaunchEnv{}, o);
}

}  // namespace

TEST_CASE("nccl: every collective and dtype at world size 1", "[gpu][nccl]") {
  REQUIRE(at::getNumGPUs() > 0);
  auto comm = nccl_single();
  CHECK(comm->backend() == Backend::kNccl);
  for (at::ScalarType dtype : kDtypes) test::check_collectives(*comm, dtype);
}

TEST_CASE("nccl: a collective sees the compute stream's writes and is seen by later kernels",
          "[gpu][nccl]") {
  auto comm = nccl_single();
  const auto opts = at::TensorOptions().device(at::kCUDA, 0);
  for (int round = 0; round < 20; ++round) {
    // A long chain of kernels produces the input; no host sync before the collective.
    at::Tensor a = at::randn({2048, 2048}, opts);
    at::Tensor in = a;
    for (int k = 0; k < 8; ++k) in = at::tanh(at::mm(in, a) * 1e-3);
    in = in.reshape({-1}).contiguous();
    at::Tensor out = at::empty_like(in);
    comm->all_gather(out, in)->wait();
    at::Tensor after = out * 2;  // enqueued after the wait, on the same stream
    CHECK(at::equal(after, in * 2));
  }
}

TEST_CASE("nccl: synchronize() blocks the host until the result is there", "[gpu][nccl]") {
  auto comm = nccl_single();
  at::Tensor t = at::full({1 << 20}, 3.0, at::TensorOptions().device(at::kCUDA, 0));
  auto work = comm->all_reduce(t, ReduceOp::kMax);
  work->synchronize();
  work->wait();  // idempotent
  CHECK(t.min().item<float>() == 3.0f);
}

TEST_CASE("nccl: CPU tensors are rejected", "[gpu][nccl]") {
  auto comm = nccl_single();
  CHECK_THROWS_AS(comm->all_reduce(at::zeros({4})), InvalidArgument);
}

TEST_CASE("rank: nccl collectives", "[.rank]") {
  int local = std::atoi(std::getenv("LOCAL_RANK"));
  auto comm = test::join(Backend::kNccl, at::Device(at::kCUDA, static_cast<int16_t>(local)));
  for (at::ScalarType dtype : kDtypes) test::check_collectives(*comm, dtype);
}

TEST_CASE("nccl: every collective at world 2 and 4, nodes of their own on one GPU",
          "[gpu][nccl][ranks]") {
  // all_to_all's pairs of sends and receives included (check_collectives).
  for (int world : {2, 4}) {
    INFO("world " << world);
    test::run_ranks(world, "rank: nccl collectives", std::chrono::seconds(240), {},
                    test::gpu_ranks_share_a_gpu(world));
  }
}

TEST_CASE("nccl: every collective across all visible GPUs", "[gpu][nccl][multi]") {
  int gpus = static_cast<int>(at::getNumGPUs());
  if (gpus < 2) {
    WARN("only " << gpus << " GPU visible: the multi-rank NCCL run needs 2 or more");
    return;
  }
  test::run_ranks(gpus, "rank: nccl collectives");
}
