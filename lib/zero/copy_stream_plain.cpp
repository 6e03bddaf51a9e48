// CopyStream without CUDA LibTorch: copies happen at once.
#include "zero/copy_stream.hpp"

namespace zt::zero {

struct CopyStream::Impl {};

CopyStream::CopyStream(at::Device) : impl_(std::make_unique<Impl>()) {}
CopyStream::~CopyStream() = default;

int64_t CopyStream::copy(at::Tensor dst, at::Tensor src) {
  dst.copy_(src);
  return 0;
}

void CopyStream::copy_detached(at::Tensor dst, const at::Tensor& src) {
  dst.copy_(src);
}

void CopyStream::host_wait(int64_t) {}
void CopyStream::device_wait(int64_t) {}

std::string page_lock(void*, size_t) {
  return {};
}
void page_unlock(void*) {}

}  // namespace zt::zero
