// GRPO and its kin (Dr. GRPO, DAPO, BNPO, GSPO's sequence-level ratios, CISPO, SAPO, LUSPO):
// group-relative advantages from rewards, and the clipped policy loss over completion tokens,
// as TRL's GRPOTrainer defines them (docs/grpo_reference.md has the formulas and their origin;
// docs/grpo.md what zerotrain runs). Pure functions of tensors: no model, no communication.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zt::train {

struct GrpoOptions {
  /// grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo (TRL's loss_type; its default dapo).
  std::string loss_type = "dapo";
  int64_t num_generations = 8;
  double beta = 0.0;            ///< the KL term's weight (0: no reference model)
  double epsilon = 0.2;         ///< the ratio's lower clip: 1 − epsilon
  double epsilon_high = 0.2;    ///< the upper clip 1 + epsilon_high (cispo: the ratio's cap)
  std::optional<double> delta;  ///< INTELLECT-2's two-sided clip: the ratio capped at delta
  /// token: a ratio per token; sequence: GSPO's, exp of the mean log-ratio over the sequence.
  std::string importance_sampling_level = "token";
  std::string scale_rewards = "group";  ///< group | batch | none
  int64_t max_completion_length = 256;  ///< dr_grpo's constant divisor
  bool mask_truncated_completions = false;
  double sapo_temperature_pos = 1.0, sapo_temperature_neg = 1.05;
  bool use_bias_correction_kl = false;  ///< the KL term weighted by the ratio (DeepSeek-V3.2)

  bool sequence_level() const { return importance_sampling_level == "sequence"; }
  /// Whether the clip metrics are TRL's clip_ratio/* (the PPO-clipped losses).
  bool clipped() const {
    return loss_type == "grpo" || loss_type == "bnpo" || loss_type == "dr_grpo" ||
           loss_type == "dapo" || loss_type == "luspo";
  }
};

/// Checks the options as TRL's GRPOConfig and GRPOTrainer do (and the ranges they leave to a
/// failure later): ConfigError naming the option and what to set.
void check_grpo_options(const GrpoOptions& o);

/// Rewards of a generation batch: [completions, functions] fp64, NaN where a function gave no
/// reward (TRL's None), completions in groups of num_generations consecutive rows.
struct GroupAdvantages {
  at::Tensor rewards;     ///< [N]: the weighted sum per completion (NaN: no function scored it)
  at::Tensor advantages;  ///< [N]: reward minus its group's mean, scaled; 0 where unscorable
  at::Tensor std_zero;    ///< [N] bool: the scale (group's or batch's std) is 0 (TRL's isclose)
};

/// TRL's sum_then_normalize: rewards = Σ_f w_f r_f (nansum; NaN when every function gave
/// NaN), advantages = (rewards − group nanmean) / (std + 1e-4) with the std by scale_rewards
/// (group: the group's, batch: the whole batch's, Bessel-corrected, ignoring NaN; none: no
/// division). `weights` [functions] (empty: all 1). InvalidArgument when N is not a multiple
/// of num_generations or the weights do not match the functions.
GroupAdvantages group_advantages(const at::Tensor& rewards_per_function,
                                 const std::vector<double>& weights, int64_t num_generations,
                                 const std::string& scale_rewards);

/// One micro-batch of completions: per-token log-probabilities [B, T] of the completion tokens
/// under the policy (with grad), under the policy that sampled them (`old`, detached; undefined:
/// the policy's own, detached, as TRL when num_iterations is 1) and under the reference
/// (undefined when beta is 0); `mask` [B, T] (1 where a completion token counts); `advantages`
/// [B]; `entropies` [B, T] (optional, metrics only).
struct GrpoInputs {
  at::Tensor logps, old_logps, ref_logps, mask, advantages, entropies;
};

/// Entries of GrpoLoss::sums, which add over micro-batches and ranks.
enum GrpoSum : int64_t {
  kKlSum,        ///< Σ per-token KL · mask
  kEntropySum,   ///< Σ entropy · mask
  kTokenCount,   ///< Σ mask
  kLowClipped,   ///< Σ low-clipped indicator (tokens, or sequences at sequence level)
  kHighClipped,  ///< Σ high-clipped
  kRegionClipped,
  kCispoClipped,
  kClipCount,  ///< what the clip sums count: tokens, or sequences at sequence level
  kGrpoSums
};

struct GrpoLoss {
  /// The micro-batch's share of the step's loss before the step's divisor (grpo_divisor): the
  /// step's loss is Σ over micro-batches and ranks of numerator / divisor. Differentiable.
  at::Tensor numerator;
  at::Tensor sums;  ///< [kGrpoSums] fp64, detached
  /// Per completion: the mean low-clipped and high-clipped indicator over its tokens (TRL's
  /// clip_ratio/low_min and high_max are their min and max over the batch); [B] fp64.
  at::Tensor low_clipped, high_clipped;
};

/// The clipped surrogate loss of TRL's GRPOTrainer._compute_loss for one micro-batch.
GrpoLoss grpo_loss(const GrpoOptions& o, const GrpoInputs& in);

/// What the step's divisor counts, over the whole optimizer step (all ranks and accumulation
/// steps), the same on every rank.
struct GrpoStepCounts {
  int64_t completions = 0;        ///< completions trained in the step
  int64_t micro_batches = 0;      ///< micro-batches of all ranks (bnpo's token means)
  int64_t generation_tokens = 0;  ///< counted tokens of the generation batch (dapo, cispo)
};

/// The divisor that turns the step's summed numerators into TRL's loss: completions (grpo,
/// sapo, dr_grpo, luspo), micro-batches (bnpo) or the generation batch's tokens (dapo, cispo).
double grpo_divisor(const GrpoOptions& o, const GrpoStepCounts& counts);

/// TRL's metrics from a window's sums (over micro-batches and ranks): kl (beta > 0), entropy
/// (when entropies were given), clip_ratio/low_mean, high_mean, region_mean (clipped losses)
/// or cispo_clip_ratio. `prefix` "" or "eval_".
std::map<std::string, double> grpo_metrics(const GrpoOptions& o, const std::vector<double>& sums,
                                           bool entropy, const std::string& prefix);

}  // namespace zt::train
