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

cudaStream_t stream_of(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index());
}

// The kernels' constants from the update's hyper-parameters, formed in fp64.
gpu::AdamwArgs adamw_args(const UpdateHyper& h) {
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
  return a;
}

bool aligned(const at::Tensor& t, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}

// The stride between rows of t seen as [rows, t.size(-1)] (last dimension contiguous), if its
// leading dimensions collapse into one.
std::optional<int64_t> row_stride(const at::Tensor& t) {
  if (t.dim() < 1 || (t.size(-1) > 1 && t.stride(-1) != 1)) return std::nullopt;
  if (t.dim() == 1) return t.size(-1);
  for (int64_t k = 0; k + 2 < t.dim(); ++k) {
    if (t.size(k) > 1 && t.stride(k) != t.stride(k + 1) * t.size(k + 1)) return std::nullopt;
  }
  return t.stride(-2);
}

bool float_kind(const at::Tensor& t) {
  return scalar_of(t.scalar_type()).has_value();
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
                                                 double eps, bool unit_offset) {
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
                                    static_cast<float>(eps), unit_offset,
                                    at::cuda::getCurrentCUDAStream(x.device().index())),
              "the fused RMSNorm forward kernel");
  return {y, r};
}

std::pair<at::Tensor, at::Tensor> fused_rms_norm_backward(const at::Tensor& grad_y,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& r, bool want_x,
                                                          bool want_weight, bool unit_offset) {
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
  cuda::check(gpu::rms_norm_backward(scalar, g.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                     r.data_ptr<float>(), want_x ? grad_x.data_ptr() : nullptr,
                                     want_weight ? partial.data_ptr<float>() : nullptr, rows,
                                     hidden, blocks, unit_offset,
                                     at::cuda::getCurrentCUDAStream(x.device().index())),
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
  const gpu::AdamwArgs a = adamw_args(h);
  const bool vectorized =
      aligned16(param) && aligned16(grad) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  cuda::check(
      gpu::adamw(*scalar_of(param.scalar_type()), param.data_ptr(), grad.data_ptr(),
                 exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(), a,
                 grad_sq.defined() ? grad_sq.data_ptr<float>() : nullptr, vectorized,
                 sm_count(param.device()), at::cuda::getCurrentCUDAStream(param.device().index())),
      "the fused AdamW kernel");
}

bool fused_adamw_mixed_applies(const at::Tensor& master, const at::Tensor& grad,
                               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                               const at::Tensor& compute_copy) {
  if (!switched_on() || !master.is_cuda() || master.scalar_type() != at::kFloat) return false;
  if (grad.scalar_type() != at::kBFloat16 && grad.scalar_type() != at::kHalf) return false;
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    if (t->device() != master.device() || !t->is_contiguous()) return false;
  }
  if (exp_avg.scalar_type() != at::kFloat || exp_avg_sq.scalar_type() != at::kFloat) return false;
  if (compute_copy.defined() &&
      (compute_copy.device() != master.device() || !compute_copy.is_contiguous() ||
       compute_copy.scalar_type() != grad.scalar_type())) {
    return false;
  }
  return master.is_contiguous();
}

void fused_adamw_mixed(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const UpdateHyper& h,
                       const at::Tensor& grad_sq, const at::Tensor& compute_copy) {
  const int64_t n = master.numel();
  TORCH_CHECK(fused_adamw_mixed_applies(master, grad, exp_avg, exp_avg_sq, compute_copy) &&
                  grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n &&
                  (!compute_copy.defined() || compute_copy.numel() == n),
              "fused_adamw_mixed: tensors it does not handle");
  TORCH_CHECK(!grad_sq.defined() || (grad_sq.device() == master.device() &&
                                     grad_sq.scalar_type() == at::kFloat && grad_sq.numel() == 1),
              "fused_adamw_mixed: grad_sq must be one fp32 element on the masters' device");
  const c10::cuda::CUDAGuard guard(master.device());
  const bool vectorized = aligned(master, 16) && aligned(exp_avg, 16) && aligned(exp_avg_sq, 16) &&
                          aligned(grad, 8) && (!compute_copy.defined() || aligned(compute_copy, 8));
  cuda::check(
      gpu::adamw_mixed(*scalar_of(grad.scalar_type()), master.data_ptr<float>(), grad.data_ptr(),
                       exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                       compute_copy.defined() ? compute_copy.data_ptr() : nullptr, n, adamw_args(h),
                       grad_sq.defined() ? grad_sq.data_ptr<float>() : nullptr, vectorized,
                       sm_count(master.device()), stream_of(master)),
      "the fused AdamW kernel (fp32 masters)");
}

