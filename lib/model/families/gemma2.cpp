// Gemma 2 (Gemma2ForCausalLM): the Gemma blocks (gemma.hpp) with soft-capped attention scores
// and logits, and sliding-window layers alternating with global ones.
#include "model/families/gemma.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  gemma::read(r, c, /*gemma3=*/false);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  gemma::write(doc, c, "Gemma2ForCausalLM");
}

}  // namespace

extern const Family kGemma2{"gemma2", read, write, gemma::compose};

}  // namespace zt::model
