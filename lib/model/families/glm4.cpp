// GLM-4-0414 (model_type glm4, Glm4ForCausalLM): glm's blocks, and a norm on each sublayer's
// output too (post_self_attn_layernorm, post_mlp_layernorm).
#include "model/families/decoder.hpp"
#include "model/families/glm.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.rms_norm_eps = 1.5625e-7;  // Glm4Config's defaults for keys a config.json leaves out
  c.max_position_embeddings = 131072;
  decoder::read_common(r, c);
  read_glm_switches(r, c);
  c.post_sublayer_norms = true;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  write_glm_config(doc, c, "Glm4ForCausalLM");
}

}  // namespace

extern const Family kGlm4{"glm4", read, write};

}  // namespace zt::model
