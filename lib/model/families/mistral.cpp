// Mistral (MistralForCausalLM): LLaMA's arithmetic with an optional sliding attention window
// (sliding_window: a positive integer, or null for full attention).
#include <fmt/format.h>

#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.max_position_embeddings = 131072;  // MistralConfig's default for a key left out
  decoder::read_common(r, c);
  decoder::read_projection_biases(r, c);
  if (r.present("sliding_window")) {  // null: full attention (Mistral v0.2 on, Nemo, Small)
    decoder::read_sliding_window(r, c);
  } else {
    c.sliding_window = 4096;  // MistralConfig's default (released configs write 4096 or null)
  }
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::write_common(doc, c, "MistralForCausalLM");
  decoder::write_projection_biases(doc, c);
  decoder::set_member(doc, "sliding_window", decoder::token_value(c.sliding_window),
                      doc.GetAllocator());
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kMistral{"mistral", read, write};

}  // namespace zt::model
