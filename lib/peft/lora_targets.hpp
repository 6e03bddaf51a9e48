// Which projections a LoRA configuration targets, shared by apply_peft and the checks made when
// training continues from an adapter folder.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "zerotrain/peft.hpp"

namespace zt::peft {

/// Module paths of the projections `options` targets in `model`, in module order (LoRA's own
/// A/B excluded). Throws ConfigError for an invalid regex.
std::vector<std::string> lora_targets(torch::nn::Module& model, const LoraOptions& options);

}  // namespace zt::peft