bool fused_rotary_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t rotary_dim) {
  if (!switched_on() || !x.is_cuda() || !float_kind(x) || x.dim() != 4) return false;
  const int64_t d = x.size(3);
  if (d % 2 != 0 || rotary_dim % 2 != 0 || rotary_dim <= 0 || rotary_dim > d) return false;
  // The kernel keeps a row's table in shared memory and indexes a row's heads in 32 bits.
  if (rotary_dim > 4096 || x.size(1) * d > (int64_t{1} << 30)) return false;
  if (x.stride(3) != 1 && d > 1) return false;
  for (const at::Tensor* t : {&cos, &sin}) {
    if (t->device() != x.device() || t->scalar_type() != x.scalar_type()) return false;
    if (t->size(-1) != rotary_dim || t->stride(-1) != 1) return false;
    if (t->dim() == 2) {
      if (t->size(0) != x.size(2)) return false;
    } else if (t->dim() == 4) {
      if ((t->size(0) != x.size(0) && t->size(0) != 1) || t->size(1) != 1 ||
          t->size(2) != x.size(2)) {
        return false;
      }
    } else {
      return false;
    }
  }
  return cos.strides() == sin.strides();
}

at::Tensor fused_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t rotary_dim, bool interleaved, bool backward) {
  TORCH_CHECK(fused_rotary_applies(x, cos, sin, rotary_dim),
              "fused_rotary: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(x.device());
  gpu::RotaryArgs a;
  a.batch = x.size(0);
  a.heads = x.size(1);
  a.tokens = x.size(2);
  a.head_dim = x.size(3);
  a.rotary_dim = rotary_dim;
  a.x_stride[0] = x.stride(0);
  a.x_stride[1] = x.stride(1);
  a.x_stride[2] = x.stride(2);
  if (cos.dim() == 2) {
    a.cs_stride[0] = 0;
    a.cs_stride[1] = cos.stride(0);
  } else {
    a.cs_stride[0] = cos.size(0) == 1 ? 0 : cos.stride(0);
    a.cs_stride[1] = cos.stride(2);
  }
  a.interleaved = interleaved;
  a.backward = backward;
  at::Tensor out = at::empty({a.batch, a.tokens, a.heads, a.head_dim}, x.options());
  cuda::check(gpu::rotary(*scalar_of(x.scalar_type()), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          out.data_ptr(), a, stream_of(x)),
              "the fused rotary embedding kernel");
  return out.transpose(1, 2);
}

bool fused_swiglu_applies(const at::Tensor& gate, const at::Tensor& up) {
  if (!switched_on() || !gate.is_cuda() || !float_kind(gate)) return false;
  if (up.device() != gate.device() || up.scalar_type() != gate.scalar_type() ||
      up.sizes() != gate.sizes()) {
    return false;
  }
  return row_stride(gate).has_value() && row_stride(up).has_value();
}

at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up, bool gelu) {
  TORCH_CHECK(fused_swiglu_applies(gate, up), "fused_swiglu: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t cols = gate.size(-1), rows = cols == 0 ? 0 : gate.numel() / cols;
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  cuda::check(gpu::swiglu_forward(*scalar_of(gate.scalar_type()), gelu, gate.data_ptr(),
                                  up.data_ptr(), out.data_ptr(), rows, cols, *row_stride(gate),
                                  *row_stride(up), stream_of(gate)),
              "the fused SwiGLU kernel");
  return out;
}

std::pair<at::Tensor, at::Tensor> fused_swiglu_backward(const at::Tensor& grad,
                                                        const at::Tensor& gate,
                                                        const at::Tensor& up, bool halves,
                                                        bool gelu) {
  TORCH_CHECK(fused_swiglu_applies(gate, up) && grad.sizes() == gate.sizes(),
              "fused_swiglu_backward: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g =
      grad.scalar_type() == gate.scalar_type() ? grad.contiguous() : grad.to(gate.scalar_type());
  const int64_t cols = gate.size(-1), rows = cols == 0 ? 0 : gate.numel() / cols;
  at::Tensor grad_gate, grad_up, both;
  int64_t gate_stride = cols, up_stride = cols;
  if (halves) {
    std::vector<int64_t> shape = gate.sizes().vec();
    shape.back() = 2 * cols;
    both = at::empty(shape, gate.options());
    grad_gate = both.narrow(-1, 0, cols);
    grad_up = both.narrow(-1, cols, cols);
    gate_stride = up_stride = 2 * cols;
  } else {
    grad_gate = at::empty(gate.sizes(), gate.options());
    grad_up = at::empty(gate.sizes(), gate.options());
  }
  cuda::check(gpu::swiglu_backward(*scalar_of(gate.scalar_type()), gelu, g.data_ptr(),
                                   gate.data_ptr(), up.data_ptr(), grad_gate.data_ptr(),
                                   grad_up.data_ptr(), rows, cols, *row_stride(gate),
                                   *row_stride(up), gate_stride, up_stride, stream_of(gate)),
              "the fused SwiGLU backward kernel");
  if (halves) return {both, at::Tensor()};
  return {grad_gate, grad_up};
}

bool fused_cross_entropy_applies(const at::Tensor& logits, const at::Tensor& labels) {
  return switched_on() && logits.is_cuda() && float_kind(logits) && logits.dim() == 2 &&
         logits.is_contiguous() && labels.device() == logits.device() &&
         labels.scalar_type() == at::kLong && labels.dim() == 1 &&
         labels.size(0) == logits.size(0) && labels.is_contiguous();
}

at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& labels, bool write_grad,
                               double softcap) {
  TORCH_CHECK(fused_cross_entropy_applies(logits, labels),
              "fused_cross_entropy: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  cuda::check(gpu::cross_entropy(*scalar_of(logits.scalar_type()), logits.data_ptr(),
                                 labels.data_ptr<int64_t>(), loss.data_ptr<float>(), logits.size(0),
                                 logits.size(1), write_grad, static_cast<float>(softcap),
                                 stream_of(logits)),
              "the fused cross-entropy kernel");
  return loss;
}

