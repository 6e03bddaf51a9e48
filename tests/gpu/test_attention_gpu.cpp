// Variable-length attention over document spans (FlashAttention's varlen kernels) against the
// masked attention it replaces and against each document alone, on one GPU, in bf16. The truth
// both sides approximate is the same computation in fp32; each bf16 path must be about as close
// to it as the other.
#include "support/catch.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "model/layers.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

namespace {

const at::Device kGpu(at::kCUDA, 0);

// ‖a − truth‖ / ‖truth‖ in fp64.
double rel_error(const at::Tensor& a, const at::Tensor& truth) {
  at::Tensor t = truth.to(at::kDouble).cpu();
  return (a.to(at::kDouble).cpu() - t).norm().item<double>() /
         std::max(1e-30, t.norm().item<double>());
}

// Rows of documents (lengths; 0 = that much padding): the mask (document numbers from 1, 0 on
// padding) and the positions restarting per document.
struct Packed {
  at::Tensor mask, positions;
};
Packed pack_rows(const std::vector<std::vector<int64_t>>& rows, int64_t width) {
  Packed p{at::zeros({static_cast<int64_t>(rows.size()), width}, at::kLong),
           at::zeros({static_cast<int64_t>(rows.size()), width}, at::kLong)};
  for (size_t r = 0; r < rows.size(); ++r) {
    int64_t t = 0, doc = 0;
    for (int64_t n : rows[r]) {
      if (n > 0) {
        p.mask[r].narrow(0, t, n).fill_(++doc);
        p.positions[r].narrow(0, t, n).copy_(at::arange(n, at::kLong));
      }
      t += std::abs(n);
    }
  }
  return p;
}

struct Grads {
  at::Tensor out, dx, dq, dk, dv;
};

// One attention layer's output on x and the gradients of x and the q/k/v weights for `g`.
Grads run_attention(model::Attention& attn, const at::Tensor& x0, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& mask,
                    const model::DocumentSpans* spans, const at::Tensor& g) {
  for (auto& p : attn.parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor x = x0.detach().clone().requires_grad_(true);
  at::Tensor out = attn.forward(x, cos, sin, mask, nullptr, spans);
  out.backward(g.to(out.scalar_type()));
  return {out.detach(), x.grad(), attn.q_proj->weight.grad(), attn.k_proj->weight.grad(),
          attn.v_proj->weight.grad()};
}

// Copies `from`'s parameters into `to` (the same module tree), converting their dtype.
void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  at::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

}  // namespace

TEST_CASE("variable-length attention equals the masked attention on every real token",
          "[gpu][attention]") {
  // Without a window, and with a sliding window shorter than the documents (FlashAttention's
  // window_size_left against the masked window).
  for (const std::optional<int64_t> window :
       {std::optional<int64_t>(), std::optional<int64_t>(7)}) {
    INFO("sliding window " << window.value_or(0));
    ModelConfig c;
    c.sliding_window = window;
    c.hidden_size = 256;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;  // grouped-query, as Qwen2.5 and LLaMA-3
    c.head_dim = 64;
    c.intermediate_size = 512;
    c.vocab_size = 64;
    c.qkv_bias = true;
    REQUIRE(model::varlen_attention_applies(c, at::kBFloat16, kGpu));

    const int64_t width = 40;
    const Packed p = pack_rows({{5, 17, 3, 9, -6}, {40}, {12, 12, -16}}, width);
    const at::Tensor real = p.mask.ne(0).unsqueeze(-1).to(kGpu);  // [B, T, 1]

    at::manual_seed(11);
    model::Attention truth_attn(c, model::ParamFactory{at::TensorOptions().device(kGpu)});
    for (auto& w : truth_attn.parameters()) w.detach().normal_(0, 0.08);
    model::Attention attn(
        c, model::ParamFactory{at::TensorOptions().dtype(at::kBFloat16).device(kGpu)});
    copy_parameters(truth_attn, attn);
    const at::Tensor x = at::randn({3, width, c.hidden_size}, at::TensorOptions().device(kGpu));
    const at::Tensor g = at::randn({3, width, c.hidden_size}, at::TensorOptions().device(kGpu)) *
                         real;  // padding's outputs are never used
    auto [cos32, sin32] = model::rotary_tables(c, p.positions.to(kGpu), at::kFloat);
    auto [cos, sin] = model::rotary_tables(c, p.positions.to(kGpu), at::kBFloat16);
    const at::Tensor mask = p.mask.to(kGpu);

    // fp32 with the mask: the truth.
    const Grads t = run_attention(truth_attn, x, cos32, sin32, mask, nullptr, g);
    const Grads dense = run_attention(attn, x.to(at::kBFloat16), cos, sin, mask, nullptr, g);
    const std::optional<model::DocumentSpans> spans = model::document_spans(p.mask, kGpu);
    REQUIRE(spans.has_value());
    const at::Tensor none = at::empty({0}, mask.options());
    const Grads var = run_attention(attn, x.to(at::kBFloat16), cos, sin, none, &*spans, g);

    const std::pair<const char*, std::pair<at::Tensor, at::Tensor>> outputs[] = {
        {"output", {var.out * real, dense.out * real}},
        {"d x", {var.dx * real, dense.dx * real}},
        {"d q_proj", {var.dq, dense.dq}},
        {"d k_proj", {var.dk, dense.dk}},
        {"d v_proj", {var.dv, dense.dv}}};
    const at::Tensor truths[] = {t.out * real, t.dx * real, t.dq, t.dk, t.dv};
    for (size_t i = 0; i < 5; ++i) {
      const double e_var = rel_error(outputs[i].second.first, truths[i]);
      const double e_dense = rel_error(outputs[i].second.second, truths[i]);
      INFO(outputs[i].first << ": varlen " << e_var << ", masked " << e_dense);
      CHECK(e_var < 2 * e_dense + 1e-3);
      CHECK(e_var < 2e-2);
    }

    // The check can fail: spans of whole rows (documents attending across their boundaries) are
    // far from the truth.
    model::DocumentSpans rows;
    rows.cu_seqlens = at::arange(0, 4 * width, width, at::TensorOptions().dtype(at::kInt)).to(kGpu);
    rows.max_length = width;
    const Grads wrong = run_attention(attn, x.to(at::kBFloat16), cos, sin, none, &rows, g);
    CHECK(rel_error(wrong.out * real, truths[0]) > 0.1);
    if (window) {
      // And the window must bind: the spans without it are far from the truth.
      model::Attention unwindowed(
          c, model::ParamFactory{at::TensorOptions().dtype(at::kBFloat16).device(kGpu)});
      copy_parameters(attn, unwindowed);
      unwindowed.spec.window.reset();
      const Grads open = run_attention(unwindowed, x.to(at::kBFloat16), cos, sin, none, &*spans, g);
      CHECK(rel_error(open.out * real, truths[0]) > 0.1);
    }
  }
}

TEST_CASE("a packed batch on the GPU gives each document's own loss and gradients",
          "[gpu][attention][packing]") {
  // The llama fixture (head size 16, two query heads per key-value head) in bf16 on the GPU:
  // packed rows (variable-length attention) against each document alone (no mask), both against
  // the fp32 model's documents alone.
  const std::string dir = std::string(ZT_FIXTURES) + "/models/llama";
  ModelConfig c = load_model_config(dir + "/config.json");
  auto make = [&](at::ScalarType dtype) {
    auto m = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(dtype).device(kGpu), false);
    load_weights(*m, *checkpoint_source(dir));
    return m;
  };
  auto bf16 = make(at::kBFloat16), fp32 = make(at::kFloat);
  REQUIRE(model::varlen_attention_applies(c, at::kBFloat16, kGpu));

