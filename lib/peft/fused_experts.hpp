// What PEFT 0.21 does to a LoRA config on transformers 5, whose mixtures keep their experts as
// fused tensors (convert_peft_config_for_transformers): for the model types transformers
// converts like Qwen2-MoE (qwen3_moe, glm4_moe, ...) or Mixtral, the names that targeted the
// 4.x per-expert projections and the router become target_parameters, so a LoRA config written
// for either version trains the same weights. zerotrain applies it wherever it reads a LoRA
// config for a model (training, continuing, loading, writing adapter_config.json), so that its
// adapters are PEFT's, key for key (docs/peft.md).
#pragma once

#include <string_view>

#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// transformers' conversion pattern of `model_type` as PEFT reads it: "qwen2_moe", "mixtral",
/// or "" for a type whose LoRA config needs no conversion.
std::string_view fused_experts_pattern(std::string_view model_type);

/// `options` as PEFT 0.21 leaves them for `model` (unchanged for a type without a pattern):
/// a regex or all-linear in target_modules resolved to leaf names first (all-linear: every
/// projection but the output layer, plus all the pattern's names); then each name that is, or
/// ends with ".<old>", for the pattern's old names — the router `gate`, the experts'
/// gate_proj / up_proj / down_proj (Mixtral: w1 / w3 / w2) — leaves target_modules and puts its
/// new name in target_parameters (gate.weight, gate_up_proj, down_proj). gate_up_proj holds
/// both halves: naming both gives it rank 2r and alpha 2α (rank_pattern / alpha_pattern under
/// `.*\.gate_up_proj`), naming one is a ConfigError, as PEFT raises. Idempotent.
LoraOptions converted_for_fused_experts(CausalLM& model, const LoraOptions& options);

}  // namespace zt::peft
