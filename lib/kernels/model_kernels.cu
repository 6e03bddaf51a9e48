// The decoder's memory-bound steps as single passes (see gpu_kernels.hpp): rotary embedding,
// the gated MLP's activation (SwiGLU, GeGLU) and the cross-entropy of one chunk of logits (soft-
// capped or not).
//
// Why not ATen ops: transformers' rotary embedding is eight kernels per tensor (two products,
// a negation, a concatenation, a sum — on a transposed view, so in ATen's non-vectorized loop),
// SwiGLU three with a saved activation more than its backward needs, and the loss turns bf16
// logits into fp32 and walks them five times. Each kernel keeps the roundings of the ATen
// expression it replaces, so results match transformers' to the bit where the arithmetic
// order is the same (the loss's logsumexp sums in another order: a few ulps).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "kernels/gpu_common.cuh"
#include "kernels/gpu_kernels.hpp"

namespace zt::kernels::gpu {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t work, int per_thread = 1) {
  const int64_t threads = (work + per_thread - 1) / per_thread;
  return static_cast<unsigned>(std::max<int64_t>(1, (threads + kThreads - 1) / kThreads));
}

// ---- rotary embedding ---------------------------------------------------------------------
// One block per (batch, token) row: its cos / sin entries go to shared memory once, then the
// block's threads walk the row's heads × pairs of rotated dimensions (or two passed-through
// ones) with 32-bit index arithmetic — per-element 64-bit divisions made the first version of
// this kernel five times slower than the memory traffic. Forward, as `x * cos + rotate(x) * sin`
// rounds:
//   y_i = r(r(x_i c_i) − r(x_j s_i)),  y_j = r(r(x_j c_j) + r(x_i s_j));
// backward, as autograd of it rounds (rotate's transpose moves the sin products):
//   dx_i = r(r(g_i c_i) + r(g_j s_j)), dx_j = r(r(g_j c_j) − r(g_i s_i)).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const T* __restrict__ x, const T* __restrict__ cos_t, const T* __restrict__ sin_t,
                  T* __restrict__ out, RotaryArgs a) {
  extern __shared__ float table[];  // [rotary_dim] cos, then [rotary_dim] sin
  const int half_dim = static_cast<int>(a.head_dim / 2), pairs = static_cast<int>(a.rotary_dim / 2);
  const int rotary_dim = static_cast<int>(a.rotary_dim), heads = static_cast<int>(a.heads);
  const int work = heads * half_dim;
  const int64_t rows = a.batch * a.tokens;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = row % a.tokens, b = row / a.tokens;
    const int64_t cs = b * a.cs_stride[0] + t * a.cs_stride[1];
    __syncthreads();  // the previous row's readers are done with the table
    for (int k = threadIdx.x; k < rotary_dim; k += blockDim.x) {
      table[k] = to_float(cos_t[cs + k]);
      table[rotary_dim + k] = to_float(sin_t[cs + k]);
    }
    __syncthreads();
    const T* x_row = x + b * a.x_stride[0] + t * a.x_stride[2];
    T* out_row = out + row * a.heads * a.head_dim;  // out is [B, T, H, D]
    for (int w = threadIdx.x; w < work; w += blockDim.x) {
      const int h = w / half_dim, slot = w - h * half_dim;
      const T* xr = x_row + h * a.x_stride[1];
      T* o = out_row + h * static_cast<int>(a.head_dim);
      if (slot >= pairs) {  // past the rotary dimensions: copied
        const int d = rotary_dim + 2 * (slot - pairs);
        o[d] = xr[d];
        o[d + 1] = xr[d + 1];
        continue;
      }
      const int i = a.interleaved ? 2 * slot : slot;
      const int j = a.interleaved ? 2 * slot + 1 : slot + pairs;
      const float ci = table[i], cj = table[j];
      const float si = table[rotary_dim + i], sj = table[rotary_dim + j];
      const float xi = to_float(xr[i]), xj = to_float(xr[j]);
      // __fmul_rn: products rounded on their own, never contracted into an FMA with the sum
      // (for fp32, where `rounded` is the identity, ATen's separate kernels round each).
      if (!a.backward) {
        o[i] = from_float<T>(rounded<T>(__fmul_rn(xi, ci)) - rounded<T>(__fmul_rn(xj, si)));
        o[j] = from_float<T>(rounded<T>(__fmul_rn(xj, cj)) + rounded<T>(__fmul_rn(xi, sj)));
      } else {
        o[i] = from_float<T>(rounded<T>(__fmul_rn(xi, ci)) + rounded<T>(__fmul_rn(xj, sj)));
        o[j] = from_float<T>(rounded<T>(__fmul_rn(xj, cj)) - rounded<T>(__fmul_rn(xi, si)));
      }
    }
  }
}

