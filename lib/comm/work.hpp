// Work handles shared by the backends, and argument checks for collectives.
#pragma once

#include <functional>

#include "zerotrain/comm.hpp"

namespace zt::comm {

/// A collective that completed before it was returned.
class DoneWork final : public Work {
 public:
  void wait() override {}
  void synchronize() override {}
};

/// A collective followed by post-processing (copy-back of a converted dtype, compaction of
/// padded chunks), run once on whichever of wait() and synchronize() comes first, on the
/// waiting thread — on CUDA after the current stream was made to wait, so work it enqueues is
/// ordered after the collective.
class ThenWork final : public Work {
 public:
  ThenWork(WorkHandle inner, std::function<void()> then)
      : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait() override {
    inner_->wait();
    run();
  }
  void synchronize() override {
    inner_->synchronize();
    run();
  }

 private:
  void run() {
    if (!then_) return;
    auto f = std::move(then_);
    then_ = nullptr;
    f();
  }
  WorkHandle inner_;
  std::function<void()> then_;
};

/// Throws InvalidArgument unless `t` is contiguous, on `device`, and of a supported dtype
/// (fp32, bf16, fp16, int64); `op` and `what` name the call in the message.
void check_tensor(const at::Tensor& t, const at::Device& device, const char* op, const char* what);
/// Throws InvalidArgument unless `a` and `b` have the same dtype and `b` has `factor`× the
/// elements of `a`.
void check_sizes(const at::Tensor& small, const at::Tensor& large, int64_t factor, const char* op);
/// Throws InvalidArgument for kAvg on integer tensors.
void check_op(const at::Tensor& t, ReduceOp op, const char* what);

/// The trivial communicator of a single rank (no store, no peers).
std::unique_ptr<Communicator> make_self_communicator(at::Device device);

}  // namespace zt::comm
