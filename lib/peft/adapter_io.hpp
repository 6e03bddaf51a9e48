// Adapter folders read with a config other than their own file's (adapter_io.cpp).
#pragma once

#include <string>

#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// load_adapter with `config` in place of the folder's adapter_config.json: for a caller that
/// knows more of the run than the file says (a PiSSA adapter whose base already holds the
/// residual is applied with init_lora_weights true, so nothing is decomposed again).
ParameterCount load_adapter_as(CausalLM& model, const std::string& dir, const PeftConfig& config,
                               bool trainable);

/// Throws IoError naming the file and tensor, as load_adapter does, when the adapter file in
/// `dir` holds a tensor that is no parameter of a model of `model` with `config`'s adapter
/// applied: for a reader that looks tensors up by the model's names (merge), which would
/// otherwise pass over it. Allocates nothing of the model (placeholders).
void check_adapter_places(const ModelConfig& model, const std::string& dir,
                          const PeftConfig& config);

}  // namespace zt::peft
