// Qwen3 (Qwen3ForCausalLM): the shared decoder with an RMSNorm over each head of the queries
// and the keys before RoPE (the attention block's qk_norm), head_dim given apart from
// hidden_size / heads (128 with 40 heads of a 5120-wide Qwen3-14B), and attention_bias (default
// false) on all four projections. Its per-layer sliding window is refused, as Qwen2's: the
// released models ship it off.
#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.max_position_embeddings = 32768;  // Qwen3Config's default for a key left out
  decoder::read_common(r, c);
  decoder::read_projection_biases(r, c);
  decoder::read_qwen_sliding_window(r, c, "Qwen3");
  r.known({"attention_dropout"});
}

DecoderSpec compose(const ModelConfig& c) {
  DecoderSpec d = shared_decoder(c);
  for (LayerSpec& layer : d.layers) layer.attention.qk_norm = NormSpec{c.rms_norm_eps};
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::write_common(doc, c, "Qwen3ForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), alloc);
  decoder::set_member(doc, "use_sliding_window", rapidjson::Value(false), alloc);
  decoder::set_member(doc, "sliding_window", rapidjson::Value(rapidjson::kNullType), alloc);
  decoder::set_member(doc, "max_window_layers", rapidjson::Value(c.num_hidden_layers), alloc);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kQwen3{"qwen3", read, write, compose};

}  // namespace zt::model
