// Batches the host program makes itself (Trainer::train_step, Trainer::evaluate_batches, the
// C API's zt_trainer_step): checked against the vocabulary, normalized by the global batch's
// counted tokens as the training loop does.
#include <algorithm>
#include <exception>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "train/objective.hpp"
#include "train/trainer_impl.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt {

namespace {

// Token ids from a caller: [batch, seq] integers inside [0, vocab) (labels may also be -100).
at::Tensor checked_tokens(const at::Tensor& t, const char* what, int64_t vocab, bool labels) {
  if (!t.defined() || t.dim() != 2 || t.size(0) < 1 || t.size(1) < 1) {
    throw InvalidArgument(
        fmt::format("{}: expected a [batch, seq] tensor with both sizes positive", what));
  }
  if (at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool) {
    throw InvalidArgument(fmt::format("{}: expected integer token ids, found {}", what,
                                      c10::toString(t.scalar_type())));
  }
  at::Tensor ids = t.to(at::kLong).contiguous();
  at::Tensor bad = labels ? at::logical_and(ids.ne(-100), at::logical_or(ids.lt(0), ids.ge(vocab)))
                          : at::logical_or(ids.lt(0), ids.ge(vocab));
  if (bad.any().item<bool>()) {
    at::Tensor where = bad.nonzero()[0];
    const int64_t r = where[0].item<int64_t>(), c = where[1].item<int64_t>();
    throw InvalidArgument(fmt::format("{}: {} at [{}, {}] is outside the vocabulary [0, {}){}",
                                      what, ids[r][c].item<int64_t>(), r, c, vocab,
                                      labels ? " (and is not -100)" : ""));
  }
  return ids;
}

}  // namespace

StepStats Trainer::train_step(const at::Tensor& input_ids, const at::Tensor& labels) {
  return impl_->posting_failures([&] { return impl_->train_step(input_ids, labels); });
}

StepStats Trainer::Impl::train_step(const at::Tensor& input_ids, const at::Tensor& labels) {
  Impl& I = *this;
  I.objective->check_token_steps();
  const int64_t vocab = I.model_config.vocab_size;
  at::Tensor ids = checked_tokens(input_ids, "train_step input_ids", vocab, false);
  at::Tensor y = labels.defined() ? checked_tokens(labels, "train_step labels", vocab, true) : ids;
  if (y.sizes() != ids.sizes()) {
    throw InvalidArgument(fmt::format("train_step: labels have shape [{}] but input_ids [{}]",
                                      fmt::join(y.sizes(), ", "), fmt::join(ids.sizes(), ", ")));
  }
  I.model->train();
  return I.host_step(I.forward_tokens(ids, y));
}

StepStats Trainer::train_preference_step(const at::Tensor& chosen_ids,
                                         const at::Tensor& chosen_labels,
                                         const at::Tensor& rejected_ids,
                                         const at::Tensor& rejected_labels) {
  return impl_->posting_failures([&] {
    return impl_->train_preference_step(chosen_ids, chosen_labels, rejected_ids, rejected_labels);
  });
}

StepStats Trainer::Impl::train_preference_step(const at::Tensor& chosen_ids,
                                               const at::Tensor& chosen_labels,
                                               const at::Tensor& rejected_ids,
                                               const at::Tensor& rejected_labels) {
  Impl& I = *this;
  I.objective->check_pair_steps();
  const int64_t vocab = I.model_config.vocab_size;
  const char* fn = "train_preference_step";
  const at::Tensor c = checked_tokens(chosen_ids, "train_preference_step chosen_ids", vocab, false);
  const at::Tensor r =
      checked_tokens(rejected_ids, "train_preference_step rejected_ids", vocab, false);
  const at::Tensor cy =
      checked_tokens(chosen_labels, "train_preference_step chosen_labels", vocab, true);
  const at::Tensor ry =
      checked_tokens(rejected_labels, "train_preference_step rejected_labels", vocab, true);
  if (c.sizes() != r.sizes() || cy.sizes() != c.sizes() || ry.sizes() != c.sizes()) {
    throw InvalidArgument(fmt::format(
        "{}: chosen_ids [{}], chosen_labels [{}], rejected_ids [{}] and rejected_labels [{}] must "
        "have one shape [pairs, seq] (pad the shorter rows, labels -100 there)",
        fn, fmt::join(c.sizes(), ", "), fmt::join(cy.sizes(), ", "), fmt::join(r.sizes(), ", "),
        fmt::join(ry.sizes(), ", ")));
  }
  const at::Tensor scored = at::cat({cy, ry}).narrow(1, 1, c.size(1) - 1).ne(kIgnoreLabel).sum(1);
  if ((scored == 0).any().item<bool>()) {
    throw InvalidArgument(fmt::format(
        "{}: a row has no scored answer token (every label past the first is -100)", fn));
  }
  I.model->train();
  return I.host_step(I.objective->pair_loss(at::cat({c, r}), at::cat({cy, ry})));
}

