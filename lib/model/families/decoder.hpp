// What transformers' decoder families (llama, qwen2, mistral, glm, glm4) read and write the
// same way: the sizes, RoPE in the 4.x and 5.x spellings, the activation, tied embeddings and
// the special token ids. Each family's file adds its own switches around these.
#pragma once

#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include <rapidjson/document.h>

#include "util/json.hpp"
#include "zerotrain/model.hpp"

namespace zt::model::decoder {

using Alloc = rapidjson::Document::AllocatorType;

/// A size that must be there: a positive integer up to `max`, so that no product overflows and
/// a corrupt file is refused before anything is allocated.
int64_t required_size(json::ObjectReader& r, const char* key, int64_t max);
/// One RoPE block (5.x rope_parameters, 4.x rope_scaling): its rope_theta when there, its type
/// (default, linear, dynamic, llama3, yarn, longrope; others refused by key) and its members.
void read_rope_block(json::ObjectReader& block, double& theta, RopeScaling& scaling);
/// What transformers fills in for a yarn or longrope block read from `top`'s config: the
/// original length (from the block, else the top, else max_position_embeddings) and, when the
/// block gives no factor, max / original positions. Call after read_rope_block.
void complete_rope(json::ObjectReader& top, const ModelConfig& c, RopeScaling& scaling);
/// The shared members of a transformers decoder's config.json; `hidden_act`, when given, must
/// be the family's `activation`.
void read_common(json::ObjectReader& r, ModelConfig& c, std::string_view activation = "silu");
/// attention_bias (q/k/v and o_proj) and mlp_bias, as llama and mistral read them.
void read_projection_biases(json::ObjectReader& r, ModelConfig& c);
/// partial_rotary_factor (default `otherwise`), at the top (4.x) or in rope_parameters (5.x):
/// the share of each head RoPE rotates, refused unless it gives an even number of dimensions
/// between 2 and head_dim.
void read_partial_rotary(json::ObjectReader& r, ModelConfig& c, double otherwise);
/// attention_dropout above 0 refused by key (dropout inside the decoder is not built; released
/// configs ship 0).
void refuse_attention_dropout(json::ObjectReader& r);
/// sliding_window: a positive integer, or null (or absent) for full attention on every layer.
void read_sliding_window(json::ObjectReader& r, ModelConfig& c);
/// `layer_types` where sliding and full layers alternate (Gemma 2/3, gpt-oss): per layer, true
/// for "sliding_attention", false for "full_attention"; nullopt when absent or null. A list of
/// another length or another type is refused naming the key.
std::optional<std::vector<bool>> read_sliding_layers(json::ObjectReader& r, const ModelConfig& c);
/// The `layer_types` list read_sliding_layers reads: per layer "sliding_attention" where
/// `sliding(layer)`, else "full_attention".
rapidjson::Value layer_types_value(int64_t layers, const std::function<bool(int64_t)>& sliding,
                                   Alloc& alloc);
/// `layer_types`, where a family that attends in full on every layer finds it (transformers 5
/// writes it for Qwen2/3): one "full_attention" per layer; a list of another length, or a layer
/// of another type, is refused naming the key.
void read_full_attention_layers(json::ObjectReader& r, const ModelConfig& c);

/// Qwen's per-layer sliding-window switches (Qwen2, Qwen3, Qwen3-MoE): use_sliding_window true
/// is refused naming `family` (no released model turns it on), layer_types must be full
/// attention on every layer, and sliding_window / max_window_layers are then known and unused.
void read_qwen_sliding_window(json::ObjectReader& r, const ModelConfig& c, std::string_view family);

/// Sets or replaces `obj[key]`.
void set_member(rapidjson::Value& obj, const char* key, rapidjson::Value value, Alloc& alloc);
rapidjson::Value string_value(const std::string& s, Alloc& alloc);
/// A token id, or null.
rapidjson::Value token_value(const std::optional<int64_t>& v);

/// Starts `doc` as transformers' save_pretrained would: architectures ([architecture]),
/// model_type and the shared members up to use_cache.
void write_common(rapidjson::Document& doc, const ModelConfig& c, const char* architecture);
/// attention_bias and mlp_bias, as llama and mistral write them.
void write_projection_biases(rapidjson::Document& doc, const ModelConfig& c);
/// One 5.x rope_parameters block: {rope_type, rope_theta, partial_rotary_factor (unless 1), and
/// the type's own members as transformers reads them back}.
rapidjson::Value rope_parameters_block(double theta, const RopeScaling& scaling,
                                       double partial_rotary_factor, Alloc& alloc);
/// 4.x's rope_scaling for `scaling`: null for plain RoPE; LongRoPE as exactly 4.x's Phi-3 takes
/// it, {type, short_factor, long_factor} (the lengths at the top of the config).
rapidjson::Value rope_scaling_block(const RopeScaling& scaling, Alloc& alloc);
/// The special token ids that end every decoder's config.json.
void write_token_ids(rapidjson::Document& doc, const ModelConfig& c);

}  // namespace zt::model::decoder
