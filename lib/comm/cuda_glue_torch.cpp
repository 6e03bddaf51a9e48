// cuda_glue for a CUDA LibTorch: LibTorch's current stream.
#include <c10/cuda/CUDAStream.h>

#include "comm/cuda_glue.hpp"

namespace zt::cuda_glue {

cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

bool torch_has_cuda() {
  return true;
}

}  // namespace zt::cuda_glue
