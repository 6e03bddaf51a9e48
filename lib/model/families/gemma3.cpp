// Gemma 3's text decoder (model_type gemma3_text, Gemma3ForCausalLM): the Gemma blocks
// (gemma.hpp) with (1 + w) norms of each head's queries and keys, five sliding-window layers to
// one global, and the sliding layers' own RoPE (rope_local_base_freq).
#include "model/families/gemma.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  gemma::read(r, c, /*gemma3=*/true);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  gemma::write(doc, c, "Gemma3ForCausalLM");
}

}  // namespace

extern const Family kGemma3{
    "gemma3_text", read, write, gemma::compose, false, {}, {}, nullptr, gemma::rope_parameters};

}  // namespace zt::model
