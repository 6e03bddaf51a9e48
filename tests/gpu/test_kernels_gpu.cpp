// zerotrain's CUDA kernels (lib/kernels/) against what they replace: the RMSNorm against
// transformers' formula by ATen ops with autograd (and both against fp64), the AdamW kernel
// against LibTorch's fused AdamW. One GPU, no ranks.
#include "support/catch.hpp"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/fused.hpp"
#include "model/layers.hpp"
#include "util/torch_compat.hpp"

namespace {

constexpr double kEps = 1e-6;

// transformers' LlamaRMSNorm, op by op; `dtype` also rounds where transformers' graph does.
at::Tensor hf_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + kEps);
  return w * h.to(x.scalar_type());
}

// The same function in fp64 with no rounding at all: the truth both sides approximate.
at::Tensor exact_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + kEps));
}

struct Result {
  at::Tensor y, gx, gw;
};

template <typename F>
Result run(F&& f, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& g) {
  at::Tensor x = x0.detach().clone().requires_grad_(true);
  at::Tensor w = w0.detach().clone().requires_grad_(true);
  at::Tensor y = f(x, w);
  auto grads = torch::autograd::grad({y}, {x, w}, {g});
  return {y.detach(), grads[0], grads[1]};
}

// ‖a − truth‖ / ‖truth‖ in fp64.
double rel_error(const at::Tensor& a, const at::Tensor& truth) {
  at::Tensor t = truth.to(at::kDouble);
  return (a.to(at::kDouble) - t).norm().item<double>() / std::max(1e-30, t.norm().item<double>());
}

double unit_roundoff(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -8)
         : t == at::kHalf   ? std::ldexp(1.0, -11)
                            : std::ldexp(1.0, -24);
}

}  // namespace

TEST_CASE("fused RMSNorm gives transformers' outputs and gradients", "[gpu][kernels]") {
  REQUIRE(at::getNumGPUs() > 0);
  const at::Device cuda(at::kCUDA, 0);
  struct Shape {
    int64_t hidden;
    at::ScalarType dtype;
    bool fused;  // whether the kernel takes it (else the ATen path runs)
  };
  const std::vector<Shape> shapes = {
      {64, at::kBFloat16, true},    {3584, at::kBFloat16, true}, {5120, at::kBFloat16, true},
      {16384, at::kBFloat16, true}, {3584, at::kHalf, true},     {3584, at::kFloat, true},
      {12288, at::kFloat, false},   {36, at::kBFloat16, false},  // too wide / not whole 16-byte
                                                                 // packs
  };
  for (const Shape& s : shapes) {
    INFO("hidden " << s.hidden << ", " << c10::toString(s.dtype));
    at::manual_seed(7);
    const auto opts = at::TensorOptions().device(cuda).dtype(s.dtype);
    // Rows of different scales, as hidden states have; 3 × 37 rows: the backward's blocks
    // walk unequal numbers of rows.
    at::Tensor x = (at::randn({3, 37, s.hidden}, opts.dtype(at::kFloat)) *
                    at::rand({3, 37, 1}, opts.dtype(at::kFloat)).mul(8).add(0.1))
                       .to(s.dtype);
    at::Tensor w = (1 + 0.2 * at::randn({s.hidden}, opts.dtype(at::kFloat))).to(s.dtype);
    at::Tensor g = at::randn({3, 37, s.hidden}, opts);
    REQUIRE(zt::kernels::fused_rms_norm_applies(x, w) == s.fused);

    const Result ours =
        run([](auto& a, auto& b) { return zt::model::rms_norm(a, b, kEps); }, x, w, g);
    const Result hf = run([](auto& a, auto& b) { return hf_rms_norm(a, b); }, x, w, g);
    const Result exact = run([](auto& a, auto& b) { return exact_rms_norm(a, b); },
                             x.to(at::kDouble), w.to(at::kDouble), g.to(at::kDouble));

    // Forward: the same roundings as transformers, so the same values except where fp32 sums
    // in another order move r by an ulp across a rounding boundary — then one ulp of the dtype.
    const double u = unit_roundoff(s.dtype);
    at::Tensor diff = (ours.y.to(at::kDouble) - hf.y.to(at::kDouble)).abs();
    at::Tensor bound =
        hf.y.to(at::kDouble).abs() * (s.dtype == at::kFloat ? 16 * u : 4 * u) + 1e-30;
    CHECK((diff <= bound).all().item<bool>());
    // In fp32 every element may carry r's last-bit difference; in 16 bits it rarely shows.
    if (s.dtype != at::kFloat) CHECK(diff.gt(0).to(at::kDouble).mean().item<double>() <= 0.01);

    // Gradients: as close to the fp64 truth as transformers' own autograd in that dtype.
    // Both sides' errors are roundings of the dtype (~u/2 relative); the floor only matters
    // where transformers' is near zero. A gradient term off by 1/√hidden (a wrong factor in
    // the backward's correction) exceeds this at every tested width.
    const double floor = u / 2;
    std::printf(
        "rms_norm hidden %lld %s: |gx - exact| %.3g (transformers %.3g), |gw - exact| %.3g "
        "(%.3g)\n",
        static_cast<long long>(s.hidden), c10::toString(s.dtype), rel_error(ours.gx, exact.gx),
        rel_error(hf.gx, exact.gx), rel_error(ours.gw, exact.gw), rel_error(hf.gw, exact.gw));
    CHECK(rel_error(ours.gx, exact.gx) <= 1.5 * rel_error(hf.gx, exact.gx) + floor);
    CHECK(rel_error(ours.gw, exact.gw) <= 1.5 * rel_error(hf.gw, exact.gw) + floor);
    CHECK(rel_error(ours.y, exact.y) <= 1.5 * rel_error(hf.y, exact.y) + floor);
  }
}

