// The CPU backend: c10d's ProcessGroupGloo, completed where Debian's LibTorch 1.13 lacks ops.
//
// What c10d's Gloo group does not do, and what this backend does instead:
// - reduce_scatter / flat all_gather / bf16 all_reduce throw "not supported" there. Reduce-
//   scatter is an all-reduce of the whole input followed by keeping this rank's slice (2× the
//   traffic of a ring reduce-scatter — acceptable for a backend that serves tests, the demo
//   and small CPU runs), and all_gather uses the list form with views into the flat output.
// - bf16 and fp16 travel as fp32 (converted on the way in and out), which also keeps sums of
//   many ranks exact to fp32 before the final rounding.
// Errors from Gloo (a closed connection from a dead peer, a timeout) become DistributedError,
// with what the job's store says of the other ranks (PeerWatch).
#include <functional>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/backends.hpp"
#include "comm/work.hpp"
#include "zerotrain/error.hpp"

namespace zt::comm {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  // kAvg is a sum followed by a division on this side.
  return op == ReduceOp::kMax ? c10d::ReduceOp(c10d::ReduceOp::MAX)
                              : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

bool needs_widening(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

// What a failed Gloo collective says, then what the store says of the other ranks.
using Diagnose = std::function<std::string(const std::string&)>;

class GlooWork final : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::string what, Diagnose diagnose)
      : work_(std::move(work)), what_(std::move(what)), diagnose_(std::move(diagnose)) {}
  void wait() override {
    if (!work_) return;
    try {
      work_->wait();
    } catch (const std::exception& e) {
      work_.reset();
      throw DistributedError(diagnose_(fmt::format("{} failed: {}", what_, first_line(e.what()))));
    }
    work_.reset();
  }
  void synchronize() override { wait(); }