template <typename T>
void launch_rotary(const void* x, const void* c, const void* s, void* out, const RotaryArgs& a,
                   cudaStream_t stream) {
  const int64_t rows = a.batch * a.tokens;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 1 << 20));
  const size_t table_bytes = 2 * static_cast<size_t>(a.rotary_dim) * sizeof(float);
  rotary_kernel<T><<<blocks, kThreads, table_bytes, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(c), static_cast<const T*>(s),
      static_cast<T*>(out), a);
}

// ---- SwiGLU -------------------------------------------------------------------------------
// ATen's silu and its backward, in fp32 from values of dtype T (the same expressions as
// ATen's kernels, so nvcc contracts them alike).
__device__ __forceinline__ float silu(float g) {
  return g / (1.f + expf(-g));
}
__device__ __forceinline__ float silu_grad(float d, float g) {
  const float s = 1.f / (1.f + expf(-g));
  return d * s * (1.f + g * (1.f - s));
}

// ATen's gelu(approximate="tanh") and its backward in fp32 (GeGLU: Gemma's gelu_pytorch_tanh).
constexpr float kGeluBeta = 0.7978845608028654f;  // √2 · (2 / √π) · ½ = √(2 / π)
constexpr float kGeluKappa = 0.044715f;
__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = kGeluBeta * (x + kGeluKappa * (x * x * x));
  return 0.5f * x * (1.f + tanhf(inner));
}
__device__ __forceinline__ float gelu_tanh_grad(float d, float x) {
  const float x_sq = x * x;
  const float inner = kGeluBeta * (x + kGeluKappa * x_sq * x);
  const float t = tanhf(inner);
  const float left = 0.5f * x, right = 1.f + t;
  const float left_derivative = 0.5f * right;
  const float right_derivative =
      left * (1.f - t * t) * (kGeluBeta * (1.f + 3.f * kGeluKappa * x_sq));
  return d * (left_derivative + right_derivative);
}

// The gate's activation and its gradient: silu (SwiGLU) or gelu-tanh (GeGLU).
template <bool kGelu>
__device__ __forceinline__ float activate(float g) {
  if constexpr (kGelu) {
    return gelu_tanh(g);
  } else {
    return silu(g);
  }
}
template <bool kGelu>
__device__ __forceinline__ float activate_grad(float d, float g) {
  if constexpr (kGelu) {
    return gelu_tanh_grad(d, g);
  } else {
    return silu_grad(d, g);
  }
}

// V elements per thread (a 16-byte pack where rows allow it, else one).
template <typename T, int V>
struct Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load(const T* p) {
  if constexpr (V == 1) {
    return Vec<T, V>{{*p}};
  } else {
    static_assert(sizeof(Vec<T, V>) == 16, "a vector is one 16-byte pack");
    const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(p);
    Vec<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = pk.v[k];
    return out;
  }
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Vec<T, V>& x) {
  if constexpr (V == 1) {
    *p = x.v[0];
  } else {
    Pack<T> pk;
#pragma unroll
    for (int k = 0; k < V; ++k) pk.v[k] = x.v[k];
    *reinterpret_cast<Pack<T>*>(p) = pk;
  }
}

