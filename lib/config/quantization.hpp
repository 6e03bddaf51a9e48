// The 4-bit base a run's arguments ask for (QLoRA), from LLaMA-Factory's or transformers' names.
#pragma once

#include <optional>

#include "zerotrain/config.hpp"
#include "zerotrain/model.hpp"

namespace zt::config {

/// The 4-bit base `args` ask for, or nullopt when none: `quantization_bit 4` (LLaMA-Factory's
/// defaults: nf4 with double quantization, as quantization_type / double_quantization change
/// them) or `load_in_4bit` (transformers' BitsAndBytesConfig defaults: fp4 without double
/// quantization, as bnb_4bit_quant_type / bnb_4bit_use_double_quant change them). Throws a
/// ConfigError naming the option for 8 bits, one spelling's options without a 4-bit base, the
/// two spellings disagreeing on the type, a method other than LoRA (LLaMA-Factory's rule: a
/// 4-bit base cannot be trained), or a bnb_4bit_compute_dtype other than the run's
/// (`compute`, the dtype the run computes in).
std::optional<QuantizationConfig> quantization_of(const TrainingArguments& args,
                                                  at::ScalarType compute);

/// The 4-bit base of a run on a folder whose config.json declares one (`saved`, bitsandbytes'
/// 4-bit model): the folder's, as transformers loads it. `folder` names it in messages. Throws a
/// ConfigError when a method other than LoRA is asked, or when an option given explicitly
/// (quantization_type / bnb_4bit_quant_type, double_quantization / bnb_4bit_use_double_quant)
/// disagrees with the folder.
QuantizationConfig saved_quantization_for(const TrainingArguments& args,
                                          const QuantizationConfig& saved,
                                          const std::string& folder);

}  // namespace zt::config
