// Preference losses over pairs' sequence log-probabilities: DPO and its family (sigmoid with
// cDPO's label smoothing, IPO, hinge, robust) against a reference, ORPO and SimPO without one,
// as TRL and LLaMA-Factory define them (docs/preference_reference.md has the formulas and their
// origin; docs/preference.md what zerotrain runs).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <string>

#include "zerotrain/config.hpp"

namespace zt::train {

struct PreferenceOptions {
  std::string loss = "sigmoid";  ///< sigmoid | hinge | ipo | robust | orpo | simpo
  double beta = 0.1;
  double label_smoothing = 0.0;  ///< cDPO's (sigmoid) and robust's ε
  double simpo_gamma = 0.5;
  double ftx = 0.0;        ///< LLaMA-Factory's pref_ftx: + ftx · the chosen answer's mean NLL
  double rpo_alpha = 0.0;  ///< TRL's: + rpo_alpha · the chosen answers' token-mean NLL

  /// Whether the loss compares with a reference model (all but orpo and simpo).
  bool uses_reference() const { return loss != "orpo" && loss != "simpo"; }
  /// Whether the metrics' log-probs are length averages (LLaMA-Factory's ipo, orpo, simpo).
  bool averages() const { return loss == "ipo" || loss == "orpo" || loss == "simpo"; }
};

/// The options of a preference run (stage dpo); ConfigError for values the loss refuses.
PreferenceOptions preference_options(const TrainingArguments& args);

/// Each pair's sequences: summed answer log-probabilities of the policy ([P], with grad) and the
/// reference ([P], undefined when the loss has none), and the answers' token counts ([P] float).
struct PairLogProbs {
  at::Tensor chosen, rejected;
  at::Tensor ref_chosen, ref_rejected;
  at::Tensor chosen_tokens, rejected_tokens;
};

/// The metrics TRL logs, in this order; each a mean over pairs.
constexpr std::array<const char*, 6> kPreferenceMetrics = {"rewards/chosen",     "rewards/rejected",
                                                           "rewards/accuracies", "rewards/margins",
                                                           "logps/chosen",       "logps/rejected"};

struct PairLosses {
  at::Tensor loss;  ///< [P]: each pair's loss (the batch loss is their mean)
  /// [P, 6] detached: each pair's share of kPreferenceMetrics (sum over pairs / pairs = the mean)
  at::Tensor metrics;
};

/// The per-pair losses and metrics. rpo_alpha's term is not per pair (a token mean over the
/// batch's chosen answers): the caller adds it.
PairLosses preference_losses(const PreferenceOptions& o, const PairLogProbs& lp);

}  // namespace zt::train
