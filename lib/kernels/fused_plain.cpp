// The fused kernels without CUDA LibTorch: nothing applies, callers keep their ATen paths.
#include <c10/util/Exception.h>

#include "kernels/fused.hpp"

namespace zt::kernels {

bool fused_rms_norm_applies(const at::Tensor&, const at::Tensor&) {
  return false;
}

std::pair<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor&, const at::Tensor&, double,
                                                 bool) {
  TORCH_CHECK(
      false, "fused_rms_norm: this build has no CUDA kernels (check fused_rms_norm_applies first)");
}

std::pair<at::Tensor, at::Tensor> fused_rms_norm_backward(const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&,
                                                          bool, bool, bool) {
  TORCH_CHECK(false, "fused_rms_norm_backward: this build has no CUDA kernels");
}

bool fused_adamw_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&) {
  return false;
}

void fused_adamw(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const UpdateHyper&, const at::Tensor&) {
  TORCH_CHECK(false,
              "fused_adamw: this build has no CUDA kernels (check fused_adamw_applies first)");
}

bool fused_adamw_mixed_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&) {
  return false;
}

void fused_adamw_mixed(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const UpdateHyper&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "fused_adamw_mixed: this build has no CUDA kernels");
}

bool fused_rotary_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return false;
}

at::Tensor fused_rotary(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                        bool) {
  TORCH_CHECK(false, "fused_rotary: this build has no CUDA kernels");
}

bool fused_swiglu_applies(const at::Tensor&, const at::Tensor&) {
  return false;
}

at::Tensor fused_swiglu(const at::Tensor&, const at::Tensor&, bool) {
  TORCH_CHECK(false, "fused_swiglu: this build has no CUDA kernels");
}

std::pair<at::Tensor, at::Tensor> fused_swiglu_backward(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, bool, bool) {
  TORCH_CHECK(false, "fused_swiglu_backward: this build has no CUDA kernels");
}

bool fused_cross_entropy_applies(const at::Tensor&, const at::Tensor&) {
  return false;
}

at::Tensor fused_cross_entropy(const at::Tensor&, const at::Tensor&, bool, double) {
  TORCH_CHECK(false, "fused_cross_entropy: this build has no CUDA kernels");
}

bool fused_dequantize_applies(const at::Tensor&, int64_t) {
  return false;
}

at::Tensor fused_dequantize_4bit(const at::Tensor&, const at::Tensor&, const std::array<float, 16>&,
                                 int64_t, int64_t, at::ScalarType) {
  TORCH_CHECK(false, "fused_dequantize_4bit: this build has no CUDA kernels");
}

at::Tensor fused_dequantize_absmax(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&) {
  TORCH_CHECK(false, "fused_dequantize_absmax: this build has no CUDA kernels");
}

}  // namespace zt::kernels
