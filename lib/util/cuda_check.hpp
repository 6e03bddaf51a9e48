// The one way zerotrain checks a CUDA runtime call (translation units built with CUDA only):
//
//     ZT_CUDA_CHECK(cudaStreamWaitEvent(stream, event, 0));
//     cuda::check(gpu::adamw(...), "the fused AdamW kernel");   // names what failed
//
// throws OutOfMemoryError for an allocation failure and zt::Error otherwise, naming the call,
// CUDA's error name and text, and the place. Calls whose failure is an answer rather than an
// error (a size estimate, an optional page-lock) read the status themselves and clear it with
// cudaGetLastError().
#pragma once

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::cuda {

[[noreturn]] inline void throw_error(cudaError_t e, const char* call, const char* file, int line) {
  const std::string where = *file != '\0' ? fmt::format(" ({}:{})", file, line) : "";
  const std::string msg = fmt::format("CUDA error {} ({}) in {}{}", cudaGetErrorName(e),
                                      cudaGetErrorString(e), call, where);
  if (e == cudaErrorMemoryAllocation) throw OutOfMemoryError(msg);
  throw Error(msg);
}

/// Throws as ZT_CUDA_CHECK does, naming `what` instead of the call's text.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw_error(e, what, "", 0);
}

}  // namespace zt::cuda

#define ZT_CUDA_CHECK(expr)                                                \
  do {                                                                     \
    const cudaError_t zt_cuda_status_ = (expr);                            \
    if (zt_cuda_status_ != cudaSuccess)                                    \
      ::zt::cuda::throw_error(zt_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (0)
