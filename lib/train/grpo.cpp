// GRPO's advantages and losses (see grpo.hpp). A is a completion's advantage, ρ = exp(log π −
// log π_old) the importance ratio (per token, or GSPO's per sequence), ε / ε_h the clip range,
// β the KL weight, m the completion mask. docs/grpo_reference.md restates TRL's definitions.
#include "train/grpo.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "zerotrain/error.hpp"

namespace zt::train {

namespace {

bool one_of(const std::string& v, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return v == n; });
}

// TRL's nanstd: the Bessel-corrected std of the non-NaN entries along `dim` (NaN with fewer
// than two).
at::Tensor nanstd(const at::Tensor& x, int64_t dim) {
  at::Tensor valid = x.isnan().logical_not();
  at::Tensor count = valid.sum(dim, true).to(x.scalar_type());
  at::Tensor mean = at::where(valid, x, at::zeros_like(x)).sum(dim, true) / count;
  at::Tensor sq = at::where(valid, (x - mean).pow(2), at::zeros_like(x)).sum(dim, true);
  at::Tensor var = sq / (count - 1);
  var = at::where(count > 1, var, at::full_like(var, NAN));
  return var.sqrt().squeeze(dim);
}

at::Tensor nanmean(const at::Tensor& x, int64_t dim) {
  at::Tensor valid = x.isnan().logical_not();
  return at::where(valid, x, at::zeros_like(x)).sum(dim) / valid.sum(dim).to(x.scalar_type());
}

}  // namespace

