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

TEST_CASE("fused RMSNorm with (1 + w) gives Gemma's outputs and gradients", "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  // Gemma2RMSNorm: everything in fp32, (1 + w) before the one rounding.
  const auto gemma = [](const at::Tensor& x, const at::Tensor& w) {
    const at::Tensor h = x.to(at::kFloat);
    return (h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + kEps) * (1.0 + w.to(at::kFloat)))
        .to(x.scalar_type());
  };
  const auto exact = [](const at::Tensor& x, const at::Tensor& w) {
    return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + kEps) * (1.0 + w);
  };
  // Gemma 2 / 3 widths (2304, 3584) and head_dim 256 (Gemma 3's q/k norms), in each dtype.
  for (const auto& [hidden, dtype] :
       std::vector<std::pair<int64_t, at::ScalarType>>{{2304, at::kBFloat16},
                                                       {3584, at::kBFloat16},
                                                       {256, at::kBFloat16},
                                                       {2304, at::kHalf},
                                                       {2304, at::kFloat}}) {
    INFO("hidden " << hidden << ", " << c10::toString(dtype));
    at::manual_seed(17);
    const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
    at::Tensor x = (at::randn({3, 37, hidden}, opts.dtype(at::kFloat)) *
                    at::rand({3, 37, 1}, opts.dtype(at::kFloat)).mul(8).add(0.1))
                       .to(dtype);
    // Gemma's weights sit around 0 (the norm scales by 1 + w).
    at::Tensor w = (0.3 * at::randn({hidden}, opts.dtype(at::kFloat))).to(dtype);
    at::Tensor g = at::randn({3, 37, hidden}, opts);
    REQUIRE(zt::kernels::fused_rms_norm_applies(x, w));
    const Result ours =
        run([](auto& a, auto& b) { return zt::model::rms_norm_unit_offset(a, b, kEps); }, x, w, g);
    const Result hf = run(gemma, x, w, g);
    const Result truth = run(exact, x.to(at::kDouble), w.to(at::kDouble), g.to(at::kDouble));
    const double u = unit_roundoff(dtype);
    // Forward: transformers' roundings, up to r's last fp32 bit (one rounding of the dtype).
    const at::Tensor diff = (ours.y.to(at::kDouble) - hf.y.to(at::kDouble)).abs();
    CHECK((diff <= hf.y.to(at::kDouble).abs() * (dtype == at::kFloat ? 16 * u : 4 * u) + 1e-30)
              .all()
              .item<bool>());
    std::printf(
        "gemma rms_norm %lld %s: |gx - exact| %.3g (transformers %.3g), |gw - exact| "
        "%.3g (%.3g)\n",
        static_cast<long long>(hidden), c10::toString(dtype), rel_error(ours.gx, truth.gx),
        rel_error(hf.gx, truth.gx), rel_error(ours.gw, truth.gw), rel_error(hf.gw, truth.gw));
    CHECK(rel_error(ours.gx, truth.gx) <= 1.5 * rel_error(hf.gx, truth.gx) + u / 2);
    CHECK(rel_error(ours.gw, truth.gw) <= 1.5 * rel_error(hf.gw, truth.gw) + u / 2);
    // The plain RMSNorm of the same tensors is another function: the flag is read.
    const Result plain =
        run([](auto& a, auto& b) { return zt::model::rms_norm(a, b, kEps); }, x, w, g);
    CHECK(rel_error(plain.y, truth.y) > 0.1);
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

// ---- the decoder's kernels against the ATen expressions they replace ------------------------

namespace {

// transformers' rotate_half / GLM's pairs and `x * cos + rotate(x) * sin` on the first
// rotary_dim dimensions, op by op in x's dtype.
at::Tensor hf_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rd,
                     bool interleaved) {
  const at::Tensor r = x.narrow(-1, 0, rd);
  at::Tensor rotated;
  if (interleaved) {
    const at::Tensor even = r.slice(-1, 0, c10::nullopt, 2), odd = r.slice(-1, 1, c10::nullopt, 2);
    rotated = at::stack({-odd, even}, -1).flatten(-2);
  } else {
    rotated = at::cat({-r.narrow(-1, rd / 2, rd / 2), r.narrow(-1, 0, rd / 2)}, -1);
  }
  at::Tensor y = r * cos + rotated * sin;
  if (rd == x.size(-1)) return y;
  return at::cat({y, x.narrow(-1, rd, x.size(-1) - rd)}, -1);
}

}  // namespace

