// CopyStream without CUDA LibTorch: copies happen at once.
#include "zero/copy_stream.hpp"

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::zero {

struct CopyStream::Impl {};

CopyStream::CopyStream(at::Device) : impl_(std::make_unique<Impl>()) {}
CopyStream::~CopyStream() = default;

int64_t CopyStream::copy(at::Tensor dst, at::Tensor src) {
  dst.copy_(src);
  return 0;
}

void CopyStream::host_wait(int64_t) {}
void CopyStream::device_wait(int64_t) {}

at::Tensor placed_host_floats(int64_t numel, bool /*pin: no GPU to copy to*/,
                              const std::function<void(float*)>& touch) {
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(float);
  if (posix_memalign(&p, 4096, bytes) != 0) {
    throw OutOfMemoryError(fmt::format("cannot allocate {} bytes of host memory for optimizer state", bytes));
  }
  touch(static_cast<float*>(p));
  return at::from_blob(p, {numel}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace zt::zero
