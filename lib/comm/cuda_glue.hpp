// The thin seam between the NCCL backend (plain CUDA runtime + NCCL) and LibTorch's CUDA
// streams. With a CUDA LibTorch it returns LibTorch's current stream; with a CPU LibTorch (CI),
// where no CUDA tensor can exist, the legacy default stream, so the backend still compiles and
// links there.
#pragma once

#include <cuda_runtime_api.h>

namespace zt::cuda_glue {

/// The stream LibTorch's kernels on `device` are enqueued on for the calling thread.
cudaStream_t current_stream(int device);

/// True when this LibTorch can run CUDA tensors.
bool torch_has_cuda();

}  // namespace zt::cuda_glue
