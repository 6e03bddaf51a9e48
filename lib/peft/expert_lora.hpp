// LoRA on the experts' fused tensors, as PEFT 0.21 puts it there through `target_parameters`
// (its ParamWrapper) for transformers 5's experts: per tensor [E, out, in], lora_A [r·E, in] and
// lora_B [out, r·E], expert e's update scaling · B_e · A_e with A_e = A.view(E, r, in)[e] and
// B_e = B.view(out, r, E)[:, :, e]. Registered on the MoeExperts under PEFT's names: the
// targeted tensors nest in registration order (gate_up_proj inside down_proj), so the last one
// targeted is "<experts>.lora_A.weight" and one before it "<experts>.base_layer.lora_A.weight".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/moe.hpp"
#include "peft/linear_adapters.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// Which of the experts module at `path`'s tensors `options.target_parameters` targets (a
/// target matches "<path>.<tensor>" equal or as a dotted suffix), as indices into
/// model::MoeExperts::kNames, ascending.
std::vector<size_t> targeted_expert_tensors(const std::string& path, const LoraOptions& options);

/// The module path PEFT gives the adapter of tensor `tensor` of the experts at `path`, given
/// what `options` targets ("<path>" or "<path>.base_layer"); nullopt when it is not targeted.
std::optional<std::string> expert_adapter_path(const std::string& path, size_t tensor,
                                               const LoraOptions& options);

/// Refuses, as ConfigErrors naming lora_target_parameters, the options PEFT refuses for these
/// tensors (dropout, DoRA, PiSSA) when `options` targets any.
void check_expert_options(const LoraOptions& options);

/// Attaches LoRA to every tensor of `experts` (at module path `path`) that `options` targets:
/// A ~ U(±1/√in) from `seed` and the adapter's path (the same on every rank), B = 0, as PEFT
/// starts them; the factors hold values even in a model made without them. Checks the options
/// first (check_expert_options). Returns how many it attached.
size_t attach_expert_adapters(const std::string& path, model::MoeExperts& experts,
                              const LoraOptions& options, uint64_t seed);

/// Adds the trained expert adapter of tensor `name` ("<experts>.gate_up_proj" or
/// "<experts>.down_proj") to its values `weight` (fp32 [E, out, in], or [E, in, out] where
/// `transposed`: gpt-oss) when `has` says it was trained (merging a checkpoint into an HF
/// folder). Returns whether it did.
bool fold_trained_expert_adapter(const LoraOptions& options, const std::string& name,
                                 bool transposed, at::Tensor& weight,
                                 const std::function<bool(const std::string&)>& has,
                                 const TensorReader& read);

}  // namespace zt::peft
