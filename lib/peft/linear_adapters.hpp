// The adapter methods of one Linear, registered in one place: attaching one, telling its
// parameters from the model's, and folding a trained one into its base weight from files. Today
// LoRA / rsLoRA (lora.hpp); a new method (DoRA) adds its file and its rows here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/layers.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// What PEFT's adapter files put before a parameter's name in the model
/// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
constexpr const char* kAdapterKeyPrefix = "base_model.model.";

/// Attaches the adapter `options` asks for to the projection at `path` (its parameters
/// registered on `lin`, trainable). Throws InvalidArgument when `lin` already has one.
void attach_adapter(const std::string& path, model::Linear& lin, const LoraOptions& options,
                    uint64_t seed);

/// Whether parameter `name` belongs to a Linear's adapter (LoRA: "<module>.lora_A.weight",
/// "<module>.lora_B.weight").
bool is_adapter_parameter(const std::string& name);

/// Reads a trained tensor by parameter name into `out` (its shape is the adapter's).
using TensorReader = std::function<void(const std::string& name, at::Tensor& out)>;

/// Adds the trained adapter of projection `module` to its base weight `weight` (fp32
/// [out, in]), as merge_lora does in memory, when `has(name)` says the adapter was trained
/// (merging a checkpoint into an HF folder). Returns whether it did.
bool fold_trained_adapter(const LoraOptions& options, const std::string& module, at::Tensor& weight,
                          const std::function<bool(const std::string&)>& has,
                          const TensorReader& read);

}  // namespace zt::peft