  const std::vector<std::vector<int64_t>> rows = {{7, 11, 5, -3}, {26}, {9, 9, -8}};
  const int64_t width = 26;
  const Packed p = pack_rows(rows, width);
  at::manual_seed(5);
  const at::Tensor ids = at::randint(3, c.vocab_size, {3, width}, at::kLong);
  at::Tensor labels = ids.clone();
  labels.masked_fill_(p.mask.eq(0), -100);
  for (size_t r = 0; r < rows.size(); ++r) {  // each document's first label: never predicted
    int64_t t = 0;
    for (int64_t n : rows[r]) {
      if (n > 0) labels[r][t] = -100;
      t += std::abs(n);
    }
  }

  auto grads_of = [](CausalLM& m) {
    std::vector<at::Tensor> g;
    for (const at::Tensor& w : m.parameters()) g.push_back(w.grad().to(at::kFloat).flatten());
    return at::cat(g);
  };
  auto alone = [&](CausalLM& m, double* sum) {
    m.zero_grad();
    *sum = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      int64_t t = 0;
      for (int64_t n : rows[r]) {
        if (n > 0) {
          at::Tensor doc = ids[r].narrow(0, t, n).unsqueeze(0);
          LossSum l = m.loss(doc, doc);
          *sum += l.sum.item<double>();
          l.sum.backward();
        }
        t += std::abs(n);
      }
    }
    return grads_of(m);
  };
  double truth_loss = 0, alone_loss = 0;
  const at::Tensor truth = alone(*fp32, &truth_loss);
  const at::Tensor alone_grads = alone(*bf16, &alone_loss);

  bf16->zero_grad();
  LossSum packed = bf16->loss(ids, labels, p.mask, 1024, p.positions);
  packed.sum.backward();
  const double packed_loss = packed.sum.item<double>();
  const at::Tensor packed_grads = grads_of(*bf16);

  const double e_alone = rel_error(alone_grads, truth), e_packed = rel_error(packed_grads, truth);
  INFO("loss: fp32 " << truth_loss << ", bf16 alone " << alone_loss << ", packed " << packed_loss
                     << "; gradient errors alone " << e_alone << ", packed " << e_packed);
  CHECK(std::abs(packed_loss - truth_loss) <
        2 * std::abs(alone_loss - truth_loss) + 2e-3 * truth_loss);
  CHECK(e_packed < 2 * e_alone + 1e-3);
}
