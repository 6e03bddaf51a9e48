// LoRA's adapter_config.json as PEFT writes and reads it (lora_config.cpp): its fields, the
// options zerotrain refuses, and target_modules in PEFT's saved form.
#pragma once

#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "util/json.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

using JsonWriter = rapidjson::PrettyWriter<rapidjson::StringBuffer>;

/// Writes LoRA's members of adapter_config.json (peft_type on) into the open object `w`, as PEFT
/// 0.21 saves them; target_modules as PEFT saves them for `model` (all-linear written out, long
/// lists condensed).
void write_lora_config(JsonWriter& w, CausalLM& model, const LoraOptions& options);

/// Reads LoRA's members of adapter_config.json into `options`; what would change the adapter's
/// arithmetic and zerotrain lacks (use_dora, layers_to_transform, rank_pattern, ...) is a
/// ConfigError through `r`, naming the key.
void read_lora_config(json::ObjectReader& r, LoraOptions& options);

}  // namespace zt::peft