// a = r(r(act(g)) · u)
template <typename T, int V, bool kGelu>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                          int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride) {
  const int64_t per_row = cols / V, total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / per_row, col = (idx % per_row) * V;
    const Vec<T, V> g = load<T, V>(gate + row * gate_stride + col);
    const Vec<T, V> u = load<T, V>(up + row * up_stride + col);
    Vec<T, V> a;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      a.v[k] = from_float<T>(rounded<T>(activate<kGelu>(to_float(g.v[k]))) * to_float(u.v[k]));
    }
    store<T, V>(out + row * cols + col, a);
  }
}

// With s = r(act(g)): d_u = r(d · s); d_g = r(act'(r(d · u), g)) — mul's backward, then act's.
template <typename T, int V, bool kGelu>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gate,
                           const T* __restrict__ up, T* __restrict__ grad_gate,
                           T* __restrict__ grad_up, int64_t rows, int64_t cols, int64_t gate_stride,
                           int64_t up_stride, int64_t grad_gate_stride, int64_t grad_up_stride) {
  const int64_t per_row = cols / V, total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / per_row, col = (idx % per_row) * V;
    const Vec<T, V> d = load<T, V>(grad + row * cols + col);
    const Vec<T, V> g = load<T, V>(gate + row * gate_stride + col);
    const Vec<T, V> u = load<T, V>(up + row * up_stride + col);
    Vec<T, V> dg, du;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float df = to_float(d.v[k]), gf = to_float(g.v[k]);
      du.v[k] = from_float<T>(df * rounded<T>(activate<kGelu>(gf)));
      dg.v[k] = from_float<T>(activate_grad<kGelu>(rounded<T>(df * to_float(u.v[k])), gf));
    }
    store<T, V>(grad_gate + row * grad_gate_stride + col, dg);
    store<T, V>(grad_up + row * grad_up_stride + col, du);
  }
}

