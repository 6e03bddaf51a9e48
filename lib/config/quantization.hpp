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

}  // namespace zt::config
