// torch's names of the floating dtypes a config names (config.json's torch_dtype / dtype,
// bnb_4bit_compute_dtype, a bitsandbytes quant_state's dtype): the attributes of `torch`.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string_view>

namespace zt {

/// float32 / float, bfloat16, float16 / half; nullopt for any other name.
inline std::optional<at::ScalarType> torch_float_dtype(std::string_view name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16" || name == "half") return at::kHalf;
  return std::nullopt;
}

}  // namespace zt
