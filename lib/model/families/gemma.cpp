// See gemma.hpp.
#include "model/families/gemma.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "model/families/decoder.hpp"

namespace zt::model::gemma {
namespace {

// A soft-cap: absent takes `otherwise`, null turns it off, a number must be positive.
std::optional<double> read_softcap(json::ObjectReader& r, const char* key,
                                   std::optional<double> otherwise) {
  if (!r.present(key)) return otherwise;
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr || v->IsNull()) return std::nullopt;
  if (!v->IsNumber() || !(v->GetDouble() > 0.0)) {
    r.fail_value(key, "a soft-cap must be a positive number, or null for none");
  }
  return v->GetDouble();
}

const Settings& settings_of(const ModelConfig& c) {
  static const Settings defaults;
  const auto* s = dynamic_cast<const Settings*>(c.family_settings.get());
  return s != nullptr ? *s : defaults;
}

}  // namespace

void read(json::ObjectReader& r, ModelConfig& c, bool gemma3) {
  // Gemma2Config's / Gemma3TextConfig's defaults for keys a config.json leaves out.
  c.max_position_embeddings = gemma3 ? 131072 : 8192;
  if (gemma3) c.rope_theta = 1'000'000.0;
  decoder::read_common(r, c, "gelu_pytorch_tanh");
  if (!r.has("head_dim")) c.head_dim = 256;  // Gemma's configs' default, not hidden / heads
  // Gemma2Config's and Gemma3TextConfig's default, which transformers 4.x leaves out of the
  // config.json it writes (google/gemma-2-9b's has no such key and no lm_head tensor).
  if (!r.has("tie_word_embeddings")) c.tie_word_embeddings = true;
  if (auto act = r.string("hidden_activation"); act && *act != "gelu_pytorch_tanh") {
    r.fail_value("hidden_activation",
                 fmt::format("\"{}\" is not supported; Gemma uses gelu_pytorch_tanh", *act));
  }
  auto s = std::make_shared<Settings>();
  s->qk_norm = gemma3;
  if (auto v = r.number("query_pre_attn_scalar", 1e-12)) s->query_pre_attn_scalar = *v;
  s->attn_softcap = read_softcap(r, "attn_logit_softcapping",
                                 gemma3 ? std::nullopt : std::optional<double>(50.0));
  s->final_softcap = read_softcap(r, "final_logit_softcapping",
                                  gemma3 ? std::nullopt : std::optional<double>(30.0));
  if (auto w = r.integer("sliding_window", 1)) s->window = *w;
  const int64_t layers = c.num_hidden_layers;
  if (std::optional<std::vector<bool>> sliding = decoder::read_sliding_layers(r, c)) {
    s->sliding = std::move(*sliding);
  } else {
    // transformers' default: every pattern-th layer global (Gemma 2: 2, Gemma 3: 6).
    const int64_t pattern = gemma3 ? r.integer("sliding_window_pattern", 1).value_or(6) : 2;
    for (int64_t i = 0; i < layers; ++i) s->sliding.push_back((i + 1) % pattern != 0);
  }
  if (gemma3) {
    if (auto v = r.number("rope_local_base_freq", 1e-12)) s->local_theta = *v;
    if (std::optional<json::ObjectReader> p = r.object("rope_parameters")) {
      // 5.x: one block per layer type, each type the layers use there (transformers fails on
      // a missing one, and on a flat block).
      std::optional<json::ObjectReader> global = p->object("full_attention");
      std::optional<json::ObjectReader> local = p->object("sliding_attention");
      const bool any_sliding =
          std::find(s->sliding.begin(), s->sliding.end(), true) != s->sliding.end();
      const bool any_full =
          std::find(s->sliding.begin(), s->sliding.end(), false) != s->sliding.end();
      if ((any_full && !global) || (any_sliding && !local)) {
        r.fail_value("rope_parameters",
                     "Gemma 3 takes one block per layer type: {\"full_attention\": {...}, "
                     "\"sliding_attention\": {...}}");
      }
      p->reject_unknown("Gemma 3's rope_parameters hold full_attention and sliding_attention");
      if (global) decoder::read_rope_block(*global, c.rope_theta, c.rope_scaling);
      if (local) decoder::read_rope_block(*local, s->local_theta, s->local_scaling);
      decoder::complete_rope(r, c, c.rope_scaling);
      decoder::complete_rope(r, c, s->local_scaling);
    }
  }
  r.known({"attention_bias", "attention_dropout", "sliding_window_pattern",
           "_sliding_window_pattern", "use_bidirectional_attention", "cache_implementation"});
  if (auto v = r.boolean("attention_bias"); v && *v)
    r.fail_value("attention_bias", "Gemma's projections have no biases");
  if (auto v = r.boolean("use_bidirectional_attention"); v && *v)
    r.fail_value("use_bidirectional_attention", "the decoder attends causally; set it to false");
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  const Settings& s = settings_of(c);
  DecoderSpec d = shared_decoder(c);
  d.scale_embeddings = true;
  d.logit_softcap = s.final_softcap;
  d.final_norm.unit_offset = true;
  if (s.qk_norm) {
    RotarySpec local = d.rotaries.front();
    local.theta = s.local_theta;
    local.scaling = s.local_scaling;
    d.rotaries.push_back(local);
  }
  for (size_t i = 0; i < d.layers.size(); ++i) {
    LayerSpec& l = d.layers[i];
    const bool sliding = i < s.sliding.size() ? s.sliding[i] : (i + 1) % 2 != 0;
    l.norm.unit_offset = true;
    l.norms.before_attention = "input_layernorm";
    l.norms.after_attention = "post_attention_layernorm";
    l.norms.before_mlp = "pre_feedforward_layernorm";
    l.norms.after_mlp = "post_feedforward_layernorm";
    l.mlp.activation = Activation::kGeluTanh;
    l.attention.scale = 1.0 / std::sqrt(s.query_pre_attn_scalar);
    l.attention.softcap = s.attn_softcap;
    l.attention.window = sliding ? std::optional<int64_t>(s.window) : std::nullopt;
    if (s.qk_norm) {
      l.attention.qk_norm = NormSpec{c.rms_norm_eps, /*unit_offset=*/true};
      if (sliding) l.attention.rotary = 1;
    }
  }
  return d;
}

