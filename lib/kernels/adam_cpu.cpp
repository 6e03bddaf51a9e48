// The CPU Adam(W) kernel: one pass over p, g, m, v (28 bytes per parameter), auto-vectorized
// in three clones (AVX-512F, AVX2+FMA, baseline x86-64) picked at load time by the dynamic
// loader (GCC target_clones), and split over cpu_worker_threads() (util/threads.hpp: the
// rank's share of the machine's cores, not OMP_NUM_THREADS, which launchers set to 1) with
// parallel_ranges.
//
// Operation order follows torch.optim.AdamW (decay first, then m, v, then
// p -= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)), with the division by sqrt(bc2) turned
// into a multiplication, so results match it to a few ulps.
// This file is compiled with -fno-math-errno so that sqrt vectorizes.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/adam_cpu.hpp"
#include "util/threads.hpp"

namespace zt::kernels {
namespace {

struct Coeffs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay_factor, l2, step_size,
      inv_bc2_sqrt, grad_scale;
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
    float gi = g[i] * c.grad_scale + c.l2 * p[i];
    float mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    float vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float denom = std::sqrt(vi) * c.inv_bc2_sqrt + c.eps;
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

Coeffs coefficients(const UpdateHyper& a, double weight_decay) {
  const double bc1 = a.bias_correction ? 1.0 - std::pow(a.beta1, static_cast<double>(a.step)) : 1.0;
  const double bc2 = a.bias_correction ? 1.0 - std::pow(a.beta2, static_cast<double>(a.step)) : 1.0;
  Coeffs c;
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.decay_factor = a.decoupled ? static_cast<float>(1.0 - a.lr * weight_decay) : 1.0f;
  c.l2 = a.decoupled ? 0.0f : static_cast<float>(weight_decay);
  c.step_size = static_cast<float>(a.lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.grad_scale = static_cast<float>(a.grad_scale);
  return c;
}

// Runs fn(offset, length, decay) over pieces of `segments` laid end to end, cut into the ranges
// parallel_ranges deals to adam_cpu_threads(total) threads: the one split both the update and
// the first touch of its memory use, so that each element is always worked on by one thread.
template <typename Fn>
void for_segment_ranges(const std::vector<Segment>& segments, Fn&& fn) {
  std::vector<int64_t> starts{0};  // prefix sums: the segments laid end to end
  for (const Segment& s : segments) starts.push_back(starts.back() + s.length);
  const int64_t total = starts.back();
  auto work = [&](int64_t lo, int64_t hi) {
    size_t k =
        static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin()) -
        1;
    for (; k < segments.size() && starts[k] < hi; ++k) {
      const Segment& s = segments[k];
      int64_t a = std::max(lo, starts[k]) - starts[k], b = std::min(hi, starts[k + 1]) - starts[k];
      if (b > a) fn(s.offset + a, b - a, s.decay);
    }
  };
  parallel_ranges(total, adam_cpu_threads(total), work);
}

}  // namespace

void adam_cpu_segments(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                       const std::vector<Segment>& segments, const UpdateHyper& args,
                       int64_t grad_offset) {
  const Coeffs with_decay = coefficients(args, args.weight_decay);
  const Coeffs without = coefficients(args, 0.0);
  for_segment_ranges(segments, [&](int64_t o, int64_t n, bool decay) {
    adam_chunk(param + o, grad + (o - grad_offset), exp_avg + o, exp_avg_sq + o, n,
               decay ? with_decay : without);
  });
}

void adam_cpu_first_touch(const std::vector<float*>& arrays, int64_t numel,
                          const std::vector<std::vector<Segment>>& groups) {
  // The elements no group covers (alignment padding, frozen buckets), in order, on this thread.
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const auto& group : groups) {
    for (const Segment& s : group) covered.emplace_back(s.offset, s.offset + s.length);
  }
  std::sort(covered.begin(), covered.end());
  int64_t next = 0;
  auto zero = [&](int64_t lo, int64_t hi) {
    for (float* a : arrays) std::fill(a + lo, a + hi, 0.0f);
  };
  for (const auto& [lo, hi] : covered) {
    if (lo > next) zero(next, std::min(lo, numel));
    next = std::max(next, hi);
  }
  if (numel > next) zero(next, numel);
  for (const auto& group : groups) {
    for_segment_ranges(group, [&](int64_t o, int64_t n, bool) { zero(o, o + n); });
  }
}

int64_t adam_cpu_threads(int64_t elements) {
  // At least 256 Ki elements per thread: below that, waking a thread costs more than it saves.
  return std::max<int64_t>(1,
                           std::min<int64_t>(cpu_worker_threads(), elements / (int64_t{1} << 18)));
}

void adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
              const UpdateHyper& hyper) {
  adam_cpu_segments(param, grad, exp_avg, exp_avg_sq, {Segment{0, n, true}}, hyper);
}

const char* adam_cpu_isa() {
  switch (isa_probe()) {
    case 2:
      return "avx512f";
    case 1:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace zt::kernels