StepStats Trainer::Impl::host_step(const LossSum& l) {
  Impl& I = *this;
  if (l.aux.defined()) {  // every rank's config alike: all refuse before any collective
    throw ConfigError(
        "output_router_logits: the load-balancing loss is added to the batches the trainer "
        "makes (train()); for batches the host program feeds (train_step) set "
        "output_router_logits false in the model's config.json");
  }
  // The window's count (tokens, or pairs) is learned at its end: the engine normalizes by it.
  I.engine->backward_tokens(l.sum, l.tokens);
  const std::vector<double> totals =
      comm::reduce_scalars(*I.comm, {l.sum.detach().item<double>(), static_cast<double>(l.tokens)});
  StepStats stats;
  stats.stepped = I.engine->step();
  if (stats.stepped) {
    stats.skipped = I.engine->last_step_skipped();
    stats.grad_norm = I.engine->last_grad_norm();
  }
  I.state.global_step = stats.global_step = I.engine->global_step();
  if (stats.stepped && I.state.global_step > I.total_steps && !I.warned_past_max_steps) {
    I.warned_past_max_steps = true;
    if (I.rank == 0) {
      log::warn(
          "train_step: optimizer step {} is past max_steps {}: the learning-rate schedule has "
          "run out (the rate is now {:g}); raise max_steps in the options to keep training",
          I.state.global_step, I.total_steps, I.engine->learning_rate());
    }
  }
  stats.loss = totals[0] / std::max(1.0, totals[1]);
  stats.learning_rate = I.engine->learning_rate();
  stats.loss_scale = I.engine->loss_scale();
  return stats;
}

double Trainer::evaluate_batches(const std::vector<std::pair<at::Tensor, at::Tensor>>& batches) {
  Impl& I = *impl_;
  // Every rank must run the same number of forwards (ZeRO-3 forwards are collective).
  const double given = static_cast<double>(batches.size());
  const std::vector<double> c = comm::reduce_scalars(*I.comm, {given, -given}, ReduceOp::kMax);
  if (c[0] != -c[1] || c[0] == 0.0) {
    throw InvalidArgument(
        fmt::format("evaluate: every rank must give the same, nonzero number of batches "
                    "(this rank gave {}, others up to {})",
                    batches.size(), c[0]));
  }
  at::NoGradGuard no_grad;
  I.model->eval();
  double sum = 0.0, tokens = 0.0;
  std::exception_ptr error;
  for (const auto& [input_ids, labels] : batches) {
    at::Tensor ids, y;
    try {
      ids = checked_tokens(input_ids, "evaluate input_ids", I.model_config.vocab_size, false);
      y = labels.defined()
              ? checked_tokens(labels, "evaluate labels", I.model_config.vocab_size, true)
              : ids;
      if (y.sizes() != ids.sizes())
        throw InvalidArgument("evaluate: labels and input_ids differ in shape");
    } catch (...) {
      if (!error) error = std::current_exception();
      ids = y = at::zeros({1, 1}, at::kLong);  // still take part in the collective forward
    }
    LossSum l = I.forward_tokens(ids, y);
    if (!error) {
      sum += l.sum.item<double>();
      tokens += static_cast<double>(l.tokens);
    }
  }
  I.model->train();
  const std::vector<double> global =
      comm::reduce_scalars(*I.comm, {sum, tokens, error ? 1.0 : 0.0});
  if (error) std::rethrow_exception(error);
  if (global[2] > 0)
    throw InvalidArgument("evaluate: another rank gave an invalid batch (see its error)");
  if (global[1] <= 0)
    throw InvalidArgument("evaluate: the batches have no token that counts in the loss");
  return global[0] / global[1];
}

LossSum Trainer::Impl::forward_tokens(const at::Tensor& ids, const at::Tensor& labels) {
  return model->loss(ids.to(comm->device()), labels, {}, 1024);
}

}  // namespace zt
