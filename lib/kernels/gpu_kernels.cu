// RMSNorm forward / backward and AdamW as single memory-bound passes (see gpu_kernels.hpp).
//
// Why not ATen ops: transformers' RMSNorm is five elementwise kernels and a reduction in
// forward, more in backward, and the product whose output is rounded to bf16 falls to ATen's
// non-vectorized casting loop; the whole norm of a 7B step cost ~35 ms of GPU time that one
// pass over the activations does in a few. AdamW: LibTorch's multi-tensor kernel reaches about
// half the memory bandwidth on bf16 state, and the gradient norm would be another pass.
#include <algorithm>

#include "kernels/gpu_common.cuh"
#include "kernels/gpu_kernels.hpp"

namespace zt::kernels::gpu {
namespace {

// ---- RMSNorm ------------------------------------------------------------------------------
// One row per block pass; thread t holds packs t and t + kThreads of the row in registers.
constexpr int kChunks = 2;

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads)
    rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                            float* __restrict__ r, int64_t hidden, float eps, bool unit_offset) {
  using P = Pack<T>;
  constexpr int V = P::kN;
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const int64_t packs = hidden / V;
  const P* xr = reinterpret_cast<const P*>(x + row * hidden);
  float h[kChunks][V];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = c * kThreads + threadIdx.x;
    if (i < packs) {
      const P p = xr[i];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        h[c][k] = to_float(p.v[k]);
        ss += h[c][k] * h[c][k];
      }
    }
  }
  // mean as ATen takes it (the sum times 1/N), then rsqrt(mean + eps).
  const float rr = rsqrtf(block_sum(ss, shared) * (1.f / static_cast<float>(hidden)) + eps);
  if (threadIdx.x == 0) r[row] = rr;
  const P* wp = reinterpret_cast<const P*>(w);
  P* yr = reinterpret_cast<P*>(y + row * hidden);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = c * kThreads + threadIdx.x;
    if (i < packs) {
      const P wv = wp[i];
      P out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        // Gemma: (h·r)·(1 + w) in fp32, rounded once; LLaMA: w · (h·r).to(T).
        out.v[k] = unit_offset ? from_float<T>((h[c][k] * rr) * (1.f + to_float(wv.v[k])))
                               : from_float<T>(to_float(wv.v[k]) * rounded<T>(h[c][k] * rr));
      }
      yr[i] = out;
    }
  }
}

// With n = (h·r).to(T), y = w·n: dL/dw = Σ_rows (g·n).to(T); with g_n = (g·w).to(T),
// dL/dx = r·(g_n − h·r²·Σ(g_n·h)/N). Unit offset (Gemma, y = (h·r·(1 + w)).to(T)): the same
// with n = h·r and g_n = g·(1 + w), unrounded. Each block walks rows blockIdx.x, + gridDim.x, ...
// and keeps its share of dL/dw in registers until the end.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads)
    rms_norm_backward_kernel(const T* __restrict__ g, const T* __restrict__ x,
                             const T* __restrict__ w, const float* __restrict__ r,
                             T* __restrict__ gx, float* __restrict__ gw_partial, int64_t rows,
                             int64_t hidden, bool unit_offset) {
  using P = Pack<T>;
  constexpr int V = P::kN;
  __shared__ float shared[32];
  const int64_t packs = hidden / V;
  const P* wp = reinterpret_cast<const P*>(w);
  float wf[kChunks][V];
  float acc[kChunks][V];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = c * kThreads + threadIdx.x;
    P wv{};
    if (i < packs) wv = wp[i];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      wf[c][k] = unit_offset ? 1.f + to_float(wv.v[k]) : to_float(wv.v[k]);
      acc[c][k] = 0.f;
    }
  }
  const float inv_hidden = 1.f / static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float rr = r[row];
    const P* xr = reinterpret_cast<const P*>(x + row * hidden);
    const P* gr = reinterpret_cast<const P*>(g + row * hidden);
    float h[kChunks][V], gn[kChunks][V];
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t i = c * kThreads + threadIdx.x;
      if (i < packs) {
        const P xp = xr[i], gp = gr[i];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          h[c][k] = to_float(xp.v[k]);
          const float gv = to_float(gp.v[k]);
          if (unit_offset) {
            if (gw_partial) acc[c][k] += gv * (h[c][k] * rr);
            gn[c][k] = gv * wf[c][k];
          } else {
            if (gw_partial) acc[c][k] += rounded<T>(gv * rounded<T>(h[c][k] * rr));
            gn[c][k] = rounded<T>(gv * wf[c][k]);
          }
          dot += gn[c][k] * h[c][k];
        }
      }
    }
    if (!gx) continue;  // uniform over the block: no thread reaches block_sum alone
    const float coeff = rr * rr * block_sum(dot, shared) * inv_hidden;
    P* out = reinterpret_cast<P*>(gx + row * hidden);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t i = c * kThreads + threadIdx.x;
      if (i < packs) {
        P o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>((gn[c][k] - h[c][k] * coeff) * rr);
        out[i] = o;
      }
    }
  }
  if (!gw_partial) return;
  float* part = gw_partial + static_cast<int64_t>(blockIdx.x) * hidden;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = c * kThreads + threadIdx.x;
    if (i < packs) {
#pragma unroll
      for (int k = 0; k < V; ++k) part[i * V + k] = acc[c][k];
    }
  }
}