TEST_CASE("fused rotary embedding equals transformers' expression, forward and backward",
          "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  struct Case {
    const char* what;
    int64_t head_dim, rotary_dim;
    bool interleaved, positions;
    int64_t heads;
  };
  // 40 heads of 128: a row's work is more than one pass of the kernel's block.
  const Case cases[] = {
      {"LLaMA / Qwen halves", 128, 128, false, false, 3},
      {"halves, packed positions", 64, 64, false, true, 3},
      {"GLM: pairs on half of each head", 128, 64, true, false, 3},
      {"GLM pairs, packed positions", 128, 64, true, true, 3},
      {"LLaMA-2-13B's 40 heads", 128, 128, false, false, 40},
      {"GLM pairs, 40 heads, packed positions", 128, 64, true, true, 40},
  };
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const Case& c : cases) {
      INFO(c.what << ", " << c10::toString(dtype));
      const int64_t b = 2, t = 37, heads = c.heads;
      zt::ModelConfig mc;
      mc.head_dim = c.head_dim;
      mc.partial_rotary_factor = static_cast<double>(c.rotary_dim) / c.head_dim;
      mc.rope_interleaved = c.interleaved;
      mc.rope_theta = 10000.0;
      REQUIRE(mc.rotary_dim() == c.rotary_dim);
      const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
      at::manual_seed(3);
      at::Tensor cos, sin;
      if (c.positions) {
        const at::Tensor pos = at::randint(0, 4000, {b, t}, opts.dtype(at::kLong));
        std::tie(cos, sin) = zt::model::rotary_tables(mc, pos, dtype);
      } else {
        std::tie(cos, sin) = zt::model::rotary_tables(mc, 5, t, dtype, cuda);
      }
      // As the attention sees it: a projection's output [B, T, H·D] as [B, H, T, D].
      const at::Tensor x = (at::randn({b, t, heads * c.head_dim}, opts.dtype(at::kFloat)) * 3)
                               .to(dtype)
                               .view({b, t, heads, c.head_dim})
                               .transpose(1, 2);
      REQUIRE(zt::kernels::fused_rotary_applies(x, cos, sin, c.rotary_dim));
      const at::Tensor ours =
          zt::kernels::fused_rotary(x, cos, sin, c.rotary_dim, c.interleaved, false);
      at::Tensor xr = x.detach().clone().requires_grad_(true);
      const at::Tensor want = hf_rotary(xr, cos, sin, c.rotary_dim, c.interleaved);
      CHECK(ours.sizes() == want.sizes());
      CHECK(at::equal(ours, want.detach()));
      const at::Tensor g = at::randn(want.sizes(), opts.dtype(at::kFloat)).to(dtype);
      const at::Tensor want_dx = torch::autograd::grad({want}, {xr}, {g})[0];
      CHECK(at::equal(zt::kernels::fused_rotary(g, cos, sin, c.rotary_dim, c.interleaved, true),
                      want_dx));
    }
  }
  // What it does not take: an odd rotary width, tables of another dtype.
  const auto bf = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
  const at::Tensor x = at::zeros({1, 2, 4, 8}, bf);
  CHECK_FALSE(
      zt::kernels::fused_rotary_applies(x, at::zeros({4, 7}, bf), at::zeros({4, 7}, bf), 7));
  CHECK_FALSE(zt::kernels::fused_rotary_applies(x, at::zeros({4, 8}, bf.dtype(at::kFloat)),
                                                at::zeros({4, 8}, bf.dtype(at::kFloat)), 8));
}

