// Meta's LLaMA 1-3 (transformers' LlamaForCausalLM): the shared decoder, optional biases on
// the projections (attention_bias, mlp_bias). The family the others are told apart from.
#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  decoder::read_common(r, c);
  decoder::read_projection_biases(r, c);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::write_common(doc, c, "LlamaForCausalLM");
  decoder::write_projection_biases(doc, c);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kLlama{"llama", read, write};

}  // namespace zt::model
