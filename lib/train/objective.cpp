// The objectives' shared part — the default step over micro-batches, the reference model — and
// the next-token objective of stages sft and pt.
#include "train/objective.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include <fmt/format.h>

#include "comm/groups.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt::train {

Objective::~Objective() = default;

int64_t Objective::samples_of(const Dataset& d, const std::string& path) const {
  (void)path;
  return d.size();
}

int64_t Objective::steps_per_epoch(bool drop_last) const {
  return zt::steps_per_epoch(t_.train_samples, t_.batch.size(), drop_last);
}

std::vector<int64_t> Objective::epoch_order(int64_t epoch, bool shuffle, int64_t megabatch) const {
  return zt::epoch_order(t_.train_samples, t_.data_seed, epoch, shuffle,
                         t_.args.group_by_length ? &t_.train_lengths : nullptr, megabatch);
}

Trainer::Impl::StepResult Objective::step(const std::vector<int64_t>& order) {
  Trainer::Impl& I = t_;
  const int64_t s = I.state.steps_in_epoch;
  // The whole global batch's counts, the same on every rank without communication: the
  // targets normalize the summed losses (HF's num_items_in_batch: tokens, or for preference
  // data the pairs or KTO's examples, whose loss is a mean over them).
  int64_t targets = 0, tokens = 0;
  std::vector<int64_t> samples;  // the global batch's
  for (int64_t a = 0; a < I.batch.accumulation; ++a) {
    for (int64_t r = 0; r < I.data_world; ++r) {
      for (int64_t i : micro_batch_indices(order, I.batch, s, a, r)) {
        samples.push_back(i);
        targets += I.train_targets[static_cast<size_t>(i)];
        tokens += I.train_lengths[static_cast<size_t>(i)];
      }
    }
  }
  std::vector<std::vector<int64_t>> mine;
  for (int64_t a = 0; a < I.batch.accumulation; ++a) {
    mine.push_back(micro_batch_indices(order, I.batch, s, a, I.data_rank));
  }
  const double divisor = static_cast<double>(std::max<int64_t>(1, targets));
  begin_step(samples, mine, divisor);
  Trainer::Impl::StepResult out;
  out.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(I.comm->device()));
  out.tokens = tokens;
  for (const std::vector<int64_t>& indices : mine) {
    LossSum l = forward(indices, Split::kTrain);
    // transformers adds router_aux_loss_coef · aux to each micro-batch's loss, which HF Trainer
    // sums over the accumulation steps and the ranks (the token-normalized loss times the
    // ranks, averaged): so the objective here adds each one whole.
    at::Tensor objective = l.sum;
    if (l.aux.defined()) objective = objective + l.aux * (divisor * l.aux_coef);
    I.engine->backward(objective, divisor);
    I.engine->step();
    out.loss += l.sum.detach() / divisor;
    if (l.aux.defined()) out.loss += l.aux.detach() * l.aux_coef;
  }
  return out;
}

double Objective::evaluate() {
  Trainer::Impl& I = t_;
  at::NoGradGuard no_grad;
  I.model->eval();
  std::vector<std::vector<int64_t>> batches =
      eval_batches(I.eval_samples, I.data_world, I.data_rank, I.args.per_device_eval_batch_size);
  double sum = 0.0, tokens = 0.0;
  begin_evaluation(batches);
  for (const std::vector<int64_t>& indices : batches) {
    // A rank with nothing left still runs a forward (ZeRO-3 forwards are collective), unweighted:
    // its loss and metric sums are not counted.
    const bool empty = indices.empty();
    LossSum l = forward(empty ? std::vector<int64_t>{0} : indices,
                        empty ? Split::kEvalUncounted : Split::kEval);
    if (!empty) {
      sum += l.sum.item<double>();
      tokens += static_cast<double>(l.tokens);
    }
  }
  I.model->train();
  end_evaluation();
  const std::vector<double> global = comm::reduce_scalars(*I.comm, {sum, tokens});
  if (global[1] <= 0) {
    throw ConfigError(fmt::format("'{}' has no token that counts in the loss", I.args.eval_file));
  }
  return global[0] / global[1];
}

void Objective::check_pair_steps() const {
  throw InvalidArgument(fmt::format(
      "train_preference_step: the run trains {}; set stage dpo in its options for "
      "preference pairs",
      t_.args.stage == "grpo" ? "from sampled completions (stage grpo)" : "next-token losses"));
}

LossSum Objective::pair_loss(const at::Tensor& ids, const at::Tensor& labels) {
  (void)ids;
  (void)labels;
  check_pair_steps();
  return {};
}