TEST_CASE("fused SwiGLU equals silu(gate) * up, forward and backward", "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    // 1024 columns: 16-byte packs; 1000 + 3: the scalar path.
    for (int64_t cols : {1024, 1003}) {
      INFO(c10::toString(dtype) << ", " << cols << " columns");
      const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
      at::manual_seed(5);
      const at::Tensor gu = (at::randn({2, 19, 2 * cols}, opts.dtype(at::kFloat)) * 4).to(dtype);
      const at::Tensor g = at::randn({2, 19, cols}, opts.dtype(at::kFloat)).to(dtype);
      // Two projections.
      {
        at::Tensor gate = gu.narrow(-1, 0, cols).contiguous().requires_grad_(true);
        at::Tensor up = gu.narrow(-1, cols, cols).contiguous().requires_grad_(true);
        const at::Tensor want = at::silu(gate) * up;
        REQUIRE(zt::kernels::fused_swiglu_applies(gate, up));
        CHECK(at::equal(zt::kernels::fused_swiglu(gate.detach(), up.detach()), want.detach()));
        const auto wg = torch::autograd::grad({want}, {gate, up}, {g});
        const auto [dg, du] =
            zt::kernels::fused_swiglu_backward(g, gate.detach(), up.detach(), false);
        CHECK(at::equal(dg, wg[0]));
        CHECK(at::equal(du, wg[1]));
        // Through the model's entry point, with autograd.
        at::Tensor gate2 = gate.detach().clone().requires_grad_(true);
        at::Tensor up2 = up.detach().clone().requires_grad_(true);
        const at::Tensor a = zt::model::swiglu(gate2, up2);
        CHECK(at::equal(a.detach(), want.detach()));
        const auto ag = torch::autograd::grad({a}, {gate2, up2}, {g});
        CHECK(at::equal(ag[0], wg[0]));
        CHECK(at::equal(ag[1], wg[1]));
      }
      // One fused gate_up projection (gate first): one gradient for the whole output.
      {
        at::Tensor both = gu.clone().requires_grad_(true);
        const at::Tensor want = both.narrow(-1, cols, cols) * at::silu(both.narrow(-1, 0, cols));
        const at::Tensor want_grad = torch::autograd::grad({want}, {both}, {g})[0];
        at::Tensor both2 = gu.clone().requires_grad_(true);
        const at::Tensor a = zt::model::swiglu_halves(both2);
        CHECK(at::equal(a.detach(), want.detach()));
        CHECK(at::equal(torch::autograd::grad({a}, {both2}, {g})[0], want_grad));
      }
    }
  }
}

TEST_CASE("fused GeGLU equals gelu_tanh(gate) * up, forward and backward", "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t cols : {1024, 1003}) {
      INFO(c10::toString(dtype) << ", " << cols << " columns");
      const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
      at::manual_seed(6);
      const at::Tensor gu = (at::randn({2, 19, 2 * cols}, opts.dtype(at::kFloat)) * 4).to(dtype);
      const at::Tensor g = at::randn({2, 19, cols}, opts.dtype(at::kFloat)).to(dtype);
      // Within one rounding of the dtype of ATen's kernels (tanhf and the contractions may
      // differ in the last fp32 bit, which the rounding to the dtype nearly always hides).
      const double u = unit_roundoff(dtype);
      const auto close = [&](const at::Tensor& got, const at::Tensor& want) {
        const at::Tensor d = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
        const double scale = want.to(at::kDouble).abs().max().item<double>();
        INFO("worst difference " << d.max().item<double>() << " of " << scale);
        return (d <= 2 * u * want.to(at::kDouble).abs() + 1e-6 * scale).all().item<bool>();
      };
      at::Tensor gate = gu.narrow(-1, 0, cols).contiguous().requires_grad_(true);
      at::Tensor up = gu.narrow(-1, cols, cols).contiguous().requires_grad_(true);
      const at::Tensor want = at::gelu(gate, "tanh") * up;
      const auto wg = torch::autograd::grad({want}, {gate, up}, {g});
      at::Tensor gate2 = gate.detach().clone().requires_grad_(true);
      at::Tensor up2 = up.detach().clone().requires_grad_(true);
      const at::Tensor a =
          zt::model::gated_activation(gate2, up2, zt::model::Activation::kGeluTanh);
      CHECK(close(a.detach(), want.detach()));
      const auto ag = torch::autograd::grad({a}, {gate2, up2}, {g});
      CHECK(close(ag[0], wg[0]));
      CHECK(close(ag[1], wg[1]));
      // Not SwiGLU's values: the activation is the one asked for.
      CHECK_FALSE(close(a.detach(), (at::silu(gate) * up).detach()));
      // One fused gate_up projection (gate first).
      at::Tensor both = gu.clone().requires_grad_(true);
      const at::Tensor want_h =
          both.narrow(-1, cols, cols) * at::gelu(both.narrow(-1, 0, cols), "tanh");
      const at::Tensor want_grad = torch::autograd::grad({want_h}, {both}, {g})[0];
      at::Tensor both2 = gu.clone().requires_grad_(true);
      const at::Tensor h =
          zt::model::gated_activation_halves(both2, zt::model::Activation::kGeluTanh);
      CHECK(close(h.detach(), want_h.detach()));
      CHECK(close(torch::autograd::grad({h}, {both2}, {g})[0], want_grad));
    }
  }
}

