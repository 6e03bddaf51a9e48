// The CPU Adam(W) kernel: one pass over p, g, m, v (28 bytes per parameter), auto-vectorized
// in three clones (AVX-512F, AVX2+FMA, baseline x86-64) picked at load time by the dynamic
// loader (GCC target_clones), and split over LibTorch's intra-op threads.
//
// Operation order follows torch.optim.AdamW (decay first, then m, v, then
// p -= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)) so results match it to the last bit or so.
// This file is compiled with -fno-math-errno so that sqrt vectorizes.
#include <ATen/Parallel.h>

#include <cmath>

#include "optim/shard_optimizer.hpp"

namespace zt::kernels {
namespace {

struct Coeffs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay_factor, l2, step_size,
      bc2_sqrt;
};

#if defined(__x86_64__) && defined(__GNUC__)
#define ZT_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define ZT_CLONES
#endif

ZT_CLONES void adam_chunk(float* __restrict p, const float* __restrict g, float* __restrict m,
                          float* __restrict v, int64_t n, Coeffs c) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i] * c.decay_factor;
    float gi = g[i] + c.l2 * p[i];
    float mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    float vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = pi - c.step_size * (mi / denom);
  }
}

// Which clone the loader picks, by the same precedence (target macros are not per clone, so
// this asks the CPU instead).
int isa_probe() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

}  // namespace

void adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
              double lr, double beta1, double beta2, double eps, double weight_decay,
              bool decoupled, bool bias_correction, int64_t step) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  Coeffs c;
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.decay_factor = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  c.step_size = static_cast<float>(lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  // Chunks of 64 Ki elements: large enough to amortize scheduling, small enough to balance.
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    adam_chunk(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin, c);
  });
}

const char* adam_cpu_isa() {
  switch (isa_probe()) {
    case 2: return "avx512f";
    case 1: return "avx2";
    default: return "baseline";
  }
}

}  // namespace zt::kernels