int element_size(Scalar t) {
  return t == Scalar::kFloat32 ? 4 : 2;
}

// The fewest threads (a power of two, 64..1024) whose two packs each cover the row; 0: none.
int rms_norm_threads(Scalar t, int64_t hidden) {
  const int64_t per_pack = 16 / element_size(t);
  if (hidden <= 0 || hidden % per_pack != 0) return 0;
  const int64_t packs = hidden / per_pack;
  for (int threads = 64; threads <= 1024; threads *= 2) {
    if (packs <= static_cast<int64_t>(threads) * kChunks) return threads;
  }
  return 0;
}

template <typename T, int kThreads>
void launch_forward(const void* x, const void* w, void* y, float* r, int64_t rows, int64_t hidden,
                    float eps, bool unit_offset, cudaStream_t stream) {
  rms_norm_forward_kernel<T, kThreads><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), r, hidden, eps,
      unit_offset);
}

template <typename T, int kThreads>
void launch_backward(const void* g, const void* x, const void* w, const float* r, void* gx,
                     float* gw_partial, int64_t rows, int64_t hidden, int blocks, bool unit_offset,
                     cudaStream_t stream) {
  rms_norm_backward_kernel<T, kThreads><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(w), r,
      static_cast<T*>(gx), gw_partial, rows, hidden, unit_offset);
}

// The kernels' instantiations: by dtype, then by thread count (rms_norm_threads).
template <typename T>
void forward_for(int threads, const void* x, const void* w, void* y, float* r, int64_t rows,
                 int64_t hidden, float eps, bool unit_offset, cudaStream_t stream) {
  switch (threads) {
    case 64:
      launch_forward<T, 64>(x, w, y, r, rows, hidden, eps, unit_offset, stream);
      break;
    case 128:
      launch_forward<T, 128>(x, w, y, r, rows, hidden, eps, unit_offset, stream);
      break;
    case 256:
      launch_forward<T, 256>(x, w, y, r, rows, hidden, eps, unit_offset, stream);
      break;
    case 512:
      launch_forward<T, 512>(x, w, y, r, rows, hidden, eps, unit_offset, stream);
      break;
    default:
      launch_forward<T, 1024>(x, w, y, r, rows, hidden, eps, unit_offset, stream);
      break;
  }
}

template <typename T>
void backward_for(int threads, const void* g, const void* x, const void* w, const float* r,
                  void* gx, float* gw_partial, int64_t rows, int64_t hidden, int blocks,
                  bool unit_offset, cudaStream_t stream) {
  switch (threads) {
    case 64:
      launch_backward<T, 64>(g, x, w, r, gx, gw_partial, rows, hidden, blocks, unit_offset, stream);
      break;
    case 128:
      launch_backward<T, 128>(g, x, w, r, gx, gw_partial, rows, hidden, blocks, unit_offset,
                              stream);
      break;
    case 256:
      launch_backward<T, 256>(g, x, w, r, gx, gw_partial, rows, hidden, blocks, unit_offset,
                              stream);
      break;
    case 512:
      launch_backward<T, 512>(g, x, w, r, gx, gw_partial, rows, hidden, blocks, unit_offset,
                              stream);
      break;
    default:
      launch_backward<T, 1024>(g, x, w, r, gx, gw_partial, rows, hidden, blocks, unit_offset,
                               stream);
      break;
  }
}