ScoringMode::ScoringMode(CausalLM& model, bool adapters_off)
    : model_(model), training_(model.is_training()) {
  model_.eval();
  if (adapters_off) model_.set_adapters_enabled(false);
}

ScoringMode::~ScoringMode() {
  model_.set_adapters_enabled(true);
  if (training_) model_.train();
}

at::Tensor Objective::reference_token_log_probs(const at::Tensor& ids, const at::Tensor& labels,
                                                double temperature) {
  at::NoGradGuard no_grad;
  CausalLM& model = *t_.model;
  ScoringMode scoring(model, /*adapters_off=*/!reference_weights);
  const auto score = [&] {
    return model.label_log_probs(ids, labels, {}, 1024, {}, nullptr, temperature);
  };
  if (!reference_weights) return score();
  // The frozen reference: the starting trainable weights (with adapters, the adapters' starting
  // values, the adapters on) swapped in for this forward, and out again whatever happens.
  t_.engine->swap_parameters(*reference_weights);
  at::Tensor out;
  try {
    out = score();
  } catch (...) {
    t_.engine->swap_parameters(*reference_weights);
    throw;
  }
  t_.engine->swap_parameters(*reference_weights);
  return out;
}

namespace {

// The sum over a group of ranks, backward too (every member's loss reads the sum).
class GroupSum : public torch::autograd::Function<GroupSum> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            Communicator* comm, const std::vector<int64_t>& group) {
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    ctx->saved_data["group"] = group;
    return sum(*comm, rows, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The trainer owns the communicator past every backward of its steps.
    auto* comm =
        reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    return {sum(*comm, grads[0], ctx->saved_data["group"].toIntVector()), at::Tensor(),
            at::Tensor()};
  }

 private:
  static at::Tensor sum(Communicator& comm, const at::Tensor& rows,
                        const std::vector<int64_t>& group) {
    const std::vector<int> members(group.begin(), group.end());
    at::Tensor out = rows.detach().to(comm.device(), at::kFloat).contiguous().clone();
    comm::group_all_reduce(comm, out, members)->wait();
    return out.to(rows.device(), rows.scalar_type());
  }
};

}  // namespace

at::Tensor Objective::sequence_sum(const at::Tensor& rows) const {
  const int64_t size = t_.sequence_parallel;
  if (size == 1) return rows;
  std::vector<int64_t> group;
  for (int64_t j = 0; j < size; ++j) group.push_back(t_.data_rank * size + j);
  return GroupSum::apply(rows, t_.comm.get(), group);
}

int64_t Objective::counted_once(int64_t count) const {
  return t_.rank % t_.sequence_parallel == 0 ? count : 0;
}

namespace {

// Stages sft and pt: the summed token losses of (packed) sequences, normalized by the global
// batch's counted tokens.
class NextTokenObjective final : public Objective {
 public:
  using Objective::Objective;
  const char* sample_name() const override { return "examples"; }

  void index_training_data() override {
    Trainer::Impl& I = t_;
    if (I.args.packing) {
      std::vector<int64_t> order(static_cast<size_t>(I.train_data.size()));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      const int64_t before = I.train_data.size();
      I.train_data = pack(I.train_data, I.args.max_length, order);
      if (I.rank == 0)
        log::info("packing: {} examples into {} sequences of at most {} tokens", before,
                  I.train_data.size(), I.args.max_length);
    }
    I.train_lengths = I.train_data.lengths();
    I.train_targets.resize(static_cast<size_t>(I.train_data.size()));
    for (int64_t i = 0; i < I.train_data.size(); ++i) {
      // The tokens the loss counts: labels after the causal shift (a row's first label is never
      // predicted), as CausalLM::loss counts them.
      TokenView labels = I.train_data.labels(i);
      int64_t n = 0;
      for (int64_t t = 1; t < labels.size; ++t) n += labels[t] != kIgnoreLabel;
      I.train_targets[static_cast<size_t>(i)] = n;
    }
    I.train_samples = I.train_data.size();
  }
  LossSum forward(const std::vector<int64_t>& samples, Split split) override {
    return t_.forward(
        collate(split == Split::kTrain ? t_.train_data : t_.eval_data, samples, t_.pad_id));
  }
};

}  // namespace

}  // namespace zt::train

namespace zt {

const char* Trainer::Impl::sample_name() const {
  return objective->sample_name();
}

}  // namespace zt

namespace zt::train {

std::unique_ptr<Objective> make_objective(Trainer::Impl& trainer) {
  const std::string& stage = trainer.args.stage;
  if (stage == "dpo" || stage == "kto") return make_preference_objective(trainer);
  if (stage == "grpo") return make_grpo_objective(trainer);
  return std::make_unique<NextTokenObjective>(trainer);
}

}  // namespace zt::train