template <typename T>
bool packs_fit(int64_t cols, std::initializer_list<int64_t> strides,
               std::initializer_list<const void*> pointers) {
  constexpr int V = Pack<T>::kN;
  if (cols % V != 0) return false;
  for (int64_t s : strides) {
    if (s % V != 0) return false;
  }
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

template <typename T, bool kGelu>
void launch_swiglu_forward(const void* gate, const void* up, void* out, int64_t rows, int64_t cols,
                           int64_t gs, int64_t us, cudaStream_t stream) {
  constexpr int V = Pack<T>::kN;
  const auto* g = static_cast<const T*>(gate);
  const auto* u = static_cast<const T*>(up);
  auto* o = static_cast<T*>(out);
  const unsigned blocks = std::min<unsigned>(blocks_for(rows * cols, V), 65535u * 16u);
  if (packs_fit<T>(cols, {gs, us}, {gate, up, out})) {
    swiglu_forward_kernel<T, V, kGelu>
        <<<blocks, kThreads, 0, stream>>>(g, u, o, rows, cols, gs, us);
  } else {
    swiglu_forward_kernel<T, 1, kGelu>
        <<<blocks, kThreads, 0, stream>>>(g, u, o, rows, cols, gs, us);
  }
}

template <typename T, bool kGelu>
void launch_swiglu_backward(const void* grad, const void* gate, const void* up, void* grad_gate,
                            void* grad_up, int64_t rows, int64_t cols, int64_t gs, int64_t us,
                            int64_t ggs, int64_t gus, cudaStream_t stream) {
  constexpr int V = Pack<T>::kN;
  const auto* d = static_cast<const T*>(grad);
  const auto* g = static_cast<const T*>(gate);
  const auto* u = static_cast<const T*>(up);
  auto* dg = static_cast<T*>(grad_gate);
  auto* du = static_cast<T*>(grad_up);
  const unsigned blocks = std::min<unsigned>(blocks_for(rows * cols, V), 65535u * 16u);
  if (packs_fit<T>(cols, {gs, us, ggs, gus}, {grad, gate, up, grad_gate, grad_up})) {
    swiglu_backward_kernel<T, V, kGelu>
        <<<blocks, kThreads, 0, stream>>>(d, g, u, dg, du, rows, cols, gs, us, ggs, gus);
  } else {
    swiglu_backward_kernel<T, 1, kGelu>
        <<<blocks, kThreads, 0, stream>>>(d, g, u, dg, du, rows, cols, gs, us, ggs, gus);
  }
}

// ---- cross-entropy ------------------------------------------------------------------------
// One block per row: pass 1 keeps a running (max, Σ exp(x − max)) per thread and merges them;
// pass 2 writes the gradient over the row it read.
constexpr int kLossThreads = 1024;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// A logit soft-capped as ATen's tanh(z / cap) · cap computes it (Gemma 2); cap 0: z.
__device__ __forceinline__ float soft_capped(float z, float cap) {
  return cap > 0.f ? tanhf(z / cap) * cap : z;
}

template <typename T, int V>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ labels,
                         float* __restrict__ loss, int64_t vocab, bool write_grad, float cap) {
  __shared__ MaxSum shared[32];
  __shared__ float lse_shared;
  const int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int64_t label = labels[row];
  const bool valid = label != -100;
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < vocab;
       c += static_cast<int64_t>(blockDim.x) * V) {
    const Vec<T, V> p = load<T, V>(x + c);
    float local = -INFINITY;
#pragma unroll
    for (int k = 0; k < V; ++k) local = fmaxf(local, soft_capped(to_float(p.v[k]), cap));
    MaxSum here{local, 0.f};
#pragma unroll
    for (int k = 0; k < V; ++k) here.s += expf(soft_capped(to_float(p.v[k]), cap) - local);
    acc = merge(acc, here);
  }
  for (int o = 16; o > 0; o >>= 1) {
    acc = merge(acc, MaxSum{__shfl_xor_sync(0xffffffffu, acc.m, o),
                            __shfl_xor_sync(0xffffffffu, acc.s, o)});
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : MaxSum{-INFINITY, 0.f};
    for (int o = 16; o > 0; o >>= 1) {
      acc = merge(acc, MaxSum{__shfl_xor_sync(0xffffffffu, acc.m, o),
                              __shfl_xor_sync(0xffffffffu, acc.s, o)});
    }
    if (lane == 0) {
      const float lse = acc.m + logf(acc.s);
      lse_shared = lse;
      if (!valid) {
        loss[row] = 0.f;
      } else if (label < 0 || label >= vocab) {
        loss[row] = NAN;  // surfaces as a non-finite loss, never as an out-of-bounds read
      } else {
        loss[row] = lse - soft_capped(to_float(x[label]), cap);
      }
    }
  }
  __syncthreads();  // the target was read before any thread overwrites the row
  if (!write_grad) return;
  const float lse = lse_shared;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < vocab;
       c += static_cast<int64_t>(blockDim.x) * V) {
    Vec<T, V> p = load<T, V>(x + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float z = soft_capped(to_float(p.v[k]), cap);
      float d = expf(z - lse);
      if (c + k == label) d -= 1.f;
      if (cap > 0.f) d *= 1.f - (z / cap) * (z / cap);  // d cap·tanh(z / cap) / dz
      p.v[k] = from_float<T>(valid ? d : 0.f);
    }
    store<T, V>(x + c, p);
  }
}

template <typename T>
void launch_cross_entropy(void* logits, const int64_t* labels, float* loss, int64_t rows,
                          int64_t vocab, bool write_grad, float cap, cudaStream_t stream) {
  constexpr int V = Pack<T>::kN;
  T* x = static_cast<T*>(logits);
  const unsigned blocks = static_cast<unsigned>(rows);
  if (packs_fit<T>(vocab, {}, {logits})) {
    cross_entropy_kernel<T, V>
        <<<blocks, kLossThreads, 0, stream>>>(x, labels, loss, vocab, write_grad, cap);
  } else {
    cross_entropy_kernel<T, 1>
        <<<blocks, kLossThreads, 0, stream>>>(x, labels, loss, vocab, write_grad, cap);
  }
}

}  // namespace

