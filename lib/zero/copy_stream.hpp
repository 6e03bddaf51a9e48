// Host<->device copies on a side stream, so offloaded optimizer steps overlap their transfers
// with host work. With a CUDA LibTorch (copy_stream_cuda.cpp) copies run on a pool stream and
// are tracked by events; elsewhere (copy_stream_plain.cpp) they are plain synchronous copies.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace zt::zero {

class CopyStream {
 public:
  /// `device`: the compute device whose current stream the copies are ordered after.
  explicit CopyStream(at::Device device);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  /// Enqueues dst.copy_(src) after everything already queued on the compute stream. Both stay
  /// referenced until the copy finished. Returns a ticket.
  int64_t copy(at::Tensor dst, at::Tensor src);
  /// Blocks the host until the ticket's copy finished.
  void host_wait(int64_t ticket);
  /// Makes the compute stream wait for the ticket's copy (no host sync).
  void device_wait(int64_t ticket);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// `numel` floats of host memory, owned by the returned tensor, that `touch` writes first (it
/// must write every element: fresh pages land in the memory of the thread that first writes
/// them), then — with `pin`, in a CUDA build — page-locked where they are (cudaHostRegister),
/// so that GPU copies run at pinned speed without moving them. Throws OutOfMemoryError when
/// the memory cannot be had or locked.
at::Tensor placed_host_floats(int64_t numel, bool pin, const std::function<void(float*)>& touch);

}  // namespace zt::zero