TEST_CASE("fused RMSNorm: strided inputs and gradients take the right path", "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  const auto opts = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
  at::manual_seed(3);
  at::Tensor x = at::randn({64, 4, 128}, opts).transpose(0, 1);  // not contiguous: ATen path
  at::Tensor w = at::randn({128}, opts);
  REQUIRE_FALSE(zt::kernels::fused_rms_norm_applies(x, w));
  at::Tensor xc = x.contiguous();
  REQUIRE(zt::kernels::fused_rms_norm_applies(xc, w));
  // A strided incoming gradient (a transposed view) is read as the values it denotes.
  at::Tensor g = at::randn({64, 4, 128}, opts).transpose(0, 1);
  const Result ours =
      run([](auto& a, auto& b) { return zt::model::rms_norm(a, b, kEps); }, xc, w, g);
  const Result hf = run([](auto& a, auto& b) { return hf_rms_norm(a, b); }, xc, w, g);
  CHECK(rel_error(ours.gx, hf.gx) < 0.02);
  CHECK(rel_error(ours.gw, hf.gw) < 0.02);
}

TEST_CASE("fused AdamW: each update is AdamW's to fp32 precision, and it sums the squared gradient",
          "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  REQUIRE(zt::compat::has_fused_adamw(cuda));
  const double u32 = std::ldexp(1.0, -24);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    // 8 · 2^17 + 5 elements: vector packs and a tail; offset 3: views that are not 16-byte
    // aligned take the scalar loop.
    for (int64_t offset : {0, 3}) {
      INFO(c10::toString(dtype) << ", offset " << offset);
      const int64_t n = 8 * (int64_t{1} << 17) + 5;
      const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
      at::manual_seed(11);
      auto make = [&](double scale) {
        return (at::randn({n + offset}, opts.dtype(at::kFloat)) * scale).to(dtype);
      };
      auto view = [&](const at::Tensor& t) { return t.narrow(0, offset, n); };
      at::Tensor p = make(1.0), m = at::zeros_like(p), v = at::zeros_like(p);
      at::Tensor grad_sq = at::zeros({}, opts.dtype(at::kFloat));
      double want_sq = 0;
      zt::UpdateHyper h;
      h.lr = 1e-3;
      h.weight_decay = 0.1;
      for (int64_t step = 1; step <= 3; ++step) {
        INFO("step " << step);
        h.step = step;
        // Gradients of growing scale, some exactly zero.
        at::Tensor g = make(1e-2 * static_cast<double>(step))
                           .masked_fill(at::rand({n + offset}, opts.dtype(at::kFloat)) < 0.01, 0);
        const at::Tensor p0 = view(p).to(at::kDouble), m0 = view(m).to(at::kDouble),
                         v0 = view(v).to(at::kDouble);
        const at::Tensor gd = view(g).to(at::kDouble);
        at::Tensor p_before = p.clone();
        at::Tensor p_ref = p.clone(), m_ref = m.clone(), v_ref = v.clone();
        zt::kernels::fused_adamw(view(p), view(g), view(m), view(v), h, grad_sq);
        want_sq += gd.pow(2).sum().item<double>();

        // AdamW in fp64 from the same state, and the error fp32 evaluation may add: a few
        // roundings of the largest term of each line (where the terms cancel, that is what
        // bounds the error, not the result), then one rounding into the dtype.
        const double b1 = h.beta1, b2 = h.beta2, lr = h.lr;
        const double step_size = lr / (1 - std::pow(b1, static_cast<double>(step)));
        const double bc2_sqrt = std::sqrt(1 - std::pow(b2, static_cast<double>(step)));
        const at::Tensor m1 = b1 * m0 + (1 - b1) * gd;
        const at::Tensor v1 = b2 * v0 + (1 - b2) * gd * gd;
        const at::Tensor denom = v1.sqrt() / bc2_sqrt + h.eps;
        const at::Tensor update = step_size * m1 / denom;
        const at::Tensor p1 = p0 * (1 - lr * h.weight_decay) - update;
        const double u = unit_roundoff(dtype);
        const at::Tensor err_m = 4 * u32 * (b1 * m0.abs() + (1 - b1) * gd.abs());
        const at::Tensor err_v = 4 * u32 * (b2 * v0 + (1 - b2) * gd * gd);
        const at::Tensor err_p = 8 * u32 * (p0.abs() + update.abs()) + step_size * err_m / denom +
                                 update.abs() * err_v / (2 * v1 + 1e-300);
        auto within = [&](const at::Tensor& got, const at::Tensor& want, const at::Tensor& err) {
          at::Tensor d = (view(got).to(at::kDouble) - want).abs();
          at::Tensor bound = u * (want.abs() + err) + err;
          return (d <= bound * 1.0001 + 1e-300).all().item<bool>();
        };
        CHECK(within(m, m1, err_m));
        CHECK(within(v, v1, err_v));
        CHECK(within(p, p1, err_p));
        // The elements before the view are not touched.
        if (offset > 0) CHECK(at::equal(p.narrow(0, 0, offset), p_before.narrow(0, 0, offset)));

        // And LibTorch's fused AdamW from the same state lands on the same parameters to within
        // a rounding of each side (its kernel differs in fp32 details: 1.f − β2, the
        // bias-correction powers).
        at::Tensor step_t = at::full({}, static_cast<double>(step), opts.dtype(at::kFloat));
        zt::compat::fused_adamw({view(p_ref)}, {view(g)}, {view(m_ref)}, {view(v_ref)}, step_t,
                                h.lr, h.beta1, h.beta2, h.weight_decay, h.eps);
        at::Tensor dp = (view(p).to(at::kDouble) - view(p_ref).to(at::kDouble)).abs();
        CHECK((dp <= 2 * u * p1.abs() + 1e-3 * lr).all().item<bool>());
      }
      CHECK(std::fabs(grad_sq.item<double>() - want_sq) <= 1e-5 * want_sq);
    }
  }
}
