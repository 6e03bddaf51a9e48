// Which projections a LoRA configuration targets, shared by apply_peft and the checks made when
// training continues from an adapter folder.
#pragma once

#include <string>
#include <vector>

#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// LLaMA-Factory's `lora_target all` in target_modules: the names of every projection but the
/// output layer (its find_all_linear_modules), handed to PEFT as a list — PEFT's all-linear but
/// on the mixtures PEFT converts, where the list's names are converted and no more
/// (lib/peft/fused_experts.hpp).
inline constexpr const char* kAllLinearNames = "all";

/// Whether dotted `path` is `name` or ends with "." + `name` (how PEFT matches target names).
bool ends_with_component(const std::string& path, const std::string& name);

/// Whether parameter `name` is part of a LoRA adapter (trained, and saved in its files): LoRA's
/// A and B, biases as `options.bias` says (lora_only: those of the `wrapped` modules), and the
/// parameters of `options.modules_to_save`.
bool in_adapter(const std::string& name, const LoraOptions& options,
                const std::vector<std::string>& wrapped);

/// Module paths of the projections `options` targets in `model`, in module order (an adapter's
/// own modules excluded). all-linear is every projection but the output layer, whose path the
/// model's family names (lm_head; ChatGLM's transformer.output_layer). Throws ConfigError for an
/// invalid regex.
std::vector<std::string> lora_targets(CausalLM& model, const LoraOptions& options);

}  // namespace zt::peft