bool fused_dequantize_applies(const at::Tensor& codes, int64_t blocksize) {
  return switched_on() && codes.is_cuda() && codes.scalar_type() == at::kByte &&
         codes.is_contiguous() && blocksize > 0 && (blocksize & (blocksize - 1)) == 0;
}

at::Tensor fused_dequantize_4bit(const at::Tensor& codes, const at::Tensor& absmax,
                                 const std::array<float, 16>& table, int64_t blocksize,
                                 int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(fused_dequantize_applies(codes, blocksize) && scalar_of(dtype) &&
                  codes.numel() == (numel + 1) / 2 && absmax.scalar_type() == at::kFloat &&
                  absmax.is_contiguous() && absmax.device() == codes.device() &&
                  absmax.numel() == (numel + blocksize - 1) / blocksize,
              "fused_dequantize_4bit: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor out = at::empty({numel}, codes.options().dtype(dtype));
  gpu::FourBitTable t{};
  std::memcpy(t.v, table.data(), sizeof(t.v));
  int log2_block = 0;
  while ((int64_t{1} << log2_block) < blocksize) ++log2_block;
  cuda::check(
      gpu::dequantize_4bit(*scalar_of(dtype), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                           t, out.data_ptr(), numel, log2_block, stream_of(codes)),
      "the 4-bit dequantization kernel");
  return out;
}

at::Tensor fused_dequantize_absmax(const at::Tensor& q, const at::Tensor& nested,
                                   const at::Tensor& code, const at::Tensor& offset) {
  TORCH_CHECK(fused_dequantize_applies(q, 256) && nested.scalar_type() == at::kFloat &&
                  code.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat &&
                  code.numel() == 256 && offset.numel() == 1 &&
                  nested.numel() == (q.numel() + 255) / 256 && nested.is_contiguous() &&
                  code.is_contiguous() && nested.device() == q.device() &&
                  code.device() == q.device() && offset.device() == q.device(),
              "fused_dequantize_absmax: tensors it does not handle");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.numel()}, q.options().dtype(at::kFloat));
  cuda::check(gpu::dequantize_absmax(q.data_ptr<uint8_t>(), nested.data_ptr<float>(),
                                     code.data_ptr<float>(), offset.data_ptr<float>(),
                                     out.data_ptr<float>(), q.numel(), stream_of(q)),
              "the absmax dequantization kernel");
  return out;
}

}  // namespace zt::kernels
