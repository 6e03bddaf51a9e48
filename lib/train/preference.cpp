// Preference losses (see preference.hpp). β is `beta`, ε `label_smoothing`, ρ the policy's
// log-probability minus the reference's, Δ = ρ_chosen − ρ_rejected, a a length average.
#include "train/preference.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::train {

PreferenceOptions preference_options(const TrainingArguments& args) {
  PreferenceOptions o;
  o.loss = args.pref_loss;
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
  if (o.loss == "robust" && o.label_smoothing >= 0.5) {
    throw ConfigError(
        fmt::format("dpo_label_smoothing {}: the robust loss divides by 1 − 2ε and needs ε < 0.5",
                    o.label_smoothing));
  }
  return o;
}

PairLosses preference_losses(const PreferenceOptions& o, const PairLogProbs& lp) {
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
      throw ConfigError(fmt::format("pref_loss: unknown loss \"{}\"", o.loss));
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
  PairLosses out;
  out.loss = loss;
  reward_c = reward_c.detach();
  reward_r = reward_r.detach();
  const at::Tensor logps_c = (o.averages() ? avg_c : lp.chosen).detach();
  const at::Tensor logps_r = (o.averages() ? avg_r : lp.rejected).detach();
  out.metrics = at::stack({reward_c, reward_r, reward_c.gt(reward_r).to(reward_c.scalar_type()),
                           reward_c - reward_r, logps_c, logps_r},
                          1)
                    .to(at::kDouble);
  return out;
}

}  // namespace zt::train