cudaError_t rotary(Scalar t, const void* x, const void* cos, const void* sin, void* out,
                   const RotaryArgs& args, cudaStream_t stream) {
  if (args.batch * args.heads * args.tokens == 0) return cudaSuccess;
  switch (t) {
    case Scalar::kFloat32:
      launch_rotary<float>(x, cos, sin, out, args, stream);
      break;
    case Scalar::kFloat16:
      launch_rotary<__half>(x, cos, sin, out, args, stream);
      break;
    case Scalar::kBFloat16:
      launch_rotary<__nv_bfloat16>(x, cos, sin, out, args, stream);
      break;
  }
  return cudaGetLastError();
}

namespace {

template <bool kGelu>
void swiglu_forward_for(Scalar t, const void* gate, const void* up, void* out, int64_t rows,
                        int64_t cols, int64_t gs, int64_t us, cudaStream_t stream) {
  switch (t) {
    case Scalar::kFloat32:
      launch_swiglu_forward<float, kGelu>(gate, up, out, rows, cols, gs, us, stream);
      break;
    case Scalar::kFloat16:
      launch_swiglu_forward<__half, kGelu>(gate, up, out, rows, cols, gs, us, stream);
      break;
    case Scalar::kBFloat16:
      launch_swiglu_forward<__nv_bfloat16, kGelu>(gate, up, out, rows, cols, gs, us, stream);
      break;
  }
}

template <bool kGelu>
void swiglu_backward_for(Scalar t, const void* grad, const void* gate, const void* up,
                         void* grad_gate, void* grad_up, int64_t rows, int64_t cols, int64_t gs,
                         int64_t us, int64_t ggs, int64_t gus, cudaStream_t stream) {
  switch (t) {
    case Scalar::kFloat32:
      launch_swiglu_backward<float, kGelu>(grad, gate, up, grad_gate, grad_up, rows, cols, gs, us,
                                           ggs, gus, stream);
      break;
    case Scalar::kFloat16:
      launch_swiglu_backward<__half, kGelu>(grad, gate, up, grad_gate, grad_up, rows, cols, gs, us,
                                            ggs, gus, stream);
      break;
    case Scalar::kBFloat16:
      launch_swiglu_backward<__nv_bfloat16, kGelu>(grad, gate, up, grad_gate, grad_up, rows, cols,
                                                   gs, us, ggs, gus, stream);
      break;
  }
}

}  // namespace

cudaError_t swiglu_forward(Scalar t, bool gelu, const void* gate, const void* up, void* out,
                           int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride,
                           cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  if (gelu) {
    swiglu_forward_for<true>(t, gate, up, out, rows, cols, gate_stride, up_stride, stream);
  } else {
    swiglu_forward_for<false>(t, gate, up, out, rows, cols, gate_stride, up_stride, stream);
  }
  return cudaGetLastError();
}

cudaError_t swiglu_backward(Scalar t, bool gelu, const void* grad, const void* gate, const void* up,
                            void* grad_gate, void* grad_up, int64_t rows, int64_t cols,
                            int64_t gate_stride, int64_t up_stride, int64_t grad_gate_stride,
                            int64_t grad_up_stride, cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  if (gelu) {
    swiglu_backward_for<true>(t, grad, gate, up, grad_gate, grad_up, rows, cols, gate_stride,
                              up_stride, grad_gate_stride, grad_up_stride, stream);
  } else {
    swiglu_backward_for<false>(t, grad, gate, up, grad_gate, grad_up, rows, cols, gate_stride,
                               up_stride, grad_gate_stride, grad_up_stride, stream);
  }
  return cudaGetLastError();
}

cudaError_t cross_entropy(Scalar t, void* logits, const int64_t* labels, float* loss, int64_t rows,
                          int64_t vocab, bool write_grad, float softcap, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  switch (t) {
    case Scalar::kFloat32:
      launch_cross_entropy<float>(logits, labels, loss, rows, vocab, write_grad, softcap, stream);
      break;
    case Scalar::kFloat16:
      launch_cross_entropy<__half>(logits, labels, loss, rows, vocab, write_grad, softcap, stream);
      break;
    case Scalar::kBFloat16:
      launch_cross_entropy<__nv_bfloat16>(logits, labels, loss, rows, vocab, write_grad, softcap,
                                          stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace zt::kernels::gpu
