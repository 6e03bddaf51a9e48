// cuda_glue for a CPU LibTorch (CI): there are no LibTorch CUDA streams to follow.
#include "comm/cuda_glue.hpp"

namespace zt::cuda_glue {

cudaStream_t current_stream(int /*device*/) {
  return cudaStreamLegacy;
}

bool torch_has_cuda() {
  return false;
}

}  // namespace zt::cuda_glue