void check_grpo_options(const GrpoOptions& o) {
  if (!one_of(o.loss_type, {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"})) {
    throw ConfigError(fmt::format(
        "loss_type '{}': GRPO's losses are grpo, bnpo, dr_grpo, dapo (TRL's default), cispo, "
        "sapo and luspo{}",
        o.loss_type,
        o.loss_type == "vespo" ? " (vespo's gamma weights are not implemented: use sapo or cispo)"
                               : ""));
  }
  if (o.num_generations < 2) {
    throw ConfigError(
        fmt::format("num_generations {}: GRPO's advantages compare at least 2 completions of each "
                    "prompt; set num_generations to 2 or more (TRL's default 8)",
                    o.num_generations));
  }
  if (!one_of(o.importance_sampling_level, {"token", "sequence"})) {
    throw ConfigError(fmt::format("importance_sampling_level '{}': token or sequence (GSPO)",
                                  o.importance_sampling_level));
  }
  if (!one_of(o.scale_rewards, {"group", "batch", "none"})) {
    throw ConfigError(
        fmt::format("scale_rewards '{}': group (true), batch or none (false)", o.scale_rewards));
  }
  if (!(o.beta >= 0) || !std::isfinite(o.beta)) {
    throw ConfigError(fmt::format("beta {}: the KL weight is a finite number ≥ 0", o.beta));
  }
  if (!(o.epsilon >= 0 && o.epsilon < 1)) {
    throw ConfigError(fmt::format(
        "epsilon {}: the ratio's lower clip 1 − epsilon needs 0 ≤ epsilon < 1", o.epsilon));
  }
  if (!(o.epsilon_high >= 0) || !std::isfinite(o.epsilon_high)) {
    throw ConfigError(
        fmt::format("epsilon_high {}: a finite number ≥ 0 (DAPO's 0.28)", o.epsilon_high));
  }
  if (o.delta && !(*o.delta > 0 && std::isfinite(*o.delta))) {
    throw ConfigError(fmt::format(
        "delta {}: the two-sided clip's cap on the ratio is a number > 0 (above 1 + epsilon_high)",
        *o.delta));
  }
  if (o.max_completion_length < 1) {
    throw ConfigError(
        fmt::format("max_completion_length {}: at least 1 token", o.max_completion_length));
  }
  if (!(o.sapo_temperature_pos > 0) || !(o.sapo_temperature_neg > 0)) {
    throw ConfigError(fmt::format("sapo_temperature_pos {} / sapo_temperature_neg {}: both > 0",
                                  o.sapo_temperature_pos, o.sapo_temperature_neg));
  }
  if (o.loss_type == "luspo" && !o.sequence_level()) {
    throw ConfigError(
        "loss_type luspo scales each sequence's loss by its length and needs "
        "importance_sampling_level sequence (at token level TRL's luspo counts padding)");
  }
}

GroupAdvantages group_advantages(const at::Tensor& rewards_per_function,
                                 const std::vector<double>& weights, int64_t num_generations,
                                 const std::string& scale_rewards) {
  at::Tensor r = rewards_per_function.to(at::kDouble);
  if (r.dim() != 2) throw InvalidArgument("group_advantages: rewards are [completions, functions]");
  const int64_t n = r.size(0), f = r.size(1);
  if (num_generations < 1 || n % num_generations != 0) {
    throw InvalidArgument(
        fmt::format("group_advantages: {} completions are not groups of num_generations {}", n,
                    num_generations));
  }
  if (!weights.empty() && static_cast<int64_t>(weights.size()) != f) {
    throw InvalidArgument(
        fmt::format("reward_weights has {} entries for {} reward functions", weights.size(), f));
  }
  at::Tensor w = weights.empty() ? at::ones({f}, r.options())
                                 : at::tensor(weights, r.options().dtype(at::kDouble));
  GroupAdvantages out;
  const at::Tensor unscorable = r.isnan().all(1);
  at::Tensor rewards = at::where(r.isnan(), at::zeros_like(r), r * w.unsqueeze(0)).sum(1);
  rewards = at::where(unscorable, at::full_like(rewards, NAN), rewards);
  const at::Tensor grouped = rewards.view({-1, num_generations});
  const at::Tensor mean = nanmean(grouped, 1).repeat_interleave(num_generations);
  at::Tensor std;
  if (scale_rewards == "batch") {
    std = n > 1 ? nanstd(rewards, 0).expand_as(rewards) : at::zeros_like(rewards);
  } else {
    std = num_generations > 1 ? nanstd(grouped, 1).repeat_interleave(num_generations)
                              : at::zeros_like(rewards);
  }
  at::Tensor adv = rewards - mean;
  if (scale_rewards != "none") adv = adv / (std + 1e-4);
  out.std_zero = at::isclose(std, at::zeros_like(std));
  out.advantages = at::nan_to_num(adv, 0.0);
  out.rewards = rewards;
  return out;
}

GrpoLoss grpo_loss(const GrpoOptions& o, const GrpoInputs& in) {
  const at::Tensor& logps = in.logps;
  const at::Tensor mask = in.mask.to(logps.scalar_type());
  const at::Tensor old = in.old_logps.defined() ? in.old_logps : logps.detach();
  const at::Tensor adv = in.advantages.to(logps.scalar_type()).unsqueeze(1);
  const at::Tensor lengths = mask.sum(-1);
  const at::Tensor safe_lengths = lengths.clamp_min(1.0);

  // ρ: per token, or GSPO's exp of the sequence's mean log-ratio ([B, 1]).
  const at::Tensor log_ratio = logps - old;
  at::Tensor log_weights =
      o.sequence_level() ? ((log_ratio * mask).sum(-1) / safe_lengths).unsqueeze(-1) : log_ratio;
  at::Tensor coef_1 = log_weights.exp();

  at::Tensor kl;
  if (o.beta != 0.0) {
    // k3 estimator of KL(π ‖ π_ref): exp(ref − π) − (ref − π) − 1.
    const at::Tensor d = in.ref_logps - logps;
    kl = d.exp() - d - 1;
    if (o.use_bias_correction_kl) kl = kl * coef_1;
  }

  at::Tensor per_token;
  if (o.loss_type == "cispo") {
    const at::Tensor clamped = coef_1.clamp_max(o.epsilon_high).detach();
    per_token = -clamped * adv * logps;
  } else if (o.loss_type == "sapo") {
    const at::Tensor temperatures = at::where(adv > 0, at::full_like(adv, o.sapo_temperature_pos),
                                              at::full_like(adv, o.sapo_temperature_neg));
    per_token = -(at::sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * adv;
  } else {
    const at::Tensor coef_2 = coef_1.clamp(1 - o.epsilon, 1 + o.epsilon_high);
    at::Tensor capped = o.delta ? coef_1.clamp_max(*o.delta) : coef_1;
    per_token = -at::min(capped * adv, coef_2 * adv);
  }
  if (kl.defined()) per_token = per_token + o.beta * kl;

  GrpoLoss out;
  if (o.loss_type == "grpo" || o.loss_type == "sapo") {
    out.numerator = ((per_token * mask).sum(-1) / safe_lengths).sum();
  } else if (o.loss_type == "bnpo") {
    out.numerator = (per_token * mask).sum() / mask.sum().clamp_min(1.0);
  } else if (o.loss_type == "dr_grpo") {
    out.numerator = (per_token * mask).sum() / static_cast<double>(o.max_completion_length);
  } else if (o.loss_type == "luspo") {
    // Σ over sequences of the sequence's loss times its length (TRL: per_token_loss ·
    // mask.sum(1), averaged over the sequences); the KL term, per token, as its masked mean.
    out.numerator = per_token.size(-1) == 1
                        ? (per_token.squeeze(-1) * lengths).sum()
                        : ((per_token * mask).sum(-1) / safe_lengths * lengths).sum();
  } else {  // dapo, cispo: a sum over the generation batch's tokens
    out.numerator = (per_token * mask).sum();
  }

  // Metrics (TRL's global_masked_mean numerators and counts).
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(logps.device());
  at::Tensor sums = at::zeros({kGrpoSums}, opts);
  const at::Tensor md = mask.detach().to(at::kDouble);
  sums[kTokenCount] = md.sum();
  if (kl.defined()) sums[kKlSum] = (kl.detach().to(at::kDouble) * md).sum();
  if (in.entropies.defined())
    sums[kEntropySum] = (in.entropies.detach().to(at::kDouble) * md).sum();
  const at::Tensor c1 = coef_1.detach();
  const auto masked_sum = [&](const at::Tensor& indicator) {
    at::Tensor f = indicator.to(at::kDouble);
    return f.size(-1) == 1 ? f.sum() : (f * md).sum();
  };
  const auto sequence_mean = [&](const at::Tensor& indicator) {
    at::Tensor f = indicator.to(at::kDouble);
    return f.size(-1) == 1 ? f.squeeze(-1) : (f * md).sum(-1) / md.sum(-1);
  };
  sums[kClipCount] =
      c1.size(-1) == 1 ? at::scalar_tensor(static_cast<double>(c1.size(0)), opts) : md.sum();
  if (o.loss_type == "cispo") {
    sums[kCispoClipped] = masked_sum((c1 > o.epsilon_high).logical_and(adv > 0));
  } else if (o.clipped()) {
    const at::Tensor low = (c1 < 1 - o.epsilon).logical_and(adv < 0);
    const at::Tensor high = (c1 > 1 + o.epsilon_high).logical_and(adv > 0);
    sums[kLowClipped] = masked_sum(low);
    sums[kHighClipped] = masked_sum(high);
    sums[kRegionClipped] = masked_sum(low.logical_or(high));
    out.low_clipped = sequence_mean(low);
    out.high_clipped = sequence_mean(high);
  }
  out.sums = sums;
  return out;
}

double grpo_divisor(const GrpoOptions& o, const GrpoStepCounts& c) {
  if (o.loss_type == "bnpo") return static_cast<double>(std::max<int64_t>(1, c.micro_batches));
  if (o.loss_type == "dapo" || o.loss_type == "cispo")
    return static_cast<double>(std::max<int64_t>(1, c.generation_tokens));
  return static_cast<double>(std::max<int64_t>(1, c.completions));
}

std::map<std::string, double> grpo_metrics(const GrpoOptions& o, const std::vector<double>& sums,
                                           bool entropy, const std::string& prefix) {
  std::map<std::string, double> m;
  const auto at = [&](GrpoSum k) { return sums.at(static_cast<size_t>(k)); };
  const double tokens = std::max(1.0, at(kTokenCount));
  const double clip_count = std::max(1.0, at(kClipCount));
  if (o.beta != 0.0) m[prefix + "kl"] = at(kKlSum) / tokens;
  if (entropy) m[prefix + "entropy"] = at(kEntropySum) / tokens;
  if (o.loss_type == "cispo") {
    m[prefix + "cispo_clip_ratio"] = at(kCispoClipped) / clip_count;
  } else if (o.clipped()) {
    m[prefix + "clip_ratio/low_mean"] = at(kLowClipped) / clip_count;
    m[prefix + "clip_ratio/high_mean"] = at(kHighClipped) / clip_count;
    m[prefix + "clip_ratio/region_mean"] = at(kRegionClipped) / clip_count;
  }
  return m;
}

}  // namespace zt::train
