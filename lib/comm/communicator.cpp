// Backend-independent parts of Communicator, the single-rank backend, and the factory.
#include <cstdlib>

#include <fmt/format.h>

#include "comm/backends.hpp"
#include "comm/peer_watch.hpp"
#include "comm/rendezvous.hpp"
#include "comm/work.hpp"
#include "util/log.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/error.hpp"

namespace zt {

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kNccl:
      return "nccl";
    case Backend::kGloo:
      return "gloo";
    case Backend::kSelf:
      return "self";
  }
  return "?";
}

namespace comm {

void check_tensor(const at::Tensor& t, const at::Device& device, const char* op, const char* what) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} is undefined", op, what));
  if (!t.is_contiguous()) throw InvalidArgument(fmt::format("{}: {} must be contiguous", op, what));
  if (t.device() != device) {
    throw InvalidArgument(fmt::format("{}: {} is on {} but the communicator is on {}", op, what,
                                      t.device().str(), device.str()));
  }
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kLong:
    case at::kByte:  // the bytes of a quantized base, gathered and broadcast as they are
      return;
    default:
      throw InvalidArgument(
          fmt::format("{}: {} has dtype {}; supported: float32, float64, bfloat16, "
                      "float16, int64, uint8",
                      op, what, c10::toString(t.scalar_type())));
  }
}

void check_sizes(const at::Tensor& small, const at::Tensor& large, int64_t factor, const char* op) {
  if (small.scalar_type() != large.scalar_type()) {
    throw InvalidArgument(fmt::format("{}: input and output dtypes differ ({} vs {})", op,
                                      c10::toString(small.scalar_type()),
                                      c10::toString(large.scalar_type())));
  }
  if (large.numel() != small.numel() * factor) {
    throw InvalidArgument(fmt::format("{}: expected {} × {} = {} elements, found {}", op, factor,
                                      small.numel(), small.numel() * factor, large.numel()));
  }
}

void check_op(const at::Tensor& t, ReduceOp op, const char* what) {
  if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type())) {
    throw InvalidArgument(fmt::format("{}: average of an integer tensor is not defined", what));
  }
}

namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(at::Device device) : device_(device) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  at::Device device() const override { return device_; }
  Backend backend() const override { return Backend::kSelf; }

  WorkHandle all_reduce(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, device_, "all_reduce", "tensor");
    check_op(t, op, "all_reduce");
    return std::make_unique<DoneWork>();
  }
  WorkHandle reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_tensor(out, device_, "reduce_scatter", "output");
    check_tensor(in, device_, "reduce_scatter", "input");
    check_sizes(out, in, 1, "reduce_scatter");
    check_op(in, op, "reduce_scatter");
    if (!out.is_same(in)) out.copy_(in);
    return std::make_unique<DoneWork>();
  }
  WorkHandle all_gather(const at::Tensor& out, const at::Tensor& in) override {
    check_tensor(out, device_, "all_gather", "output");
    check_tensor(in, device_, "all_gather", "input");
    check_sizes(in, out, 1, "all_gather");
    if (!out.is_same(in)) out.copy_(in);
    return std::make_unique<DoneWork>();
  }
  WorkHandle broadcast(const at::Tensor& t, int root) override {
    check_tensor(t, device_, "broadcast", "tensor");
    if (root != 0)
      throw InvalidArgument(fmt::format("broadcast: root {} is not a rank of 1", root));
    return std::make_unique<DoneWork>();
  }
  void barrier() override {}

 private:
  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>&,
                      const std::vector<int64_t>&) override {
    if (!out.is_same(in) && out.numel() > 0) out.view({-1}).copy_(in.view({-1}));
    return std::make_unique<DoneWork>();
  }

  at::Device device_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(at::Device device) {
  return std::make_unique<SelfCommunicator>(device);
}

}  // namespace comm

WorkHandle Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input,
                                    const std::vector<int64_t>& recv_counts,
                                    const std::vector<int64_t>& send_counts) {
  const int world = world_size();
  if (static_cast<int>(recv_counts.size()) != world ||
      static_cast<int>(send_counts.size()) != world) {
    throw InvalidArgument(fmt::format("all_to_all: {} receive and {} send counts for {} ranks",
                                      recv_counts.size(), send_counts.size(), world));
  }
  int64_t received = 0, sent = 0;
  for (int q = 0; q < world; ++q) {
    const int64_t in = recv_counts[static_cast<size_t>(q)],
                  out = send_counts[static_cast<size_t>(q)];
    if (in < 0 || out < 0) {
      throw InvalidArgument(fmt::format("all_to_all: a negative count for rank {}", q));
    }
    received += in;
    sent += out;
  }
  comm::check_tensor(output, device(), "all_to_all", "output");
  comm::check_tensor(input, device(), "all_to_all", "input");
  if (output.numel() != received || input.numel() != sent ||
      input.scalar_type() != output.scalar_type()) {
    throw InvalidArgument(fmt::format(
        "all_to_all: rank {} has {} input elements (send counts sum to {}) and {} output elements "
        "(receive counts sum to {}), dtypes {} and {}",
        rank(), input.numel(), sent, output.numel(), received, c10::toString(input.scalar_type()),
        c10::toString(output.scalar_type())));
  }
  return exchange(output, input, recv_counts, send_counts);
}

