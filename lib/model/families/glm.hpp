// What glm (GLM-4-9B, GlmForCausalLM) and glm4 (GLM-4-0414, Glm4ForCausalLM) share.
#pragma once

#include <rapidjson/document.h>

#include "util/json.hpp"
#include "zerotrain/model.hpp"

namespace zt::model {

/// GLM's switches beside the shared decoder: q/k/v biases, the fused gate_up_proj, interleaved
/// RoPE on part of each head.
void read_glm_switches(json::ObjectReader& r, ModelConfig& c);
/// A GLM config.json under `architecture`.
void write_glm_config(rapidjson::Document& doc, const ModelConfig& c, const char* architecture);

}  // namespace zt::model
