// Host<->device copies on a side stream, so offloaded optimizer steps overlap their transfers
// with host work and offloaded parameters come up while the GPU computes. With a CUDA LibTorch
// (copy_stream_cuda.cpp) copies run on a pool stream and are tracked by events; elsewhere
// (copy_stream_plain.cpp) they are plain synchronous copies.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

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
  /// Makes the compute stream wait for the ticket's copy (no host sync). The copy's tensors are
  /// then no longer held (later compute-stream work is ordered after it), and tickets waited for
  /// in the order they were made are forgotten, so a long-lived CopyStream stays small.
  void device_wait(int64_t ticket);
  /// Enqueues dst.copy_(src) as copy() does, holding neither: the device memory of `src` is
  /// marked in use by this stream, so the caching allocator reuses it only once the copy ran,
  /// and `dst` (page-locked host memory from the caching host allocator) is tracked the same
  /// way. For activations sent to the host, whose device copy is dropped at once.
  void copy_detached(at::Tensor dst, const at::Tensor& src);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// EngineOptions::offload_activations' copies and the bytes of activations on the host now and
/// at most; shared by the engine and the unit calls, which may outlive it.
struct ActivationHost {
  ActivationHost(at::Device device, int64_t limit) : copies(device), limit(limit) {}
  CopyStream copies;
  std::atomic<int64_t> bytes{0}, peak{0};
  /// EngineOptions::offload_activations_host_bytes, resolved: what passes it stays on the device.
  const int64_t limit;
};

/// Page-locks host memory [p, p + bytes) where it lies (cudaHostRegister), so that GPU copies
/// from and to it run at pinned speed without moving its pages; page_unlock undoes it before the
/// memory is freed. Returns an error message, empty on success. Without CUDA LibTorch there is
/// no GPU to copy to: both do nothing.
std::string page_lock(void* p, size_t bytes);
void page_unlock(void* p);

}  // namespace zt::zero
