// Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms,
// head_dim given) with a sparse mixture of experts in the MLP place of every
// decoder_sparse_step-th layer not listed in mlp_only_layers (those keep a dense MLP of
// intermediate_size). The router keeps each token's num_experts_per_tok experts by softmax
// score, renormalized only with norm_topk_prob.
#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/families/moe.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.max_position_embeddings = 32768;  // Qwen3MoeConfig's default for a key left out
  decoder::read_common(r, c);
  decoder::read_projection_biases(r, c);
  decoder::read_qwen_sliding_window(r, c, "Qwen3-MoE");
  const int64_t width = r.integer("moe_intermediate_size", 1, int64_t{1} << 20).value_or(768);
  // transformers maps num_experts to num_local_experts; a file may carry either.
  auto s = moe::read(r, c, "num_experts", "num_local_experts", 128, 8, width);
  s->spec.normalize_top_k = r.boolean("norm_topk_prob").value_or(false);
  s->decoder_sparse_step = r.integer("decoder_sparse_step", 1, c.num_hidden_layers).value_or(1);
  if (const rapidjson::Value* only = r.find("mlp_only_layers");
      only != nullptr && !only->IsNull()) {
    if (!only->IsArray()) r.fail("mlp_only_layers", "a list of layer indices");
    for (const rapidjson::Value& v : only->GetArray()) {
      const std::optional<int64_t> i = v.IsNumber() ? json::as_integer(v) : std::nullopt;
      if (!i || *i < 0 || *i >= c.num_hidden_layers) {
        r.fail_value("mlp_only_layers",
                     fmt::format("{} is not a layer index in [0, {}) (num_hidden_layers)",
                                 json::render(v), c.num_hidden_layers));
      }
      s->mlp_only_layers.push_back(*i);
    }
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    bool dense = (i + 1) % s->decoder_sparse_step != 0;
    for (int64_t j : s->mlp_only_layers) dense = dense || j == i;
    s->sparse[static_cast<size_t>(i)] = !dense;
  }
  r.known({"attention_dropout"});
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  DecoderSpec d = shared_decoder(c);
  for (LayerSpec& layer : d.layers) layer.attention.qk_norm = NormSpec{c.rms_norm_eps};
  moe::compose(moe::settings_of(c), d);
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  decoder::write_common(doc, c, "Qwen3MoeForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), alloc);
  decoder::set_member(doc, "use_sliding_window", rapidjson::Value(false), alloc);
  decoder::set_member(doc, "sliding_window", rapidjson::Value(rapidjson::kNullType), alloc);
  decoder::set_member(doc, "decoder_sparse_step", rapidjson::Value(s.decoder_sparse_step), alloc);
  decoder::set_member(doc, "moe_intermediate_size", rapidjson::Value(s.spec.intermediate), alloc);
  decoder::set_member(doc, "num_experts", rapidjson::Value(s.spec.experts), alloc);
  decoder::set_member(doc, "norm_topk_prob", rapidjson::Value(s.spec.normalize_top_k), alloc);
  moe::write(doc, s);
  rapidjson::Value only(rapidjson::kArrayType);
  for (int64_t i : s.mlp_only_layers) only.PushBack(rapidjson::Value(i), alloc);
  decoder::set_member(doc, "mlp_only_layers", std::move(only), alloc);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kQwen3Moe{"qwen3_moe", read, write, compose};

}  // namespace zt::model