 private:
  // c10d's messages carry a C++ stack after their first line.
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  Diagnose diagnose_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                   const CommOptions& options, std::shared_ptr<PeerWatch> peers)
      : rank_(env.rank), world_(env.world_size) {
    peers_ = std::move(peers);
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    // Loopback for one host; otherwise the interface that resolves the master's route.
    std::string iface_host = env.master_addr == "127.0.0.1" || env.master_addr == "localhost"
                                 ? std::string("127.0.0.1")
                                 : std::string();
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (!iface_host.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(iface_host));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = 2;
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank_, world_, opts);
    } catch (const std::exception& e) {
      throw DistributedError(with_diagnosis(fmt::format(
          "rank {}: Gloo could not connect the {} ranks: {}", rank_, world_, e.what())));
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  at::Device device() const override { return at::kCPU; }
  Backend backend() const override { return Backend::kGloo; }

  WorkHandle all_reduce(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, at::kCPU, "all_reduce", "tensor");
    check_op(t, op, "all_reduce");
    at::Tensor wire = needs_widening(t) ? t.to(at::kFloat) : t;
    std::vector<at::Tensor> list{wire};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto inner = wrap(pg_->allreduce(list, o), "all_reduce");
    if (wire.is_same(t) && op != ReduceOp::kAvg) return inner;
    return std::make_unique<ThenWork>(std::move(inner), [t, wire, op, world = world_]() mutable {
      if (op == ReduceOp::kAvg) wire.div_(world);
      if (!wire.is_same(t)) t.copy_(wire);
    });
  }

  WorkHandle reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_tensor(out, at::kCPU, "reduce_scatter", "output");
    check_tensor(in, at::kCPU, "reduce_scatter", "input");
    check_sizes(out, in, world_, "reduce_scatter");
    check_op(in, op, "reduce_scatter");
    at::Tensor wire = in.to(needs_widening(in) ? at::kFloat : in.scalar_type(), false, true);
    std::vector<at::Tensor> list{wire};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto inner = wrap(pg_->allreduce(list, o), "reduce_scatter");
    return std::make_unique<ThenWork>(
        std::move(inner), [out, wire, op, rank = rank_, world = world_]() mutable {
          at::Tensor mine = wire.view({-1}).narrow(0, rank * out.numel(), out.numel());
          if (op == ReduceOp::kAvg) mine.div_(world);
          out.view({-1}).copy_(mine);
        });
  }

  WorkHandle all_gather(const at::Tensor& out, const at::Tensor& in) override {
    check_tensor(out, at::kCPU, "all_gather", "output");
    check_tensor(in, at::kCPU, "all_gather", "input");
    check_sizes(in, out, world_, "all_gather");
    const bool widen = needs_widening(in);
    at::Tensor wire_in = widen ? in.to(at::kFloat) : in.view({-1});
    at::Tensor wire_out = widen ? at::empty({out.numel()}, wire_in.options()) : out.view({-1});
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_; ++r) {
      outputs[0].push_back(wire_out.narrow(0, r * in.numel(), in.numel()));
    }
    std::vector<at::Tensor> inputs{wire_in.view({-1})};
    auto inner = wrap(pg_->allgather(outputs, inputs), "all_gather");
    if (!widen) return inner;
    return std::make_unique<ThenWork>(
        std::move(inner), [out, wire_out]() mutable { out.view({-1}).copy_(wire_out); });
  }

  WorkHandle broadcast(const at::Tensor& t, int root) override {
    check_tensor(t, at::kCPU, "broadcast", "tensor");
    if (root < 0 || root >= world_) {
      throw InvalidArgument(fmt::format("broadcast: root {} is not a rank of {}", root, world_));
    }
    at::Tensor wire = needs_widening(t) ? t.to(at::kFloat) : t;
    std::vector<at::Tensor> list{wire};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    auto inner = wrap(pg_->broadcast(list, o), "broadcast");
    if (wire.is_same(t)) return inner;
    return std::make_unique<ThenWork>(std::move(inner), [t, wire]() mutable { t.copy_(wire); });
  }

  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in,
                      const std::vector<int64_t>& recv_counts,
                      const std::vector<int64_t>& send_counts) override {
    // Gloo takes no empty buffer, so every rank also sends itself one element, after its own
    // block (the same on both sides of that self-exchange); widened where Gloo lacks the dtype.
    const at::ScalarType wire_type = needs_widening(in) ? at::kFloat : in.scalar_type();
    const auto r = static_cast<size_t>(rank_);
    int64_t send_cut = 0, recv_cut = 0;  // where the own block ends in input and output
    for (size_t q = 0; q <= r; ++q) {
      send_cut += send_counts[q];
      recv_cut += recv_counts[q];
    }
    std::vector<int64_t> send = send_counts, recv = recv_counts;
    send[r] += 1;
    recv[r] += 1;
    at::Tensor wire_in = at::zeros({in.numel() + 1}, in.options().dtype(wire_type));
    const at::Tensor flat_in = in.reshape({-1});
    wire_in.narrow(0, 0, send_cut).copy_(flat_in.narrow(0, 0, send_cut));
    wire_in.narrow(0, send_cut + 1, in.numel() - send_cut)
        .copy_(flat_in.narrow(0, send_cut, in.numel() - send_cut));
    at::Tensor wire_out = at::empty({out.numel() + 1}, out.options().dtype(wire_type));
    auto inner = wrap(pg_->alltoall_base(wire_out, wire_in, recv, send), "all_to_all");
    return std::make_unique<ThenWork>(std::move(inner), [out, wire_out, recv_cut]() mutable {
      at::Tensor flat = out.view({-1});
      const int64_t n = flat.numel();
      flat.narrow(0, 0, recv_cut).copy_(wire_out.narrow(0, 0, recv_cut));
      flat.narrow(0, recv_cut, n - recv_cut).copy_(wire_out.narrow(0, recv_cut + 1, n - recv_cut));
    });
  }

  void barrier() override {
    WorkHandle w;
    try {
      w = wrap(pg_->barrier(), "barrier");
    } catch (const std::exception& e) {
      throw DistributedError(
          with_diagnosis(fmt::format("barrier failed on rank {}: {}", rank_, e.what())));
    }
    w->wait();
  }

 private:
  WorkHandle wrap(c10::intrusive_ptr<c10d::Work> w, const char* op) {
    return std::make_unique<GlooWork>(
        std::move(w), fmt::format("gloo {} #{} on rank {} of {}", op, ++sequence_, rank_, world_),
        [this](const std::string& error) { return with_diagnosis(error); });
  }

  int rank_;
  int world_;
  int64_t sequence_ = 0;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const LaunchEnv& env,
                                                     const CommOptions& options,
                                                     std::shared_ptr<PeerWatch> peers) {
  return std::make_unique<GlooCommunicator>(store, env, options, std::move(peers));
}

}  // namespace zt::comm
