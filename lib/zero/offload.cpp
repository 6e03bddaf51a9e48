// The optimizer on the CPU (see offload.hpp).
#include "zero/offload.hpp"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <string>

#include <fmt/format.h>

#include "kernels/adam_cpu.hpp"
#include "zero/copy_stream.hpp"
#include "zerotrain/error.hpp"

namespace zt::zero {

OffloadedOptimizer::OffloadedOptimizer(EngineImpl& e) : e_(e) {
  int64_t longest = 0, trainable = 0;
  for (const Bucket& b : e.layout.buckets) {
    if (!b.trainable) continue;
    longest = std::max(longest, b.shard_numel);
    ++trainable;
  }
  const auto host =
      at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(e.S.device.is_cuda());
  for (int64_t k = 0; k < std::min<int64_t>(3, trainable); ++k) {
    slots_.push_back(at::empty({longest}, host));
  }
  // The leading buckets up to `ratio` of the state stay on the CPU (a bucket that straddles the
  // mark too); the rest move to the device with their masters and zero moments.
  const int64_t total = e.layout.state_numel;
  const double mark = e.S.offload_ratio * static_cast<double>(total);
  split_ = total;
  for (const Bucket& b : e.layout.buckets) {
    if (b.trainable && b.shard_numel > 0 && static_cast<double>(b.shard.offset) >= mark) {
      split_ = std::min(split_, b.shard.offset);
    }
  }
  if (split_ == total) return;
  // The device share's runs, per bucket, in its own offsets (made once: every step uses them).
  device_segments_.resize(e.bucket_segments.size());
  std::vector<Segment> segments;
  for (const Bucket& b : e.layout.buckets) {
    if (!b.trainable || b.shard.offset < split_) continue;
    for (const Segment& g : e.bucket_segments[static_cast<size_t>(b.index)]) {
      device_segments_[static_cast<size_t>(b.index)].push_back(
          Segment{g.offset - split_, g.length, g.decay});
      segments.push_back(device_segments_[static_cast<size_t>(b.index)].back());
    }
  }
  device_ = std::make_unique<ShardOptimizer>(
      e.S.optimizer,
      e.master.narrow(0, split_, total - split_).to(e.S.device, at::kFloat, false, true),
      std::move(segments), e.S.hyper.momentum, e.S.state_dtype);
}

void OffloadedOptimizer::sync_host() const {
  if (!host_stale_) return;
  const int64_t n = e_.layout.state_numel - split_;
  e_.master.narrow(0, split_, n).copy_(device_->master());
  if (device_->state0().defined())
    e_.optimizer->state0().narrow(0, split_, n).copy_(device_->state0());
  if (device_->state1().defined())
    e_.optimizer->state1().narrow(0, split_, n).copy_(device_->state1());
  host_stale_ = false;
}

void OffloadedOptimizer::load_from_host() {
  if (!device_) return;
  const int64_t n = e_.layout.state_numel - split_;
  const at::Tensor& s0 = e_.optimizer->state0();
  const at::Tensor& s1 = e_.optimizer->state1();
  device_->master().copy_(e_.master.narrow(0, split_, n));
  device_->set_state(e_.optimizer->steps(), s0.defined() ? s0.narrow(0, split_, n) : at::Tensor(),
                     s1.defined() ? s1.narrow(0, split_, n) : at::Tensor());
  host_stale_ = false;
}

int64_t OffloadedOptimizer::device_state_bytes() const {
  return device_ ? device_->state_bytes() : 0;
}

at::Tensor OffloadedOptimizer::allocate_master(int64_t numel, bool pin,
                                               const std::vector<std::vector<Segment>>& groups) {
  // Whole pages, so that locking them locks no page another allocation shares.
  const size_t bytes =
      (static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(float) + 4095) / 4096 * 4096;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    throw OutOfMemoryError(
        fmt::format("cannot allocate {} bytes of host memory for optimizer state", bytes));
  }
  kernels::adam_cpu_first_touch({static_cast<float*>(p)}, numel, groups);
  if (pin) {
    const std::string error = page_lock(p, bytes);
    if (!error.empty()) {
      std::free(p);
      throw OutOfMemoryError(
          fmt::format("cannot page-lock {} bytes of host memory for offloaded state: {} "
                      "(raise the locked-memory limit, `ulimit -l`, or free host memory)",
                      bytes, error));
    }
  }
  return at::from_blob(
      p, {numel},
      [pin](void* q) {
        if (pin) page_unlock(q);
        std::free(q);
      },
      at::TensorOptions().dtype(at::kFloat));
}

void OffloadedOptimizer::step(const UpdateHyper& h) {
  // Gradients come down through the pinned slots (bucket i into slot i % slots, the copy of
  // bucket i + slots queued once the CPU has read bucket i); as each lands, the CPU updates it
  // while the next ones are in flight, and its new masters go up while the CPU moves on. At
  // most two uploaded buckets wait to be published, bounding device scratch.
  CopyStream copies(e_.S.device);
  std::vector<const Bucket*> order, on_device;
  for (const Bucket& b : e_.layout.buckets) {
    if (b.trainable) (device_ && b.shard.offset >= split_ ? on_device : order).push_back(&b);
  }
  const size_t n = slots_.size();
  auto slot_of = [&](size_t i) { return slots_[i % n].narrow(0, 0, order[i]->shard_numel); };
  std::vector<int64_t> down(order.size(), -1);
  for (size_t i = 0; i < std::min(n, order.size()); ++i) {
    down[i] = copies.copy(slot_of(i), e_.slice_of(order[i]->index, e_.grad_acc));
  }
  e_.optimizer->begin_step();
  // The device share: queued behind the first downloads, run while the CPU updates its own.
  if (device_) {
    device_->set_state(e_.optimizer->steps(), at::Tensor(), at::Tensor());
    for (const Bucket* b : on_device) {
      const int64_t at = b->shard.offset - split_;
      device_->update(e_.slice_of(b->index, e_.grad_acc), h,
                      device_segments_[static_cast<size_t>(b->index)], at);
      e_.publish(*b, device_->master().narrow(0, at, b->shard_numel));
    }
    host_stale_ = true;
  }
  struct Upload {
    const Bucket* bucket;
    int64_t ticket;
    at::Tensor values;
  };
  std::deque<Upload> uploads;
  auto publish_oldest = [&] {
    Upload u = std::move(uploads.front());
    uploads.pop_front();
    copies.device_wait(u.ticket);
    e_.publish(*u.bucket, u.values);
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const Bucket& b = *order[i];
    copies.host_wait(down[i]);
    e_.optimizer->update(slot_of(i), h, e_.bucket_segments[static_cast<size_t>(b.index)],
                         b.shard.offset);
    if (i + n < order.size()) {
      down[i + n] = copies.copy(slot_of(i + n), e_.slice_of(order[i + n]->index, e_.grad_acc));
    }
    at::Tensor mine = e_.slice_of(b.index, e_.master);
    if (b.sharded_params && e_.S.offload_param) {
      e_.publish(b, mine);  // host to host
      continue;
    }
    at::Tensor up =
        at::empty({b.shard_numel}, at::TensorOptions().dtype(at::kFloat).device(e_.S.device));
    uploads.push_back(Upload{&b, copies.copy(up, mine), up});
    if (uploads.size() > 2) publish_oldest();
  }
  while (!uploads.empty()) publish_oldest();
}

}  // namespace zt::zero
