// Preference losses (see preference.hpp). β is `beta`, ε `label_smoothing`, ρ the policy's
// log-probability minus the reference's, Δ = ρ_chosen − ρ_rejected, a a length average, z0
// KTO's KL estimate.
#include "train/preference.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::train {

PreferenceOptions preference_options(const TrainingArguments& args) {
  PreferenceOptions o;
  o.loss = args.pref_loss;
  for (const char* grpo : {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"}) {
    if (o.loss == grpo) {
      throw ConfigError(fmt::format(
          "pref_loss {}: a GRPO loss_type; train it with stage grpo (stage {} takes sigmoid, "
          "hinge, ipo, robust, orpo, simpo, kto or apo_zero_unpaired)",
          o.loss, args.stage));
    }
  }
  if (!(args.pref_beta > 0)) {
    throw ConfigError(fmt::format(
        "pref_beta {}: the preference losses' beta is a number > 0 (0 is GRPO's no-KL setting)",
        args.pref_beta));
  }
  const bool kto = args.stage == "kto";
  if (kto && (o.loss == "sigmoid" || o.loss == "kto")) {
    o.loss = "kto";  // LLaMA-Factory's stage kto ignores pref_loss, whose default is sigmoid
  } else if (kto != o.unpaired()) {
    throw ConfigError(
        kto ? fmt::format("pref_loss {}: stage kto trains unpaired examples with the kto loss (or "
                          "TRL's apo_zero_unpaired); {} compares pairs: use stage dpo",
                          o.loss, o.loss)
            : fmt::format("pref_loss {}: a loss of unpaired examples; train it with stage kto",
                          o.loss));
  }
  o.desirable_weight = args.kto_chosen_weight;
  o.undesirable_weight = args.kto_rejected_weight;
  o.beta = args.pref_beta;
  o.label_smoothing = args.dpo_label_smoothing;
  o.simpo_gamma = args.simpo_gamma;
  o.ftx = args.pref_ftx;
  o.rpo_alpha = args.rpo_alpha;
  if (o.label_smoothing > 0 && o.loss != "sigmoid" && o.loss != "robust") {
    throw ConfigError(fmt::format(
        "dpo_label_smoothing {}: label smoothing applies to pref_loss sigmoid (cDPO) and robust, "
        "not {}",
        o.label_smoothing, o.loss));
  }
  if (o.unpaired() && o.rpo_alpha > 0) {
    throw ConfigError(
        fmt::format("rpo_alpha {}: adds the chosen answers' NLL to a pair loss; stage kto has no "
                    "pairs (LLaMA-Factory's pref_ftx adds the desirable completions' NLL)",
                    o.rpo_alpha));
  }
  if (o.loss == "robust" && o.label_smoothing >= 0.5) {
    throw ConfigError(
        fmt::format("dpo_label_smoothing {}: the robust loss divides by 1 − 2ε and needs ε < 0.5",
                    o.label_smoothing));
  }
  return o;
}

namespace {

// The logits metrics' sums: [Σ chosen logits, chosen tokens, Σ rejected logits, rejected
// tokens] ([A] answers' logit sums and [A] token counts); zeros where the logits are undefined.
at::Tensor logit_sums(const at::Tensor& chosen, const at::Tensor& chosen_tokens,
                      const at::Tensor& rejected, const at::Tensor& rejected_tokens,
                      const at::TensorOptions& options) {
  if (!chosen.defined() || !rejected.defined()) return at::zeros({4}, options);
  const auto total = [](const at::Tensor& t) { return t.detach().to(at::kDouble).sum(); };
  return at::stack({total(chosen), total(chosen_tokens), total(rejected), total(rejected_tokens)})
      .to(options.device());
}

// logits/chosen and logits/rejected from the sums above (`at`: where they start).
void add_logits_metrics(std::map<std::string, double>& out, const std::vector<double>& sums,
                        size_t at, const std::string& prefix) {
  if (sums[at + 1] > 0) out[prefix + "logits/chosen"] = sums[at] / sums[at + 1];
  if (sums[at + 3] > 0) out[prefix + "logits/rejected"] = sums[at + 2] / sums[at + 3];
}

}  // namespace

PairLogProbs split_pairs(const at::Tensor& logps, const at::Tensor& tokens,
                         const at::Tensor& logits, const at::Tensor& reference) {
  const int64_t n = logps.size(0) / 2;
  const auto half = [n](const at::Tensor& t, int64_t which) {
    return t.defined() ? t.narrow(0, which * n, n) : at::Tensor();
  };
  PairLogProbs lp;
  lp.chosen = half(logps, 0);
  lp.rejected = half(logps, 1);
  lp.ref_chosen = half(reference, 0);
  lp.ref_rejected = half(reference, 1);
  lp.chosen_tokens = half(tokens, 0);
  lp.rejected_tokens = half(tokens, 1);
  lp.chosen_logits = half(logits, 0);
  lp.rejected_logits = half(logits, 1);
  return lp;
}

at::Tensor answer_logit_sums(const at::Tensor& mean_logits, const at::Tensor& labels) {
  at::Tensor answer = labels.ne(-100).to(mean_logits.device());
  answer.narrow(1, 0, 1).fill_(false);  // the first label is scored by nothing
  return (mean_logits * answer).sum(1);
}

PreferenceLosses preference_losses(const PreferenceOptions& o, const PairLogProbs& lp) {
  const double beta = o.beta, eps = o.label_smoothing;
  const at::Tensor avg_c = lp.chosen / lp.chosen_tokens.clamp_min(1);
  const at::Tensor avg_r = lp.rejected / lp.rejected_tokens.clamp_min(1);
  at::Tensor loss, reward_c, reward_r;
  if (o.uses_reference()) {
    const at::Tensor rho_c = lp.chosen - lp.ref_chosen;
    const at::Tensor rho_r = lp.rejected - lp.ref_rejected;
    const at::Tensor delta = rho_c - rho_r;
    if (o.loss == "sigmoid") {
      loss = -(1 - eps) * at::log_sigmoid(beta * delta) - eps * at::log_sigmoid(-beta * delta);
    } else if (o.loss == "robust") {
      loss = (-(1 - eps) * at::log_sigmoid(beta * delta) + eps * at::log_sigmoid(-beta * delta)) /
             (1 - 2 * eps);
    } else if (o.loss == "hinge") {
      loss = at::relu(1 - beta * delta);
    } else if (o.loss == "ipo") {
      const at::Tensor d = rho_c / lp.chosen_tokens.clamp_min(1) -
                           rho_r / lp.rejected_tokens.clamp_min(1) - 1 / (2 * beta);
      loss = d * d;
    } else {
      throw ConfigError(fmt::format("pref_loss: \"{}\" is not a loss of pairs", o.loss));
    }
    if (o.averages()) {
      reward_c = beta * (rho_c / lp.chosen_tokens.clamp_min(1));
      reward_r = beta * (rho_r / lp.rejected_tokens.clamp_min(1));
    } else {
      reward_c = beta * rho_c;
      reward_r = beta * rho_r;
    }
  } else if (o.loss == "orpo") {
    // log odds(p) = log p − log(1 − p), on the answers' mean log-probabilities.
    const at::Tensor log_odds =
        (avg_c - avg_r) - (at::log1p(-at::exp(avg_c)) - at::log1p(-at::exp(avg_r)));
    loss = -avg_c - beta * at::log_sigmoid(log_odds);
    reward_c = beta * avg_c;
    reward_r = beta * avg_r;
  } else {  // simpo
    loss = -at::log_sigmoid(beta * (avg_c - avg_r) - o.simpo_gamma);
    reward_c = beta * avg_c;
    reward_r = beta * avg_r;
  }
  if (o.ftx > 0) loss = loss + o.ftx * -avg_c;
  PreferenceLosses out;
  out.loss = loss;
  reward_c = reward_c.detach();
  reward_r = reward_r.detach();
  const at::Tensor logps_c = (o.averages() ? avg_c : lp.chosen).detach();
  const at::Tensor logps_r = (o.averages() ? avg_r : lp.rejected).detach();
  const at::Tensor per_pair =
      at::stack({reward_c, reward_r, reward_c.gt(reward_r).to(reward_c.scalar_type()),
                 reward_c - reward_r, logps_c, logps_r},
                1)
          .to(at::kDouble);
  out.sums = at::cat({per_pair.sum(0),
                      at::full({1}, static_cast<double>(lp.chosen.size(0)), per_pair.options()),
                      logit_sums(lp.chosen_logits, lp.chosen_tokens, lp.rejected_logits,
                                 lp.rejected_tokens, per_pair.options())});
  return out;
}

PreferenceLosses unpaired_losses(const PreferenceOptions& o, const UnpairedLogProbs& lp) {
  const double beta = o.beta, z0 = o.uses_kl() ? lp.kl : 0.0;
  const at::Tensor rho = lp.policy - lp.reference;
  const at::Tensor d = lp.desirable.to(rho.device());
  at::Tensor desirable_loss, undesirable_loss;
  if (o.loss == "kto") {
    desirable_loss = 1 - at::sigmoid(beta * (rho - z0));
    undesirable_loss = 1 - at::sigmoid(beta * (z0 - rho));
  } else if (o.loss == "apo_zero_unpaired") {
    desirable_loss = 1 - at::sigmoid(beta * rho);
    undesirable_loss = at::sigmoid(beta * rho);
  } else {
    throw ConfigError(fmt::format("pref_loss: \"{}\" is not a loss of unpaired examples", o.loss));
  }
  PreferenceLosses out;
  out.loss =
      at::where(d, o.desirable_weight * desirable_loss, o.undesirable_weight * undesirable_loss);
  if (o.ftx > 0) {
    // LLaMA-Factory: + pref_ftx × the desirable completions' mean per-token NLL, × examples /
    // desirable examples; per example, the mean becomes a sum (the batch loss is a mean).
    const at::Tensor nll = -(lp.policy / lp.tokens.clamp_min(1));
    out.loss = out.loss + at::where(d, (o.ftx * lp.nll_scale) * nll, at::zeros_like(nll));
  }
  const at::Tensor reward = (beta * rho).detach().to(at::kDouble);
  const at::Tensor logps = lp.policy.detach().to(at::kDouble);
  const at::Tensor df = d.to(at::kDouble), uf = 1 - df;
  out.sums = at::stack({(reward * df).sum(), (logps * df).sum(), (reward * uf).sum(),
                        (logps * uf).sum(), df.sum(), uf.sum()});
  if (lp.logits.defined()) {
    const at::Tensor logits = lp.logits.detach().to(at::kDouble);
    const at::Tensor tokens = lp.tokens.detach().to(at::kDouble);
    out.sums = at::cat({out.sums, logit_sums(logits * df, tokens * df, logits * uf, tokens * uf,
                                             out.sums.options())});
  } else {
    out.sums = at::cat({out.sums, at::zeros({4}, out.sums.options())});
  }
  return out;
}

double unpaired_nll_scale(int64_t examples, int64_t desirable) {
  if (desirable <= 0) return 0.0;
  const double ratio = static_cast<double>(examples) / static_cast<double>(desirable);
  return ratio * ratio;
}

int64_t metric_sums_size(const PreferenceOptions& o) {
  return o.unpaired() ? 10 : 11;
}

std::map<std::string, double> preference_metrics(const PreferenceOptions& o,
                                                 const std::vector<double>& sums,
                                                 const std::string& prefix) {
  std::map<std::string, double> out;
  if (static_cast<int64_t>(sums.size()) != metric_sums_size(o)) return out;
  if (o.unpaired()) {
    const double desirable = sums[4], undesirable = sums[5];
    if (desirable > 0) {
      out[prefix + "rewards/chosen"] = sums[0] / desirable;
      out[prefix + "logps/chosen"] = sums[1] / desirable;
    }
    if (undesirable > 0) {
      out[prefix + "rewards/rejected"] = sums[2] / undesirable;
      out[prefix + "logps/rejected"] = sums[3] / undesirable;
    }
    if (desirable > 0 && undesirable > 0) {
      out[prefix + "rewards/margins"] = sums[0] / desirable - sums[2] / undesirable;
    }
    add_logits_metrics(out, sums, 6, prefix);
    return out;
  }
  const double pairs = sums[6];
  if (pairs <= 0) return out;
  const char* names[] = {"rewards/chosen",  "rewards/rejected", "rewards/accuracies",
                         "rewards/margins", "logps/chosen",     "logps/rejected"};
  for (size_t k = 0; k < 6; ++k) out[prefix + names[k]] = sums[k] / pairs;
  add_logits_metrics(out, sums, 7, prefix);
  return out;
}

}  // namespace zt::train
