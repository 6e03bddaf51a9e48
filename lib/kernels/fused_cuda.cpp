// The fused kernels with CUDA LibTorch: checks, allocation, the current stream, launch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "kernels/fused.hpp"
#include "kernels/gpu_kernels.hpp"
#include "util/cuda_check.hpp"

namespace zt::kernels {
namespace {

bool switched_on() {
  static const bool on = [] {
    const char* v = std::getenv("ZT_FUSED_KERNELS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

std::optional<gpu::Scalar> scalar_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return gpu::Scalar::kFloat32;
    case at::kHalf:
      return gpu::Scalar::kFloat16;
    case at::kBFloat16:
      return gpu::Scalar::kBFloat16;
    default:
      return std::nullopt;
  }
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

int sm_count(const at::Device& device) {
  return at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
}

}  // namespace

bool fused_rms_norm_applies(const at::Tensor& x, const at::Tensor& weight) {
  if (!switched_on() || !x.is_cuda() || x.dim() < 1 || x.numel() == 0) return false;
  const auto scalar = scalar_of(x.scalar_type());
  return scalar && weight.device() == x.device() && weight.scalar_type() == x.scalar_type() &&
         weight.dim() == 1 && weight.numel() == x.size(-1) && x.is_contiguous() &&
         weight.is_contiguous() && aligned16(x) && aligned16(weight) &&
         gpu::rms_norm_supports(*scalar, x.size(-1));
}

std::pair<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps) {
  TORCH_CHECK(fused_rms_norm_applies(x, weight), "fused_rms_norm: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  std::vector<int64_t> r_shape = x.sizes().vec();
  r_shape.back() = 1;
  at::Tensor r = at::empty(r_shape, x.options().dtype(at::kFloat));
  cuda::check(gpu::rms_norm_forward(*scalar_of(x.scalar_type()), x.data_ptr(), weight.data_ptr(),
                                    y.data_ptr(), r.data_ptr<float>(), rows, hidden,
                                    static_cast<float>(eps),
                                    at::cuda::getCurrentCUDAStream(x.device().index())),
              "the fused RMSNorm forward kernel");
  return {y, r};
}

std::pair<at::Tensor, at::Tensor> fused_rms_norm_backward(const at::Tensor& grad_y,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& r, bool want_x,
                                                          bool want_weight) {
  TORCH_CHECK(fused_rms_norm_applies(x, weight) && r.scalar_type() == at::kFloat &&
                  r.is_contiguous() && r.numel() * x.size(-1) == x.numel() &&
                  grad_y.sizes() == x.sizes(),
              "fused_rms_norm_backward: tensors it does not handle");
  if (!want_x && !want_weight) return {};
  const c10::cuda::CUDAGuard guard(x.device());
  // Autograd's incoming gradient may be a view or strided; the kernel reads whole aligned rows.
  at::Tensor g =
      grad_y.scalar_type() == x.scalar_type() ? grad_y.contiguous() : grad_y.to(x.scalar_type());
  if (!aligned16(g)) g = g.clone();
  const gpu::Scalar scalar = *scalar_of(x.scalar_type());
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  const int blocks = gpu::rms_norm_backward_blocks(scalar, rows, hidden, sm_count(x.device()));
  at::Tensor grad_x = want_x ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor partial =
      want_weight ? at::empty({blocks, hidden}, x.options().dtype(at::kFloat)) : at::Tensor();
  cuda::check(
      gpu::rms_norm_backward(scalar, g.data_ptr(), x.data_ptr(), weight.data_ptr(),
                             r.data_ptr<float>(), want_x ? grad_x.data_ptr() : nullptr,
                             want_weight ? partial.data_ptr<float>() : nullptr, rows, hidden,
                             blocks, at::cuda::getCurrentCUDAStream(x.device().index())),
      "the fused RMSNorm backward kernel");
  at::Tensor grad_weight = want_weight ? partial.sum(0).to(weight.scalar_type()) : at::Tensor();
  return {grad_x, grad_weight};
}

bool fused_adamw_applies(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq) {
  if (!switched_on() || !param.is_cuda() || !scalar_of(param.scalar_type())) return false;
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    if (t->device() != param.device() || t->scalar_type() != param.scalar_type() ||
        !t->is_contiguous()) {
      return false;
    }
  }
  return param.is_contiguous();
}

void fused_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const UpdateHyper& h, const at::Tensor& grad_sq) {
  TORCH_CHECK(fused_adamw_applies(param, grad, exp_avg, exp_avg_sq) &&
                  grad.numel() == param.numel() && exp_avg.numel() == param.numel() &&
                  exp_avg_sq.numel() == param.numel(),
              "fused_adamw: tensors it does not handle");
  TORCH_CHECK(!grad_sq.defined() || (grad_sq.device() == param.device() &&
                                     grad_sq.scalar_type() == at::kFloat && grad_sq.numel() == 1),
              "fused_adamw: grad_sq must be one fp32 element on the parameters' device");
  const c10::cuda::CUDAGuard guard(param.device());
  const double steps = static_cast<double>(h.step);
  gpu::AdamwArgs a;
  a.decay = static_cast<float>(h.lr * h.weight_decay);
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  a.step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.beta1, steps)));
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, steps)));
  a.eps = static_cast<float>(h.eps);
  a.grad_scale = static_cast<float>(h.grad_scale);
  const bool vectorized =
      aligned16(param) && aligned16(grad) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  cuda::check(
      gpu::adamw(*scalar_of(param.scalar_type()), param.data_ptr(), grad.data_ptr(),
                 exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(), a,
                 grad_sq.defined() ? grad_sq.data_ptr<float>() : nullptr, vectorized,
                 sm_count(param.device()), at::cuda::getCurrentCUDAStream(param.device().index())),
      "the fused AdamW kernel");
}

}  // namespace zt::kernels
