// The output layer and cross-entropy in chunks of rows, never holding [tokens, vocab] logits
// whole (model::linear_cross_entropy).
#include "model/layers.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "kernels/fused.hpp"

namespace zt::model {
namespace {

// From a chunk's d loss / d logits `dl` (h's dtype): grad_rows = dl · weight (if defined) and,
// with `weight_grad`, grad_weight += dlᵀ · h (the first chunk's product, so no zero-fill pass).
void chunk_products(const at::Tensor& dl, const at::Tensor& h, const at::Tensor& weight,
                    at::Tensor grad_rows, bool weight_grad, at::Tensor& grad_weight) {
  if (grad_rows.defined()) at::mm_out(grad_rows, dl, weight);
  if (!weight_grad) return;  // a frozen head (LoRA, prefix tuning): no [vocab, hidden] GEMM
  if (grad_weight.defined()) {
    grad_weight.addmm_(dl.t(), h);
  } else {
    grad_weight = at::mm(dl.t(), h);
  }
}

// One chunk's share of the cross-entropy gradients. `p` (fp32 [len, vocab]) holds the chunk's
// softmax and becomes d loss / d logits = (softmax − onehot) on valid rows, times `scale` (the
// incoming gradient; undefined: 1), then chunk_products (`grad_rows`: the chunk's rows of the
// hidden-state gradient, contiguous; undefined: not wanted).
void add_chunk_gradients(at::Tensor& p, const at::Tensor& y, const at::Tensor& scale,
                         const at::Tensor& h, const at::Tensor& weight, at::Tensor grad_rows,
                         bool weight_grad, at::Tensor& grad_weight,
                         const at::Tensor& capped = at::Tensor(), double cap = 0.0) {
  p.scatter_add_(1, y.clamp_min(0).unsqueeze(1), at::full({p.size(0), 1}, -1.0, p.options()));
  at::Tensor mask = y.ne(-100).to(at::kFloat).unsqueeze(1);
  p.mul_(scale.defined() ? mask * scale : mask);
  // Soft-capped logits c = cap·tanh(z / cap): dc/dz = 1 − (c / cap)².
  if (capped.defined()) p.mul_(1.0 - (capped / cap).square());
  chunk_products(p.to(h.scalar_type()), h, weight, std::move(grad_rows), weight_grad, grad_weight);
}

// A chunk's logits in fp32, soft-capped to cap · tanh(z / cap) when `cap` > 0 (Gemma 2).
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight, double cap) {
  at::Tensor z = at::matmul(h, weight.t()).to(at::kFloat);
  return cap > 0 ? at::tanh(z / cap) * cap : z;
}

// Backward by recomputation, from the inputs forward saved (hidden, weight, labels) and the
// chunk size: each chunk's softmax again, its d loss / d logits scaled by the incoming gradient
// `g` (a scalar, or [rows]: one per row), then the chunk's products. Returns the gradients of
// hidden and (when wanted) weight.
std::pair<at::Tensor, at::Tensor> recomputed_gradients(torch::autograd::AutogradContext* ctx,
                                                       const at::Tensor& g) {
  auto saved = ctx->get_saved_variables();
  const at::Tensor& hidden = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor& labels = saved[2];
  const int64_t chunk = ctx->saved_data["chunk"].toInt();
  const double cap = ctx->saved_data["softcap"].toDouble();
  at::Tensor grad_hidden = at::empty(hidden.sizes(), hidden.options());  // contiguous rows
  at::Tensor grad_weight;
  const bool per_row = g.dim() == 1;
  const int64_t n = hidden.size(0);
  for (int64_t lo = 0; lo < n; lo += chunk) {
    const int64_t len = std::min(chunk, n - lo);
    at::Tensor h = hidden.narrow(0, lo, len);
    const at::Tensor logits = chunk_logits(h, weight, cap);
    at::Tensor p = at::softmax(logits, 1);
    add_chunk_gradients(p, labels.narrow(0, lo, len),
                        per_row ? g.narrow(0, lo, len).unsqueeze(1) : g, h, weight,
                        grad_hidden.narrow(0, lo, len), ctx->needs_input_grad(1), grad_weight,
                        cap > 0 ? logits : at::Tensor(), cap);
  }
  return {grad_hidden, grad_weight};
}

// Σ of token cross-entropies over chunks of rows. Two ways to get the gradient:
//  - eager (the gradient is wanted and the dtype is not fp16): each chunk's d loss / d logits
//    is formed while its logits exist, and the gradients of hidden and weight for a loss
//    gradient of 1 are computed in forward; backward only scales them by the incoming
//    gradient — the [rows, vocab] product is computed once instead of twice.
//  - recomputing: forward keeps only its inputs; backward recomputes each chunk's logits. For
//    fp16, where the incoming gradient carries the loss scale that keeps small gradients from
//    flushing to zero, it has to be applied before the products.
class LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            bool eager_hidden, bool eager_weight, double cap) {
    const bool eager = eager_hidden || eager_weight;
    if (eager) {
      ctx->saved_data["eager"] = true;
    } else {
      ctx->save_for_backward({hidden, weight, labels});
      ctx->saved_data["chunk"] = chunk;
      ctx->saved_data["softcap"] = cap;
    }
    at::Tensor losses = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
    at::Tensor grad_hidden, grad_weight;
    if (eager_hidden) grad_hidden = at::empty(hidden.sizes(), hidden.options());  // contiguous rows
    const int64_t n = hidden.size(0);
    for (int64_t lo = 0; lo < n; lo += chunk) {
      const int64_t len = std::min(chunk, n - lo);
      at::Tensor h = hidden.narrow(0, lo, len);
      at::Tensor y = labels.narrow(0, lo, len);
      at::Tensor logits = at::matmul(h, weight.t());
      if (kernels::fused_cross_entropy_applies(logits, y)) {
        // One kernel: the rows' losses, and with `eager` d loss / d logits over the logits.
        losses.narrow(0, lo, len).copy_(kernels::fused_cross_entropy(logits, y, eager, cap));
        if (eager) {
          chunk_products(logits, h, weight,
                         eager_hidden ? grad_hidden.narrow(0, lo, len) : at::Tensor(), eager_weight,
                         grad_weight);
        }
        continue;
      }
      at::Tensor valid = y.ne(-100);
      logits = logits.to(at::kFloat);
      if (cap > 0) logits = at::tanh(logits / cap) * cap;
      at::Tensor target = logits.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);
      at::Tensor lse = at::logsumexp(logits, 1);
      losses.narrow(0, lo, len).copy_((lse - target) * valid);
      if (!eager) continue;
      const at::Tensor capped = cap > 0 ? logits.clone() : at::Tensor();
      logits.sub_(lse.unsqueeze(1)).exp_();  // the softmax, in the logits' memory
      add_chunk_gradients(logits, y, at::Tensor(), h, weight,
                          eager_hidden ? grad_hidden.narrow(0, lo, len) : at::Tensor(),
                          eager_weight, grad_weight, capped, cap);
    }
    const at::Tensor total = losses.sum();
    if (eager) {
      ctx->saved_data["grad_hidden"] = grad_hidden;
      ctx->saved_data["grad_weight"] = grad_weight;
    }
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    if (ctx->saved_data.count("eager") > 0) {
      // Scaled in place and handed over: this graph is not back-propagated twice.
      at::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
      at::Tensor grad_weight = ctx->saved_data["grad_weight"].toTensor();
      ctx->saved_data.erase("grad_hidden");
      ctx->saved_data.erase("grad_weight");
      if (grad_hidden.defined()) grad_hidden.mul_(g);
      if (grad_weight.defined()) grad_weight.mul_(g);
      return {grad_hidden,  grad_weight,  at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto [grad_hidden, grad_weight] = recomputed_gradients(ctx, g);
    return {grad_hidden,  grad_weight,  at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Per-row cross-entropies. A row's gradient is its incoming gradient times that of a unit
// gradient, so where the weight is frozen (LoRA, prefix tuning) and the dtype is not fp16,
// forward forms each chunk's hidden-state gradient for a unit gradient while its logits exist
// and backward scales its rows (eager, as linear_cross_entropy). Otherwise forward keeps its
// inputs and backward recomputes each chunk's softmax, scaled row by row.
class LinearTokenCrossEntropy : public torch::autograd::Function<LinearTokenCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            bool eager, double cap) {
    at::Tensor grad_hidden, unused;
    if (eager) {
      grad_hidden = at::empty(hidden.sizes(), hidden.options());  // contiguous rows
    } else {
      ctx->save_for_backward({hidden, weight, labels});
      ctx->saved_data["chunk"] = chunk;
      ctx->saved_data["softcap"] = cap;
    }
    at::Tensor losses = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
    const int64_t n = hidden.size(0);
    for (int64_t lo = 0; lo < n; lo += chunk) {
      const int64_t len = std::min(chunk, n - lo);
      at::Tensor h = hidden.narrow(0, lo, len);
      at::Tensor y = labels.narrow(0, lo, len);
      at::Tensor logits = at::matmul(h, weight.t());
      if (kernels::fused_cross_entropy_applies(logits, y)) {
        losses.narrow(0, lo, len).copy_(kernels::fused_cross_entropy(logits, y, eager, cap));
        if (eager) chunk_products(logits, h, weight, grad_hidden.narrow(0, lo, len), false, unused);
        continue;
      }
      logits = logits.to(at::kFloat);
      if (cap > 0) logits = at::tanh(logits / cap) * cap;
      at::Tensor target = logits.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);
      at::Tensor lse = at::logsumexp(logits, 1);
      losses.narrow(0, lo, len).copy_((lse - target) * y.ne(-100));
      if (!eager) continue;
      const at::Tensor capped = cap > 0 ? logits.clone() : at::Tensor();
      logits.sub_(lse.unsqueeze(1)).exp_();  // the softmax, in the logits' memory
      add_chunk_gradients(logits, y, at::Tensor(), h, weight, grad_hidden.narrow(0, lo, len), false,
                          unused, capped, cap);
    }
    if (eager) ctx->saved_data["grad_hidden"] = grad_hidden;
    return losses;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor g = grads[0].to(at::kFloat);
    if (ctx->saved_data.count("grad_hidden") > 0) {
      // Scaled in place and handed over: this graph is not back-propagated twice.
      at::Tensor grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
      ctx->saved_data.erase("grad_hidden");
      grad_hidden.mul_(g.unsqueeze(1));
      return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto [grad_hidden, grad_weight] = recomputed_gradients(ctx, g);
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor row_mean_logits(const at::Tensor& hidden, const at::Tensor& weight, double softcap) {
  at::NoGradGuard no_grad;
  if (softcap > 0) {
    // Capped logits are no linear function of the hidden states: averaged as they are, a chunk
    // of rows at a time.
    constexpr int64_t kChunk = 1024;
    const int64_t n = hidden.size(0);
    at::Tensor out = at::empty({n}, hidden.options().dtype(at::kFloat));
    for (int64_t lo = 0; lo < n; lo += kChunk) {
      const int64_t len = std::min(kChunk, n - lo);
      out.narrow(0, lo, len)
          .copy_(
              chunk_logits(hidden.detach().narrow(0, lo, len), weight.detach(), softcap).mean(1));
    }
    return out;
  }
  // Summed in fp32 (a bf16 sum over 150k rows would lose the digits that matter), a block of
  // rows at a time: never an fp32 copy of the whole [vocab, hidden] weight.
  constexpr int64_t kRows = 16384;
  const int64_t vocab = weight.size(0);
  at::Tensor sum = at::zeros({weight.size(1)}, weight.options().dtype(at::kFloat));
  for (int64_t lo = 0; lo < vocab; lo += kRows) {
    sum.add_(weight.narrow(0, lo, std::min(kRows, vocab - lo)).detach().to(at::kFloat).sum(0));
  }
  return at::mv(hidden.detach().to(at::kFloat), sum.div_(static_cast<double>(vocab)));
}

at::Tensor row_entropies(const at::Tensor& hidden, const at::Tensor& weight, double softcap) {
  at::NoGradGuard no_grad;
  // H = logsumexp(z) − Σ softmax(z)·z, in fp32; 256 rows at a time bound the memory to two
  // [256, vocab] fp32 blocks.
  constexpr int64_t kChunk = 256;
  const int64_t n = hidden.size(0);
  at::Tensor out = at::empty({n}, hidden.options().dtype(at::kFloat));
  for (int64_t lo = 0; lo < n; lo += kChunk) {
    const int64_t len = std::min(kChunk, n - lo);
    const at::Tensor z = chunk_logits(hidden.detach().narrow(0, lo, len), weight.detach(), softcap);
    const at::Tensor lse = at::logsumexp(z, 1, /*keepdim=*/true);
    const at::Tensor weighted = (z - lse).exp_().mul_(z).sum(1);
    out.narrow(0, lo, len).copy_(lse.squeeze(1) - weighted);
  }
  return out;
}

at::Tensor linear_token_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& labels, int64_t chunk, bool eager_gradients,
                                      double softcap) {
  const bool eager = eager_gradients && at::GradMode::is_enabled() && hidden.requires_grad() &&
                     !weight.requires_grad() && hidden.scalar_type() != at::kHalf;
  return LinearTokenCrossEntropy::apply(hidden, weight, labels, std::max<int64_t>(1, chunk), eager,
                                        softcap);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& labels, int64_t chunk, bool eager_gradients,
                                double softcap) {
  const bool grads =
      eager_gradients && at::GradMode::is_enabled() && hidden.scalar_type() != at::kHalf;
  return LinearCrossEntropy::apply(hidden, weight, labels, std::max<int64_t>(1, chunk),
                                   grads && hidden.requires_grad(), grads && weight.requires_grad(),
                                   softcap);
}

}  // namespace zt::model
