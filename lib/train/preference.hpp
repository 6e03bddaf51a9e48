// Preference losses over sequence log-probabilities: for pairs DPO and its family (sigmoid with
// cDPO's label smoothing, IPO, hinge, robust) against a reference, ORPO and SimPO without one;
// for unpaired examples KTO; as TRL and LLaMA-Factory define them
// (docs/preference_reference.md has the formulas and their origin; docs/preference.md what
// zerotrain runs).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "zerotrain/config.hpp"

namespace zt::train {

struct PreferenceOptions {
  /// Pairs: sigmoid | hinge | ipo | robust | orpo | simpo. Unpaired: kto | apo_zero_unpaired.
  std::string loss = "sigmoid";
  double beta = 0.1;
  double label_smoothing = 0.0;  ///< cDPO's (sigmoid) and robust's ε
  double simpo_gamma = 0.5;
  double ftx = 0.0;        ///< LLaMA-Factory's pref_ftx: + ftx · the chosen answer's mean NLL
  double rpo_alpha = 0.0;  ///< TRL's: + rpo_alpha · the chosen answers' token-mean NLL
  double desirable_weight = 1.0, undesirable_weight = 1.0;  ///< KTO's w_D and w_U

  /// Whether the loss compares with a reference model (all but orpo and simpo).
  bool uses_reference() const { return loss != "orpo" && loss != "simpo"; }
  /// Whether the data are KTO's unpaired examples (stage kto).
  bool unpaired() const { return loss == "kto" || loss == "apo_zero_unpaired"; }
  /// Whether the loss needs KTO's KL estimate z0 (kto; apo_zero_unpaired takes 0).
  bool uses_kl() const { return loss == "kto"; }
  /// Whether the metrics' log-probs are length averages (LLaMA-Factory's ipo, orpo, simpo).
  bool averages() const { return loss == "ipo" || loss == "orpo" || loss == "simpo"; }
};

/// The options of a preference run (stage dpo or kto); ConfigError for values the loss refuses.
PreferenceOptions preference_options(const TrainingArguments& args);

/// Each pair's sequences: summed answer log-probabilities of the policy ([P], with grad) and the
/// reference ([P], undefined when the loss has none), the answers' token counts ([P] float) and
/// the policy's mean logits summed over each answer's tokens ([P], detached; undefined: the
/// logits metrics are left out).
struct PairLogProbs {
  at::Tensor chosen, rejected;
  at::Tensor ref_chosen, ref_rejected;
  at::Tensor chosen_tokens, rejected_tokens;
  at::Tensor chosen_logits, rejected_logits;
};

/// The pairs of a batch laid out as one forward takes them — the chosen rows, then the rejected
/// ones — from its per-row answer log-probs, token counts and logit sums ([2 × P] each) and the
/// reference's log-probs (the same layout, or undefined).
PairLogProbs split_pairs(const at::Tensor& logps, const at::Tensor& tokens,
                         const at::Tensor& logits, const at::Tensor& reference);

/// Each row's mean logits ([rows, seq], CausalLM::label_log_probs' `mean_logits`) summed over
/// its answer's tokens (labels [rows, seq] != -100, past the first): [rows].
at::Tensor answer_logit_sums(const at::Tensor& mean_logits, const at::Tensor& labels);

/// A batch's losses and what its metrics are made of.
struct PreferenceLosses {
  at::Tensor loss;  ///< [rows]: each pair's or example's loss (the batch loss is their mean)
  /// [kMetricSums] detached fp64: the batch's sums that metrics() turns into TRL's metrics;
  /// sums of batches (and ranks) add up.
  at::Tensor sums;
};

/// The per-pair losses and metric sums. rpo_alpha's term is not per pair (a token mean over the
/// batch's chosen answers): the caller adds it.
PreferenceLosses preference_losses(const PreferenceOptions& o, const PairLogProbs& lp);

/// Unpaired examples (KTO): each one's summed completion log-probabilities under the policy
/// ([N], with grad) and the reference ([N]), whether it is desirable ([N] bool), its completion
/// tokens ([N] float), the KL estimate z0 of its batch (0 for apo_zero_unpaired), and pref_ftx's
/// rescaling: LLaMA-Factory's (examples / desirable examples)², over the global batch. `logits`:
/// the policy's mean logits summed over each completion's tokens ([N], detached; undefined: the
/// logits metrics are left out).
struct UnpairedLogProbs {
  at::Tensor policy, reference, desirable, tokens, logits;
  double kl = 0.0;
  double nll_scale = 0.0;
};

/// The per-example losses (weighted, plus each desirable example's share of pref_ftx's term;
/// the batch loss is their mean, TRL's nanmean) and metric sums.
PreferenceLosses unpaired_losses(const PreferenceOptions& o, const UnpairedLogProbs& lp);

/// pref_ftx's UnpairedLogProbs::nll_scale for a global batch of `examples`, `desirable` of them.
double unpaired_nll_scale(int64_t examples, int64_t desirable);

/// Entries of PreferenceLosses::sums: pairs [6 metric sums, pairs]; unpaired [Σ rewards and
/// Σ logps of desirable, then of undesirable examples, desirable count, undesirable count];
/// both then [Σ mean logits over the chosen (desirable) answers' tokens, their tokens, the same
/// of the rejected (undesirable) ones].
int64_t metric_sums_size(const PreferenceOptions& o);

/// The metrics TRL logs (`prefix` "" or "eval_") from sums over a window's batches and all
/// ranks: rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected, and
/// for pairs rewards/accuracies (means over pairs; for unpaired examples, chosen means over
/// the desirable ones, rejected over the undesirable, margins only when both are there);
/// logits/chosen and logits/rejected, TRL's DPO mean logit over the answers' tokens and the
/// vocabulary (over the window's tokens; docs/preference.md).
std::map<std::string, double> preference_metrics(const PreferenceOptions& o,
                                                 const std::vector<double>& sums,
                                                 const std::string& prefix);

}  // namespace zt::train