// ---- AdamW --------------------------------------------------------------------------------
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamwArgs& a) {
  g *= a.grad_scale;
  p -= a.decay * p;
  m = a.beta1 * m + a.one_minus_beta1 * g;
  v = a.beta2 * v + a.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
  p -= a.step_size * m / denom;
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(256)
    adamw_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                 int64_t n, AdamwArgs a, float* __restrict__ grad_sq) {
  using P = Pack<T>;
  constexpr int V = kVector ? P::kN : 1;
  __shared__ float shared[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float sq = 0.f;
  int64_t done = 0;
  if constexpr (kVector) {
    const int64_t packs = n / V;
    for (int64_t i = first; i < packs; i += stride) {
      P pp = reinterpret_cast<const P*>(p)[i], mp = reinterpret_cast<const P*>(m)[i];
      P vp = reinterpret_cast<const P*>(v)[i];
      const P gp = reinterpret_cast<const P*>(g)[i];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float pf = to_float(pp.v[k]), mf = to_float(mp.v[k]), vf = to_float(vp.v[k]);
        const float gf = to_float(gp.v[k]);
        sq += gf * gf;
        adamw_element(pf, gf, mf, vf, a);
        pp.v[k] = from_float<T>(pf);
        mp.v[k] = from_float<T>(mf);
        vp.v[k] = from_float<T>(vf);
      }
      reinterpret_cast<P*>(p)[i] = pp;
      reinterpret_cast<P*>(m)[i] = mp;
      reinterpret_cast<P*>(v)[i] = vp;
    }
    done = packs * V;
  }
  for (int64_t i = done + first; i < n; i += stride) {  // the tail, or everything unaligned
    float pf = to_float(p[i]), mf = to_float(m[i]), vf = to_float(v[i]);
    const float gf = to_float(g[i]);
    sq += gf * gf;
    adamw_element(pf, gf, mf, vf, a);
    p[i] = from_float<T>(pf);
    m[i] = from_float<T>(mf);
    v[i] = from_float<T>(vf);
  }
  if (grad_sq) {
    sq = block_sum(sq, shared);
    if (threadIdx.x == 0) atomicAdd(grad_sq, sq);
  }
}

template <typename T>
void launch_adamw(void* p, const void* g, void* m, void* v, int64_t n, const AdamwArgs& a,
                  float* grad_sq, bool vectorized, int sm_count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t per_thread = vectorized ? Pack<T>::kN : 1;
  const int64_t wanted = (n / per_thread + kThreads - 1) / kThreads;
  // Enough resident blocks to saturate memory; the grid-stride loop covers the rest.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sm_count} * 8));
  if (vectorized) {
    adamw_kernel<T, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<T*>(p), static_cast<const T*>(g), static_cast<T*>(m), static_cast<T*>(v), n, a,
        grad_sq);
  } else {
    adamw_kernel<T, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<T*>(p), static_cast<const T*>(g), static_cast<T*>(m), static_cast<T*>(v), n, a,
        grad_sq);
  }
}

// fp32 masters with a gradient in the compute dtype C, writing the compute copy as it goes:
// four elements per thread (16 bytes of each fp32 array, 8 of each C array).
template <typename C>
struct alignas(8) Quad {
  C v[4];
};

template <typename C, bool kVector>
__global__ void __launch_bounds__(256)
    adamw_mixed_kernel(float* __restrict__ p, const C* __restrict__ g, float* __restrict__ m,
                       float* __restrict__ v, C* __restrict__ out, int64_t n, AdamwArgs a,
                       float* __restrict__ grad_sq) {
  __shared__ float shared[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float sq = 0.f;
  int64_t done = 0;
  if constexpr (kVector) {
    const int64_t quads = n / 4;
    for (int64_t i = first; i < quads; i += stride) {
      float4 pp = reinterpret_cast<const float4*>(p)[i], mp = reinterpret_cast<const float4*>(m)[i];
      float4 vp = reinterpret_cast<const float4*>(v)[i];
      const Quad<C> gq = reinterpret_cast<const Quad<C>*>(g)[i];
      float* pf = &pp.x;
      float* mf = &mp.x;
      float* vf = &vp.x;
      Quad<C> oq;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float gf = to_float(gq.v[k]);
        sq += gf * gf;
        adamw_element(pf[k], gf, mf[k], vf[k], a);
        oq.v[k] = from_float<C>(pf[k]);
      }
      reinterpret_cast<float4*>(p)[i] = pp;
      reinterpret_cast<float4*>(m)[i] = mp;
      reinterpret_cast<float4*>(v)[i] = vp;
      if (out) reinterpret_cast<Quad<C>*>(out)[i] = oq;
    }
    done = quads * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    const float gf = to_float(g[i]);
    sq += gf * gf;
    adamw_element(p[i], gf, m[i], v[i], a);
    if (out) out[i] = from_float<C>(p[i]);
  }
  if (grad_sq) {
    sq = block_sum(sq, shared);
    if (threadIdx.x == 0) atomicAdd(grad_sq, sq);
  }
}

