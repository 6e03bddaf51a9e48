// A communicator that passes every call to the one it wraps: tests derive from it and override
// the calls they watch (counting bytes, logging the order of exchanges).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "zerotrain/comm.hpp"

namespace zt::test {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  at::Device device() const override { return inner_->device(); }
  Backend backend() const override { return inner_->backend(); }
  WorkHandle all_reduce(const at::Tensor& t, ReduceOp op) override {
    return inner_->all_reduce(t, op);
  }
  WorkHandle reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    return inner_->reduce_scatter(out, in, op);
  }
  WorkHandle all_gather(const at::Tensor& out, const at::Tensor& in) override {
    return inner_->all_gather(out, in);
  }
  WorkHandle broadcast(const at::Tensor& t, int root) override {
    return inner_->broadcast(t, root);
  }
  void barrier() override { inner_->barrier(); }
  void raise_if_failed() override { inner_->raise_if_failed(); }

 protected:
  WorkHandle exchange(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& recv,
                      const std::vector<int64_t>& send) override {
    return inner_->all_to_all(out, in, recv, send);
  }

 private:
  std::shared_ptr<Communicator> inner_;
};

}  // namespace zt::test