TEST_CASE("fused cross-entropy of soft-capped logits: Gemma 2's loss and d loss / d logits",
          "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  const double cap = 30.0;  // Gemma 2's final_logit_softcapping
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    INFO(c10::toString(dtype));
    const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
    at::manual_seed(19);
    const int64_t rows = 41, vocab = 256000;
    const at::Tensor logits = (at::randn({rows, vocab}, opts.dtype(at::kFloat)) * 20).to(dtype);
    at::Tensor labels = at::randint(0, vocab, {rows}, opts.dtype(at::kLong));
    labels.narrow(0, 3, 4).fill_(-100);
    // The formula: autograd of the capped logits' cross-entropy in fp32.
    at::Tensor z = logits.to(at::kFloat).requires_grad_(true);
    const at::Tensor c = at::tanh(z / cap) * cap;
    const at::Tensor valid = labels.ne(-100);
    const at::Tensor want_loss =
        (at::logsumexp(c, 1) - c.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)) * valid;
    const at::Tensor want_grad = torch::autograd::grad({want_loss.sum()}, {z})[0];
    at::Tensor work = logits.clone();
    const at::Tensor loss = zt::kernels::fused_cross_entropy(work, labels, true, cap);
    CHECK((loss - want_loss.detach()).abs().max().item<double>() <=
          1e-5 * want_loss.abs().max().item<double>());
    const at::Tensor diff = (work.to(at::kDouble) - want_grad.to(at::kDouble)).abs();
    const at::Tensor bound = 2 * unit_roundoff(dtype) * want_grad.to(at::kDouble).abs() +
                             1e-5 * want_grad.abs().max().item<double>() + 1e-12;
    INFO("worst gradient error / bound " << (diff / bound).max().item<double>());
    CHECK((diff <= bound).all().item<bool>());
    // Uncapped, the same logits give another loss: the cap is applied.
    at::Tensor plain = logits.clone();
    CHECK(
        (zt::kernels::fused_cross_entropy(plain, labels, false) - loss).abs().max().item<double>() >
        1.0);
  }
}