rapidjson::Value rope_parameters(const ModelConfig& c, rapidjson::Document::AllocatorType& alloc) {
  const Settings& s = settings_of(c);
  rapidjson::Value p(rapidjson::kObjectType);
  decoder::set_member(
      p, "full_attention",
      decoder::rope_parameters_block(c.rope_theta, c.rope_scaling, c.partial_rotary_factor, alloc),
      alloc);
  decoder::set_member(p, "sliding_attention",
                      decoder::rope_parameters_block(s.local_theta, s.local_scaling,
                                                     c.partial_rotary_factor, alloc),
                      alloc);
  return p;
}

void write(rapidjson::Document& doc, const ModelConfig& c, const char* architecture) {
  const Settings& s = settings_of(c);
  decoder::write_common(doc, c, architecture);
  decoder::Alloc& alloc = doc.GetAllocator();
  const auto put = [&](const char* key, rapidjson::Value v) {
    decoder::set_member(doc, key, std::move(v), alloc);
  };
  const auto cap = [](const std::optional<double>& v) {
    return v ? rapidjson::Value(*v) : rapidjson::Value(rapidjson::kNullType);
  };
  put("hidden_act", rapidjson::Value("gelu_pytorch_tanh", alloc));
  put("hidden_activation", rapidjson::Value("gelu_pytorch_tanh", alloc));
  // An int in transformers' config classes, which 5.x validates strictly: a whole number is
  // written as one.
  rapidjson::Value scalar(s.query_pre_attn_scalar);
  if (const std::optional<int64_t> whole = json::as_integer(scalar)) scalar.SetInt64(*whole);
  put("query_pre_attn_scalar", std::move(scalar));
  put("attn_logit_softcapping", cap(s.attn_softcap));
  put("final_logit_softcapping", cap(s.final_softcap));
  put("sliding_window", rapidjson::Value(s.window));
  put("attention_bias", rapidjson::Value(false));
  put("layer_types", decoder::layer_types_value(
                         c.num_hidden_layers,
                         [&](int64_t i) {
                           return static_cast<size_t>(i) < s.sliding.size()
                                      ? s.sliding[static_cast<size_t>(i)]
                                      : (i + 1) % 2 != 0;
                         },
                         alloc));
  if (s.qk_norm) put("rope_local_base_freq", rapidjson::Value(s.local_theta));
  decoder::write_token_ids(doc, c);
}

}  // namespace zt::model::gemma
