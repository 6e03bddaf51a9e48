// CopyStream with CUDA LibTorch: a pool stream, one event per copy.
//
// Each copy first waits (device-side) for an event recorded on the compute stream, so it sees
// every kernel that produced its source; its own completion event lets the host or the compute
// stream wait for exactly that copy.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <deque>
#include <memory>

#include "zero/copy_stream.hpp"

namespace zt::zero {

struct CopyStream::Impl {
  at::Device device;
  c10::cuda::CUDAStream stream;
  struct Ticket {
    std::shared_ptr<at::cuda::CUDAEvent> done;
    at::Tensor dst, src;
    bool waited_on_device = false;
  };
  std::deque<Ticket> tickets;  ///< ticket ids first, first + 1, ...
  int64_t first = 0;
  explicit Impl(at::Device d)
      : device(d), stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d.index())) {}
  Ticket& ticket(int64_t id) { return tickets[static_cast<size_t>(id - first)]; }
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
  return I.first + static_cast<int64_t>(I.tickets.size()) - 1;
}

void CopyStream::copy_detached(at::Tensor dst, const at::Tensor& src) {
  Impl& I = *impl_;
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(I.device.index()));
  c10::cuda::CUDAStreamGuard guard(I.stream);
  ready.block(I.stream);
  dst.copy_(src, /*non_blocking=*/true);  // records the pinned block's use on I.stream
  if (src.is_cuda())
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), I.stream);
}

void CopyStream::host_wait(int64_t ticket) {
  impl_->ticket(ticket).done->synchronize();
}

void CopyStream::device_wait(int64_t ticket) {
  Impl& I = *impl_;
  Impl::Ticket& t = I.ticket(ticket);
  t.done->block(c10::cuda::getCurrentCUDAStream(I.device.index()));
  t.dst.reset();
  t.src.reset();
  t.waited_on_device = true;
  while (!I.tickets.empty() && I.tickets.front().waited_on_device) {
    I.tickets.pop_front();
    ++I.first;
  }
}

std::string page_lock(void* p, size_t bytes) {
  const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (e == cudaSuccess) return {};
  (void)cudaGetLastError();  // clear it: the caller reports it
  return cudaGetErrorString(e);
}

void page_unlock(void* p) {
  cudaHostUnregister(p);
}

}  // namespace zt::zero
