// Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms,
// head_dim given) with a sparse mixture of experts in the MLP place of every
// decoder_sparse_step-th layer not listed in mlp_only_layers (those keep a dense MLP of
// intermediate_size). The router keeps each token's num_experts_per_tok experts by softmax
// score, renormalized only with norm_topk_prob.
#include <fmt/format.h>

#include <memory>
#include <vector>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

struct Settings : FamilySettings {
  MoeSpec moe;
  std::vector<bool> sparse;  ///< per layer: a mixture of experts
  double router_aux_loss_coef = 0.001;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
};

const Settings& settings_of(const ModelConfig& c) {
  static const Settings defaults;
  const auto* s = dynamic_cast<const Settings*>(c.family_settings.get());
  return s != nullptr ? *s : defaults;
}

void read(json::ObjectReader& r, ModelConfig& c) {
  decoder::read_common(r, c);
  decoder::read_projection_biases(r, c);
  if (auto v = r.boolean("use_sliding_window"); v && *v) {
    r.fail_value("use_sliding_window",
                 "Qwen3-MoE's per-layer sliding window is not supported; set it to false (the "
                 "released models ship it off)");
  }
  decoder::read_full_attention_layers(r, c);
  auto s = std::make_shared<Settings>();
  // transformers maps num_experts to num_local_experts; a file may carry either.
  const char* experts_key = r.has("num_experts") ? "num_experts" : "num_local_experts";
  s->moe.experts = r.integer(experts_key, 1, 4096).value_or(128);
  s->moe.top_k = r.integer("num_experts_per_tok", 1, 4096).value_or(8);
  if (s->moe.top_k > s->moe.experts) {
    r.fail_value("num_experts_per_tok",
                 fmt::format("{} experts per token, but the model has {} experts ({})",
                             s->moe.top_k, s->moe.experts, experts_key));
  }
  s->moe.intermediate = r.integer("moe_intermediate_size", 1, int64_t{1} << 20).value_or(768);
  s->moe.normalize_top_k = r.boolean("norm_topk_prob").value_or(false);
  s->decoder_sparse_step = r.integer("decoder_sparse_step", 1, c.num_hidden_layers).value_or(1);
  if (const rapidjson::Value* only = r.find("mlp_only_layers"); only != nullptr && !only->IsNull()) {
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
    s->sparse.push_back(!dense);
  }
  // The experts' parameters must fit the counts that memory planning multiplies.
  const double per_layer = static_cast<double>(s->moe.experts) *
                           static_cast<double>(c.hidden_size) *
                           (1.0 + 3.0 * static_cast<double>(s->moe.intermediate));
  if (per_layer * static_cast<double>(c.num_hidden_layers) > 0x1p52) {
    r.fail_value(experts_key, "the experts' parameters overflow any model this library trains; "
                              "check num_experts, moe_intermediate_size and hidden_size");
  }
  if (auto v = r.boolean("output_router_logits"); v && *v) {
    r.fail_value("output_router_logits",
                 "the router's load-balancing loss (router_aux_loss_coef) is not computed yet; "
                 "set output_router_logits false to train on the language-model loss alone, as "
                 "the released configs do");
  }
  if (auto v = r.number("router_aux_loss_coef", 0.0)) s->router_aux_loss_coef = *v;
  r.known({"sliding_window", "max_window_layers", "attention_dropout"});
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  const Settings& s = settings_of(c);
  DecoderSpec d = shared_decoder(c);
  for (size_t i = 0; i < d.layers.size(); ++i) {
    LayerSpec& layer = d.layers[i];
    layer.attention.qk_norm = NormSpec{c.rms_norm_eps};
    if (i < s.sparse.size() ? s.sparse[i] : true) layer.moe = s.moe;
  }
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  const Settings& s = settings_of(c);
  decoder::write_common(doc, c, "Qwen3MoeForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), alloc);
  decoder::set_member(doc, "use_sliding_window", rapidjson::Value(false), alloc);
  decoder::set_member(doc, "sliding_window", rapidjson::Value(rapidjson::kNullType), alloc);
  decoder::set_member(doc, "decoder_sparse_step", rapidjson::Value(s.decoder_sparse_step), alloc);
  decoder::set_member(doc, "moe_intermediate_size", rapidjson::Value(s.moe.intermediate), alloc);
  decoder::set_member(doc, "num_experts_per_tok", rapidjson::Value(s.moe.top_k), alloc);
  decoder::set_member(doc, "num_experts", rapidjson::Value(s.moe.experts), alloc);
  decoder::set_member(doc, "norm_topk_prob", rapidjson::Value(s.moe.normalize_top_k), alloc);
  decoder::set_member(doc, "output_router_logits", rapidjson::Value(false), alloc);
  decoder::set_member(doc, "router_aux_loss_coef", rapidjson::Value(s.router_aux_loss_coef),
                      alloc);
  rapidjson::Value only(rapidjson::kArrayType);
  for (int64_t i : s.mlp_only_layers) only.PushBack(rapidjson::Value(i), alloc);
  decoder::set_member(doc, "mlp_only_layers", std::move(only), alloc);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kQwen3Moe{"qwen3_moe", read, write, compose};

}  // namespace zt::model
