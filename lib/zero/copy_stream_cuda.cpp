// CopyStream with CUDA LibTorch: a pool stream, one event per copy.
//
// Each copy first waits (device-side) for an event recorded on the compute stream, so it sees
// every kernel that produced its source; its own completion event lets the host or the compute
// stream wait for exactly that copy.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#include "zero/copy_stream.hpp"
#include "zerotrain/error.hpp"

namespace zt::zero {

struct CopyStream::Impl {
  at::Device device;
  c10::cuda::CUDAStream stream;
  struct Ticket {
    std::shared_ptr<at::cuda::CUDAEvent> done;
    at::Tensor dst, src;
  };
  std::vector<Ticket> tickets;
  explicit Impl(at::Device d)
      : device(d), stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d.index())) {}
};

CopyStream::CopyStream(at::Device device) : impl_(std::make_unique<Impl>(device)) {}
CopyStream::~CopyStream() {
  for (auto& t : impl_->tickets) t.done->synchronize();
}

int64_t CopyStream::copy(at::Tensor dst, at::Tensor src) {
  Impl& I = *impl_;
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(I.device.index()));
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  {
    c10::cuda::CUDAStreamGuard guard(I.stream);
    ready.block(I.stream);
    dst.copy_(src, /*non_blocking=*/true);
    done->record(I.stream);
  }
  I.tickets.push_back(Impl::Ticket{done, dst, src});
  return static_cast<int64_t>(I.tickets.size()) - 1;
}

void CopyStream::host_wait(int64_t ticket) {
  Impl::Ticket& t = impl_->tickets[static_cast<size_t>(ticket)];
  t.done->synchronize();
}

void CopyStream::device_wait(int64_t ticket) {
  Impl::Ticket& t = impl_->tickets[static_cast<size_t>(ticket)];
  t.done->block(c10::cuda::getCurrentCUDAStream(impl_->device.index()));
}

at::Tensor placed_host_floats(int64_t numel, bool pin, const std::function<void(float*)>& touch) {
  void* p = nullptr;
  // Whole pages, so that registering locks no page another allocation shares.
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(float) + 4095) / 4096 * 4096;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    throw OutOfMemoryError(fmt::format("cannot allocate {} bytes of host memory for optimizer state", bytes));
  }
  touch(static_cast<float*>(p));
  if (pin) {
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      std::free(p);
      (void)cudaGetLastError();
      throw OutOfMemoryError(fmt::format("cannot page-lock {} bytes of host memory for offloaded state: {} "
                                         "(raise the locked-memory limit, `ulimit -l`, or free host memory)",
                                         bytes, cudaGetErrorString(e)));
    }
  }
  return at::from_blob(
      p, {numel},
      [pin](void* q) {
        if (pin) cudaHostUnregister(q);
        std::free(q);
      },
      at::TensorOptions().dtype(at::kFloat));
}

}  // namespace zt::zero
