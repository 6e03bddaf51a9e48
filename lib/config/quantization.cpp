// quantization_of: LLaMA-Factory's and transformers' spellings of a 4-bit base, with each one's
// defaults (LLaMA-Factory's model_args; transformers' BitsAndBytesConfig).
#include "config/quantization.hpp"

#include <fmt/format.h>

#include <string>

#include "util/dtype_names.hpp"
#include "zerotrain/error.hpp"

namespace zt::config {
namespace {

// A dtype as BitsAndBytesConfig takes it: torch's attribute name, with or without "torch.".
std::optional<at::ScalarType> dtype_named(std::string_view name) {
  if (name.rfind("torch.", 0) == 0) name.remove_prefix(6);
  return torch_float_dtype(name);
}

}  // namespace

std::optional<QuantizationConfig> quantization_of(const TrainingArguments& args,
                                                  at::ScalarType compute) {
  if (args.load_in_8bit || args.quantization_bit == 8) {
    throw ConfigError(fmt::format("{}: zerotrain has no 8-bit base; use a 4-bit one ({}) with LoRA",
                                  args.load_in_8bit ? "load_in_8bit" : "quantization_bit 8",
                                  args.load_in_8bit ? "load_in_4bit" : "quantization_bit 4"));
  }
  if (args.quantization_bit != 0 && args.quantization_bit != 4) {
    throw ConfigError(
        fmt::format("quantization_bit {}: only 4 is supported (bitsandbytes' NF4 / FP4 base)",
                    args.quantization_bit));
  }
  const bool factory = args.quantization_bit == 4, hf = args.load_in_4bit;
  if (!factory && !hf) {
    for (const char* name :
         {"quantization_type", "double_quantization", "bnb_4bit_quant_type",
          "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"}) {
      if (args.is_given(name)) {
        throw ConfigError(
            fmt::format("{} is given but no 4-bit base is asked for: add quantization_bit 4 (or "
                        "load_in_4bit), or leave {} out",
                        name, name));
      }
    }
    return std::nullopt;
  }
  QuantizationConfig q;
  // Each spelling's defaults, then what was given in either.
  q.quant_type = factory ? "nf4" : "fp4";
  q.double_quant = factory;
  if (!args.quantization_type.empty() && !args.bnb_4bit_quant_type.empty() &&
      args.quantization_type != args.bnb_4bit_quant_type) {
    throw ConfigError(
        fmt::format("quantization_type {} and bnb_4bit_quant_type {} disagree: give one of them",
                    args.quantization_type, args.bnb_4bit_quant_type));
  }
  if (!args.quantization_type.empty()) q.quant_type = args.quantization_type;
  if (!args.bnb_4bit_quant_type.empty()) q.quant_type = args.bnb_4bit_quant_type;
  if (args.double_quantization && args.bnb_4bit_use_double_quant &&
      *args.double_quantization != *args.bnb_4bit_use_double_quant) {
    throw ConfigError(
        "double_quantization and bnb_4bit_use_double_quant disagree: give one of them");
  }
  if (args.double_quantization) q.double_quant = *args.double_quantization;
  if (args.bnb_4bit_use_double_quant) q.double_quant = *args.bnb_4bit_use_double_quant;
  if (!args.bnb_4bit_compute_dtype.empty()) {
    const std::optional<at::ScalarType> d = dtype_named(args.bnb_4bit_compute_dtype);
    if (!d) {
      throw ConfigError(
          fmt::format("bnb_4bit_compute_dtype '{}': give bfloat16, float16 or float32",
                      args.bnb_4bit_compute_dtype));
    }
    if (*d != compute) {
      throw ConfigError(fmt::format(
          "bnb_4bit_compute_dtype {} but the run computes in {}: zerotrain dequantizes to the "
          "run's dtype; set bf16 / fp16 to match, or leave bnb_4bit_compute_dtype out",
          args.bnb_4bit_compute_dtype, c10::toString(compute)));
    }
  }
  if (!args.bnb_4bit_quant_storage.empty() && !dtype_named(args.bnb_4bit_quant_storage) &&
      args.bnb_4bit_quant_storage != "uint8" && args.bnb_4bit_quant_storage != "torch.uint8") {
    throw ConfigError(
        fmt::format("bnb_4bit_quant_storage '{}': give uint8, bfloat16, float16 or float32",
                    args.bnb_4bit_quant_storage));
  }
  if (args.finetuning_type != "lora") {
    throw ConfigError(fmt::format(
        "{}: a 4-bit base is frozen, so it trains only with finetuning_type lora (QLoRA), not "
        "{}",
        factory ? "quantization_bit 4" : "load_in_4bit", args.finetuning_type));
  }
  return q;
}

QuantizationConfig saved_quantization_for(const TrainingArguments& args,
                                          const QuantizationConfig& saved,
                                          const std::string& folder) {
  if (args.finetuning_type != "lora") {
    throw ConfigError(fmt::format(
        "'{}' holds a bitsandbytes 4-bit model, which is frozen: it trains only with "
        "finetuning_type lora (QLoRA), not {}; give the full-precision model to train otherwise",
        folder, args.finetuning_type));
  }
  for (const auto& [name, given] :
       {std::pair<const char*, const std::string&>{"quantization_type", args.quantization_type},
        {"bnb_4bit_quant_type", args.bnb_4bit_quant_type}}) {
    if (args.is_given(name) && given != saved.quant_type) {
      throw ConfigError(fmt::format(
          "{} {} but '{}' holds {} weights (its config.json's quantization_config): leave {} out "
          "or give {}",
          name, given, folder, saved.quant_type, name, saved.quant_type));
    }
  }
  for (const auto& [name, given] :
       {std::pair<const char*, std::optional<bool>>{"double_quantization",
                                                    args.double_quantization},
        {"bnb_4bit_use_double_quant", args.bnb_4bit_use_double_quant}}) {
    if (given && *given != saved.double_quant) {
      throw ConfigError(fmt::format("{} {} but '{}' is saved {} double quantization: leave {} out",
                                    name, *given, folder, saved.double_quant ? "with" : "without",
                                    name));
    }
  }
  return saved;
}

}  // namespace zt::config
