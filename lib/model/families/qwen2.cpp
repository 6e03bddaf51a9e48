// Qwen2 / Qwen2.5 (Qwen2ForCausalLM): the shared decoder with q/k/v biases always on. Its
// per-layer sliding window is refused; the released models ship it off.
#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.max_position_embeddings = 32768;  // Qwen2Config's default for a key left out
  decoder::read_common(r, c);
  c.qkv_bias = true;
  decoder::read_qwen_sliding_window(r, c, "Qwen2");
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::write_common(doc, c, "Qwen2ForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "use_sliding_window", rapidjson::Value(false), alloc);
  decoder::set_member(doc, "sliding_window", rapidjson::Value(rapidjson::kNullType), alloc);
  decoder::set_member(doc, "max_window_layers", rapidjson::Value(c.num_hidden_layers), alloc);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kQwen2{"qwen2", read, write};

}  // namespace zt::model