WorkHandle Communicator::all_gather_uneven(const at::Tensor& output, const at::Tensor& input,
                                           const std::vector<int64_t>& counts) {
  const int world = world_size();
  if (static_cast<int>(counts.size()) != world) {
    throw InvalidArgument(
        fmt::format("all_gather_uneven: {} counts for {} ranks", counts.size(), world));
  }
  int64_t total = 0, largest = 0;
  for (int64_t c : counts) {
    if (c < 0) throw InvalidArgument("all_gather_uneven: negative count");
    total += c;
    largest = std::max(largest, c);
  }
  comm::check_tensor(output, device(), "all_gather_uneven", "output");
  comm::check_tensor(input, device(), "all_gather_uneven", "input");
  if (input.numel() != counts[static_cast<size_t>(rank())] || output.numel() != total ||
      input.scalar_type() != output.scalar_type()) {
    throw InvalidArgument(fmt::format(
        "all_gather_uneven: rank {} has {} input elements (count says {}) and {} output elements "
        "(counts sum to {}), dtypes {} and {}",
        rank(), input.numel(), counts[static_cast<size_t>(rank())], output.numel(), total,
        c10::toString(input.scalar_type()), c10::toString(output.scalar_type())));
  }
  at::Tensor padded_in = at::zeros({largest}, input.options());
  padded_in.narrow(0, 0, input.numel()).copy_(input.reshape({-1}));
  at::Tensor padded_out = at::empty({largest * world}, input.options());
  WorkHandle inner = all_gather(padded_out, padded_in);
  at::Tensor out = output;
  auto compact = [out, padded_out, counts, largest]() mutable {
    at::Tensor flat = out.view({-1});
    int64_t offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      flat.narrow(0, offset, counts[r])
          .copy_(padded_out.narrow(0, static_cast<int64_t>(r) * largest, counts[r]));
      offset += counts[r];
    }
  };
  if (device().is_cuda()) {
    // Compaction is enqueued on the caller's stream after the gather: wait() orders it.
    inner->wait();
    compact();
    return inner;
  }
  return std::make_unique<comm::ThenWork>(std::move(inner), std::move(compact));
}

Communicator::~Communicator() = default;

void Communicator::post_failure(const std::string& message) noexcept {
  if (peers_) peers_->post_failure(message);
}

std::string Communicator::with_diagnosis(const std::string& error) noexcept {
  try {
    const std::string said = peers_ ? peers_->diagnose() : std::string();
    return said.empty() ? error : fmt::format("{} — {}", error, said);
  } catch (...) {
    return error;
  }
}

bool backend_available(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
    case Backend::kSelf:
      return true;
    case Backend::kGloo:
      return ZT_WITH_GLOO;
    case Backend::kNccl:
      return ZT_WITH_NCCL;
  }
  return false;
}

std::unique_ptr<Communicator> create_communicator(const LaunchEnv& env, const CommOptions& given) {
  CommOptions options = given;
  if (options.device.is_cuda() && !options.device.has_index()) {
    // Tensors made on "cuda" land on an indexed device; the check of every collective's
    // tensors compares devices exactly, so the communicator names the index too.
    options.device = at::Device(at::kCUDA, static_cast<at::DeviceIndex>(env.local_rank));
  }
  Backend backend = options.backend;
  if (backend == Backend::kAuto) {
    backend = options.device.is_cuda() ? Backend::kNccl
              : env.world_size == 1    ? Backend::kSelf
                                       : Backend::kGloo;
  }
  if (!backend_available(backend)) {
    throw ConfigError(fmt::format(
        "this build of zerotrain has no {} backend{}", backend_name(backend),
        backend == Backend::kGloo
            ? " (LibTorch without Gloo headers): run CPU jobs with one rank, or build against "
              "Debian's libtorch-dev + libgloo-dev"
            : " (built without CUDA/NCCL): rebuild with the CUDA toolkit and NCCL available"));
  }
  if (backend == Backend::kSelf) {
    if (env.world_size != 1) {
      throw ConfigError(
          fmt::format("the self backend runs one rank, but WORLD_SIZE is {}", env.world_size));
    }
    return comm::make_self_communicator(options.device);
  }
  if (backend == Backend::kNccl && !options.device.is_cuda()) {
    throw ConfigError("the NCCL backend needs a CUDA device; use device cuda or the Gloo backend");
  }
  if (backend == Backend::kGloo && !options.device.is_cpu()) {
    throw ConfigError("the Gloo backend runs on CPU tensors; use device cpu or the NCCL backend");
  }
  // One rank needs no store: NCCL makes its id locally and Gloo meets itself in memory.
  c10::intrusive_ptr<c10d::Store> store =
      env.world_size == 1 ? comm::local_store()
                          : comm::rendezvous(env, options.rendezvous_timeout, options.timeout);
  // Signs of life from here on, so that a failure while the backend connects names its rank.
  std::shared_ptr<comm::PeerWatch> peers;
  if (env.world_size > 1) {
    // It also keeps the store: rank 0 serves it, and NCCL (unlike Gloo) holds no reference,
    // so it would close right after start-up and leave nothing to ask.
    peers = std::make_shared<comm::PeerWatch>(env, comm::heartbeat_interval(), store);
  }
  CommOptions o = options;
  if (const char* t = std::getenv("ZT_COMM_TIMELINE"); t && *t) o.timeline = true;
  std::unique_ptr<Communicator> c;
#if ZT_WITH_NCCL
  if (backend == Backend::kNccl) c = comm::make_nccl_communicator(store, env, o, peers);
#endif
#if ZT_WITH_GLOO
  if (backend == Backend::kGloo) c = comm::make_gloo_communicator(store, env, o, peers);
#endif
  log::debug("rank {}/{}: {} communicator on {}", env.rank, env.world_size, backend_name(backend),
             options.device.str());
  return c;
}

}  // namespace zt