template <typename C>
void launch_adamw_mixed(float* p, const void* g, float* m, float* v, void* out, int64_t n,
                        const AdamwArgs& a, float* grad_sq, bool vectorized, int sm_count,
                        cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t wanted = (n / (vectorized ? 4 : 1) + kThreads - 1) / kThreads;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sm_count} * 8));
  const C* gc = static_cast<const C*>(g);
  C* oc = static_cast<C*>(out);
  if (vectorized) {
    adamw_mixed_kernel<C, true>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, gc, m, v, oc, n, a, grad_sq);
  } else {
    adamw_mixed_kernel<C, false>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, gc, m, v, oc, n, a, grad_sq);
  }
}

}  // namespace

bool rms_norm_supports(Scalar t, int64_t hidden) {
  return rms_norm_threads(t, hidden) > 0;
}

cudaError_t rms_norm_forward(Scalar t, const void* x, const void* w, void* y, float* r,
                             int64_t rows, int64_t hidden, float eps, bool unit_offset,
                             cudaStream_t stream) {
  if (rows > 0) {
    const int threads = rms_norm_threads(t, hidden);
    switch (t) {
      case Scalar::kFloat32:
        forward_for<float>(threads, x, w, y, r, rows, hidden, eps, unit_offset, stream);
        break;
      case Scalar::kFloat16:
        forward_for<__half>(threads, x, w, y, r, rows, hidden, eps, unit_offset, stream);
        break;
      case Scalar::kBFloat16:
        forward_for<__nv_bfloat16>(threads, x, w, y, r, rows, hidden, eps, unit_offset, stream);
        break;
    }
  }
  return cudaGetLastError();
}

int rms_norm_backward_blocks(Scalar t, int64_t rows, int64_t hidden, int sm_count) {
  const int threads = std::max(rms_norm_threads(t, hidden), 64);
  // About 2048 resident threads per SM; more blocks would only mean more partial rows.
  const int64_t resident = int64_t{sm_count} * std::max(1, 2048 / threads);
  return static_cast<int>(std::max<int64_t>(1, std::min(rows, resident)));
}

cudaError_t rms_norm_backward(Scalar t, const void* grad_y, const void* x, const void* w,
                              const float* r, void* grad_x, float* grad_w_partial, int64_t rows,
                              int64_t hidden, int blocks, bool unit_offset, cudaStream_t stream) {
  if (rows > 0) {
    const int threads = rms_norm_threads(t, hidden);
    switch (t) {
      case Scalar::kFloat32:
        backward_for<float>(threads, grad_y, x, w, r, grad_x, grad_w_partial, rows, hidden, blocks,
                            unit_offset, stream);
        break;
      case Scalar::kFloat16:
        backward_for<__half>(threads, grad_y, x, w, r, grad_x, grad_w_partial, rows, hidden, blocks,
                             unit_offset, stream);
        break;
      case Scalar::kBFloat16:
        backward_for<__nv_bfloat16>(threads, grad_y, x, w, r, grad_x, grad_w_partial, rows, hidden,
                                    blocks, unit_offset, stream);
        break;
    }
  }
  return cudaGetLastError();
}

cudaError_t adamw(Scalar t, void* p, const void* g, void* m, void* v, int64_t n,
                  const AdamwArgs& args, float* grad_sq, bool vectorized, int sm_count,
                  cudaStream_t stream) {
  if (n > 0) {
    switch (t) {
      case Scalar::kFloat32:
        launch_adamw<float>(p, g, m, v, n, args, grad_sq, vectorized, sm_count, stream);
        break;
      case Scalar::kFloat16:
        launch_adamw<__half>(p, g, m, v, n, args, grad_sq, vectorized, sm_count, stream);
        break;
      case Scalar::kBFloat16:
        launch_adamw<__nv_bfloat16>(p, g, m, v, n, args, grad_sq, vectorized, sm_count, stream);
        break;
    }
  }
  return cudaGetLastError();
}

cudaError_t adamw_mixed(Scalar t, float* p, const void* g, float* m, float* v, void* out, int64_t n,
                        const AdamwArgs& args, float* grad_sq, bool vectorized, int sm_count,
                        cudaStream_t stream) {
  if (n > 0) {
    switch (t) {
      case Scalar::kFloat16:
        launch_adamw_mixed<__half>(p, g, m, v, out, n, args, grad_sq, vectorized, sm_count, stream);
        break;
      case Scalar::kBFloat16:
        launch_adamw_mixed<__nv_bfloat16>(p, g, m, v, out, n, args, grad_sq, vectorized, sm_count,
                                          stream);
        break;
      case Scalar::kFloat32:
        return cudaErrorInvalidValue;  // all-fp32 updates take adamw()
    }
  }
  return cudaGetLastError();
}

}  // namespace zt::kernels::gpu