TEST_CASE("fused cross-entropy: per-row losses and d loss / d logits of the fp32 formula",
          "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t vocab : {152064, 1001}) {
      INFO(c10::toString(dtype) << ", vocabulary " << vocab);
      const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
      at::manual_seed(9);
      const int64_t rows = 67;
      const at::Tensor logits = (at::randn({rows, vocab}, opts.dtype(at::kFloat)) * 3).to(dtype);
      at::Tensor labels = at::randint(0, vocab, {rows}, opts.dtype(at::kLong));
      labels.narrow(0, 5, 7).fill_(-100);
      // The formula it replaces (zt::model's ATen path).
      const at::Tensor l32 = logits.to(at::kFloat);
      const at::Tensor valid = labels.ne(-100);
      const at::Tensor lse = at::logsumexp(l32, 1);
      const at::Tensor target = l32.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1);
      const at::Tensor want_loss = (lse - target) * valid;
      at::Tensor p = (l32 - lse.unsqueeze(1)).exp();
      p.scatter_add_(1, labels.clamp_min(0).unsqueeze(1), at::full({rows, 1}, -1.0, p.options()));
      const at::Tensor want_grad = (p * valid.to(at::kFloat).unsqueeze(1)).to(dtype);

      REQUIRE(zt::kernels::fused_cross_entropy_applies(logits, labels));
      at::Tensor work = logits.clone();
      const at::Tensor loss_only = zt::kernels::fused_cross_entropy(work, labels, false);
      CHECK(at::equal(work, logits));  // without write_grad the logits stay
      const at::Tensor loss = zt::kernels::fused_cross_entropy(work, labels, true);
      CHECK(at::equal(loss, loss_only));
      INFO("worst loss error " << (loss - want_loss).abs().max().item<double>());
      CHECK((loss - want_loss).abs().max().item<double>() <=
            1e-5 * want_loss.abs().max().item<double>());
      CHECK((loss.narrow(0, 5, 7) == 0).all().item<bool>());
      // The gradient: the formula's value up to the softmax's relative error from logsumexp
      // summed in another order (a few fp32 ulps of a value near 12: 1e-6 of p), plus one
      // rounding of the dtype.
      const at::Tensor diff = (work.to(at::kDouble) - want_grad.to(at::kDouble)).abs();
      const at::Tensor bound = 2 * unit_roundoff(dtype) * want_grad.to(at::kDouble).abs() +
                               4e-6 * p.abs().to(at::kDouble) + 1e-12;
      INFO("worst gradient error / bound " << (diff / bound).max().item<double>());
      CHECK((diff <= bound).all().item<bool>());
      CHECK((work.narrow(0, 5, 7) == 0).all().item<bool>());
      // Each valid row's gradient sums to ~0 (softmax − onehot).
      CHECK(work.to(at::kDouble).sum(1).abs().max().item<double>() < 2e-2);
    }
  }
  // A label outside the vocabulary: NaN (a non-finite loss the engine reports), no bad read.
  const auto bf = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
  at::Tensor logits = at::zeros({2, 64}, bf);
  const at::Tensor labels = at::tensor(std::vector<int64_t>{3, 64}, bf.dtype(at::kLong));
  const at::Tensor loss = zt::kernels::fused_cross_entropy(logits, labels, true);
  CHECK(std::isfinite(loss[0].item<double>()));
  CHECK(std::isnan(loss[1].item<double>()));
}

TEST_CASE("per-token cross-entropy of the output layer: each row's loss and its own gradient",
          "[gpu][kernels]") {
  // The preference losses' path (model::linear_token_cross_entropy): the fused kernel's
  // per-row losses in forward, a recomputed backward scaled row by row; against the formula
  // over the whole logits.
  const at::Device cuda(at::kCUDA, 0);
  for (const auto& [dtype, frozen] :
       std::vector<std::pair<at::ScalarType, bool>>{{at::kBFloat16, false},
                                                    {at::kFloat, false},
                                                    {at::kBFloat16, true},
                                                    {at::kFloat, true}}) {
    INFO(c10::toString(dtype) << (frozen ? ", frozen weight (eager)" : ""));
    const auto opts = at::TensorOptions().device(cuda).dtype(dtype);
    at::manual_seed(21);
    const int64_t rows = 300, hidden = 96, vocab = 5003;
    const at::Tensor h0 = at::randn({rows, hidden}, opts),
                     w0 = at::randn({vocab, hidden}, opts) * 0.1;
    at::Tensor labels = at::randint(0, vocab, {rows}, opts.dtype(at::kLong));
    labels.narrow(0, 40, 9).fill_(-100);
    const at::Tensor weights = at::randn({rows}, opts.dtype(at::kFloat));
    at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(!frozen);
    const at::Tensor got = zt::model::linear_token_cross_entropy(h, w, labels, 64);
    (got * weights).sum().backward();
    at::Tensor hr = h0.to(at::kFloat).requires_grad_(true),
               wr = w0.to(at::kFloat).requires_grad_(true);
    const at::Tensor logits = at::matmul(hr, wr.t());
    const at::Tensor want =
        (at::logsumexp(logits, 1) - logits.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)) *
        labels.ne(-100);
    (want * weights).sum().backward();
    const double tol = dtype == at::kFloat ? 1e-4 : 3e-2;
    CHECK(at::allclose(got, want, tol, tol));
    CHECK((got.narrow(0, 40, 9) == 0).all().item<bool>());
    std::vector<std::pair<at::Tensor, at::Tensor>> grads;
    grads.emplace_back(h.grad(), hr.grad());
    if (!frozen) grads.emplace_back(w.grad(), wr.grad());
    for (const auto& [g, r] : grads) {
      const double scale = r.abs().max().item<double>();
      INFO("worst gradient error " << (g.to(at::kFloat) - r).abs().max().item<double>() / scale);
      CHECK((g.to(at::kFloat) - r).abs().max().item<double>() <= tol * scale);
    }
  }
}

