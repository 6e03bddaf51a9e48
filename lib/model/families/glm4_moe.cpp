// GLM-4.5 and GLM-4.6 (model_type glm4_moe, Glm4MoeForCausalLM: GLM-4.5-Air, GLM-4.5, GLM-4.6):
// the shared decoder with biases on q, k and v (not o_proj), RoPE in halves on part of each head
// (partial_rotary_factor, 0.5 by default), optional q/k norms (use_qk_norm), the first
// first_k_dense_replace layers dense and the others a mixture of n_routed_experts experts of
// moe_intermediate_size with a shared expert beside them. The router scores by sigmoid, corrects
// the scores it chooses by with e_score_correction_bias (frozen), picks among the topk_group best
// of n_group groups, and scales the renormalized weights by routed_scaling_factor (MoeSpec's
// kSigmoidGroups). The multi-token-prediction layers a checkpoint holds past num_hidden_layers
// (num_nextn_predict_layers) are not part of the model, as in transformers.
#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/families/moe.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.rms_norm_eps = 1e-5;  // Glm4MoeConfig's defaults for keys a config.json leaves out
  c.max_position_embeddings = 131072;
  decoder::read_common(r, c);
  if (auto v = r.boolean("attention_bias")) c.qkv_bias = *v;  // o_proj has none
  decoder::read_partial_rotary(r, c, 0.5);
  const int64_t width = r.integer("moe_intermediate_size", 1, int64_t{1} << 20).value_or(1408);
  auto s = moe::read(r, c, "n_routed_experts", "num_local_experts", 128, 8, width);
  MoeSpec& spec = s->spec;
  spec.router = MoeSpec::Router::kSigmoidGroups;
  spec.normalize_top_k = r.boolean("norm_topk_prob").value_or(true);
  if (auto v = r.number("routed_scaling_factor", 0.0, 1e6)) spec.scaling = *v;
  spec.groups = r.integer("n_group", 1, spec.experts).value_or(1);
  // Groups are ranked by their two best experts, so each holds two at least (transformers'
  // topk(2) fails on fewer).
  if (spec.experts % spec.groups != 0 || spec.experts / spec.groups < 2) {
    r.fail_value("n_group", fmt::format("{} groups do not divide the {} experts (n_routed_experts) "
                                        "into groups of two or more",
                                        spec.groups, spec.experts));
  }
  spec.top_groups = r.integer("topk_group", 1, spec.groups).value_or(1);
  if (spec.top_k > spec.top_groups * (spec.experts / spec.groups)) {
    r.fail_value(
        "num_experts_per_tok",
        fmt::format("{} experts per token, but the {} best of {} groups hold only {}", spec.top_k,
                    spec.top_groups, spec.groups, spec.top_groups * (spec.experts / spec.groups)));
  }
  s->shared_experts = r.integer("n_shared_experts", 0, 1024).value_or(1);
  spec.shared_intermediate = s->shared_experts * width;
  s->first_dense = r.integer("first_k_dense_replace", 0, c.num_hidden_layers).value_or(1);
  for (int64_t i = 0; i < s->first_dense; ++i) s->sparse[static_cast<size_t>(i)] = false;
  s->extra_layers = r.integer("num_nextn_predict_layers", 0, 64).value_or(1);
  s->qk_norm = r.boolean("use_qk_norm").value_or(false);
  // transformers computes no load-balancing loss for GLM-4.5 (its balance comes from the
  // correction bias): output_router_logits changes nothing there, nor here.
  s->balance_loss = false;
  decoder::refuse_attention_dropout(r);
  r.known({"num_mtp_layers"});
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  DecoderSpec d = shared_decoder(c);
  for (LayerSpec& layer : d.layers) {
    if (s.qk_norm) layer.attention.qk_norm = NormSpec{c.rms_norm_eps};
  }
  moe::compose(s, d);
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  decoder::write_common(doc, c, "Glm4MoeForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  auto set = [&](const char* key, rapidjson::Value v) {
    decoder::set_member(doc, key, std::move(v), alloc);
  };
  set("attention_bias", rapidjson::Value(c.qkv_bias));
  set("attention_dropout", rapidjson::Value(0.0));
  set("partial_rotary_factor", rapidjson::Value(c.partial_rotary_factor));
  set("moe_intermediate_size", rapidjson::Value(s.spec.intermediate));
  set("n_routed_experts", rapidjson::Value(s.spec.experts));
  set("n_shared_experts", rapidjson::Value(s.shared_experts));
  set("routed_scaling_factor", rapidjson::Value(s.spec.scaling));
  set("n_group", rapidjson::Value(s.spec.groups));
  set("topk_group", rapidjson::Value(s.spec.top_groups));
  set("first_k_dense_replace", rapidjson::Value(s.first_dense));
  set("norm_topk_prob", rapidjson::Value(s.spec.normalize_top_k));
  set("use_qk_norm", rapidjson::Value(s.qk_norm));
  set("num_nextn_predict_layers", rapidjson::Value(s.extra_layers));
  moe::write(doc, s);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kGlm4Moe{"glm4_moe", read, write, compose};

}  // namespace zt::model
