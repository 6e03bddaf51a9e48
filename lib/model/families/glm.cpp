// GLM-4-9B in transformers' own code (model_type glm, GlmForCausalLM): the shared decoder with
// q/k/v biases, a fused gate_up_proj and interleaved RoPE on part of each head. ChatGLM's
// remote-code checkpoints convert to it (chatglm.cpp).
#include <fmt/format.h>

#include "model/families/decoder.hpp"
#include "model/families/glm.hpp"
#include "model/family.hpp"

namespace zt::model {

// GLM (glm-4-9b-chat-hf) and GLM-4-0414 (glm4): q/k/v biases without an o_proj bias
// (attention_bias, default true), a fused gate_up_proj, interleaved RoPE on part of each head
// (partial_rotary_factor, default 0.5, top-level or in 5.x's rope_parameters).
void read_glm_switches(json::ObjectReader& r, ModelConfig& c) {
  c.qkv_bias = r.boolean("attention_bias").value_or(true);
  c.fused_gate_up = true;
  c.rope_interleaved = true;
  decoder::read_partial_rotary(r, c, 0.5);
  if (auto v = r.boolean("mlp_bias"); v && *v) {
    r.fail_value("mlp_bias", "GLM's MLP has no biases");
  }
  r.known({"attention_dropout", "pad_token_id"});
}

void write_glm_config(rapidjson::Document& doc, const ModelConfig& c, const char* architecture) {
  decoder::write_common(doc, c, architecture);
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), alloc);
  decoder::set_member(doc, "partial_rotary_factor", rapidjson::Value(c.partial_rotary_factor),
                      alloc);
  decoder::write_token_ids(doc, c);
}

namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.rms_norm_eps = 1.5625e-7;  // GlmConfig's defaults for keys a config.json leaves out
  c.max_position_embeddings = 131072;
  decoder::read_common(r, c);
  read_glm_switches(r, c);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  write_glm_config(doc, c, "GlmForCausalLM");
}

}  // namespace

extern const Family kGlm{"glm", read, write};

}  // namespace zt::model