TEST_CASE("fused AdamW on fp32 masters from a bf16 gradient equals it on the widened gradient",
          "[gpu][kernels]") {
  const at::Device cuda(at::kCUDA, 0);
  const auto f32 = at::TensorOptions().device(cuda).dtype(at::kFloat);
  for (at::ScalarType compute : {at::kBFloat16, at::kHalf}) {
    for (int64_t offset : {0, 3}) {  // 3: views that are not aligned take the scalar loop
      INFO(c10::toString(compute) << ", offset " << offset);
      const int64_t n = 4 * (int64_t{1} << 16) + 3;
      at::manual_seed(13);
      at::Tensor p = at::randn({n + offset}, f32), m = at::zeros_like(p), v = at::zeros_like(p);
      at::Tensor p_ref = p.clone(), m_ref = m.clone(), v_ref = v.clone();
      at::Tensor copy = at::zeros({n + offset}, f32.dtype(compute));
      at::Tensor sq = at::zeros({}, f32), sq_ref = at::zeros({}, f32);
      auto view = [&](const at::Tensor& t) { return t.narrow(0, offset, n); };
      zt::UpdateHyper h;
      h.lr = 1e-3;
      h.weight_decay = 0.1;
      for (int64_t step = 1; step <= 3; ++step) {
        h.step = step;
        const at::Tensor g = (at::randn({n + offset}, f32) * 1e-2).to(compute);
        REQUIRE(
            zt::kernels::fused_adamw_mixed_applies(view(p), view(g), view(m), view(v), view(copy)));
        zt::kernels::fused_adamw_mixed(view(p), view(g), view(m), view(v), h, sq, view(copy));
        const at::Tensor g32 = view(g).to(at::kFloat);
        zt::kernels::fused_adamw(view(p_ref), g32, view(m_ref), view(v_ref), h, sq_ref);
        // The same arithmetic, within a few ulps where nvcc contracts the kernels differently.
        // An ulp of the tensor's scale, not of each element: m = β1·m + (1 − β1)·g cancels to
        // near zero in places, where a rounding of its terms is many ulps of the result.
        auto ulps = [](const at::Tensor& a, const at::Tensor& b) {
          const at::Tensor b64 = b.to(at::kDouble);
          return ((a.to(at::kDouble) - b64).abs() /
                  ((b64.abs() + b64.abs().mean()) * std::ldexp(1.0, -23) + 1e-38))
              .max()
              .item<double>();
        };
        INFO("step " << step << ": ulps p " << ulps(p, p_ref) << ", m " << ulps(m, m_ref) << ", v "
                     << ulps(v, v_ref));
        CHECK(ulps(p, p_ref) <= 4);
        CHECK(ulps(m, m_ref) <= 4);
        CHECK(ulps(v, v_ref) <= 4);
        CHECK(at::equal(view(copy), view(p).to(compute)));
        if (offset > 0) CHECK((copy.narrow(0, 0, offset) == 0).all().item<bool>());
      }
      CHECK(sq.item<double>() == Approx(sq_ref.item<double>()).epsilon(1e-5));
    }
  }
}
