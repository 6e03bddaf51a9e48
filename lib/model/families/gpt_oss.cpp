// gpt-oss (model_type gpt_oss, GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b) as transformers 5.17
// builds it: biases on all four attention projections, a learned sink logit per head
// (`self_attn.sinks`), sliding-window layers alternating with full ones (layer_types,
// sliding_window), yarn RoPE without truncation, and in every layer's MLP place a mixture of
// num_local_experts experts (`mlp.router` with a bias: the top num_experts_per_tok logits,
// softmaxed; `mlp.experts` [E, in, out] with biases, gate and up interleaved, the clamped
// SwiGLU). Checkpoints whose experts are MXFP4 (`*_blocks` / `*_scales`) are refused by name
// for now: dequantize them with transformers (Mxfp4Config(dequantize=True)) and save.
#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/families/moe.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

// The format gpt-oss is released in (its experts), read dequantized.
constexpr std::string_view kMxfp4 = "mxfp4";

void read(json::ObjectReader& r, ModelConfig& c) {
  const bool rope_given = r.has("rope_parameters") || r.has("rope_scaling");
  c.rope_theta = 150000.0;  // GptOssConfig's defaults for keys a config.json leaves out
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 131072;
  decoder::read_common(r, c);
  if (!rope_given) {  // transformers' default for gpt-oss
    c.rope_scaling.type = "yarn";
    c.rope_scaling.factor = 32.0;
    c.rope_scaling.factor_given = true;
    c.rope_scaling.beta_fast = 32.0;
    c.rope_scaling.beta_slow = 1.0;
    c.rope_scaling.truncate = false;
    c.rope_scaling.original_max_position_embeddings = 4096;
  }
  c.qkv_bias = c.o_proj_bias = r.boolean("attention_bias").value_or(true);
  auto s = moe::read(r, c, "num_local_experts", "num_experts", 128, 4, c.intermediate_size);
  MoeSpec& spec = s->spec;
  spec.router = MoeSpec::Router::kTopKSoftmax;
  spec.router_bias = spec.transposed = spec.expert_bias = spec.clamped_swiglu = true;
  // transformers 5.17's experts compute with limit 7 and alpha 1.702 whatever the config says.
  if (auto v = r.number("swiglu_limit"); v && *v != 7.0) {
    r.fail_value("swiglu_limit", fmt::format("{}: transformers computes gpt-oss's experts with "
                                             "7.0; a model trained otherwise is not supported",
                                             *v));
  }
  if (auto w = r.integer("sliding_window", 1)) s->window = *w;
  if (std::optional<std::vector<bool>> sliding = decoder::read_sliding_layers(r, c)) {
    s->sliding = std::move(*sliding);
  } else {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) s->sliding.push_back((i + 1) % 2 != 0);
  }
  // As released: the experts in MXFP4, read dequantized (as transformers' Mxfp4Config(
  // dequantize=True), what LLaMA-Factory and TRL load gpt-oss with for training); the rest
  // (modules_to_not_convert) in bf16. Any other quantization is refused by key.
  if (std::optional<json::ObjectReader> q = r.object("quantization_config")) {
    const std::optional<std::string> method = q->string("quant_method");
    if (method != std::optional<std::string>(kMxfp4)) {
      q->fail_value("quant_method",
                    fmt::format("{}: gpt-oss is read as released (MXFP4 experts) or in full "
                                "precision; give the bf16 model",
                                method.value_or("(none)")));
    }
  }
  decoder::refuse_attention_dropout(r);
  r.known({"swiglu_limit"});
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  DecoderSpec d = shared_decoder(c);
  for (size_t i = 0; i < d.layers.size(); ++i) {
    LayerSpec& layer = d.layers[i];
    layer.attention.sinks = true;
    layer.attention.window =
        i < s.sliding.size() && s.sliding[i] ? std::optional<int64_t>(s.window) : std::nullopt;
  }
  moe::compose(s, d);
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  decoder::write_common(doc, c, "GptOssForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), alloc);
  decoder::set_member(doc, "attention_dropout", rapidjson::Value(0.0), alloc);
  decoder::set_member(doc, "num_local_experts", rapidjson::Value(s.spec.experts), alloc);
  decoder::set_member(doc, "swiglu_limit", rapidjson::Value(7.0), alloc);
  decoder::set_member(doc, "sliding_window", rapidjson::Value(s.window), alloc);
  decoder::set_member(doc, "layer_types",
                      decoder::layer_types_value(
                          c.num_hidden_layers,
                          [&](int64_t i) {
                            return static_cast<size_t>(i) < s.sliding.size() &&
                                   s.sliding[static_cast<size_t>(i)];
                          },
                          alloc),
                      alloc);
  moe::write(doc, s);
  decoder::write_token_ids(doc, c);
}

constexpr ModuleNames kNames = [] {
  ModuleNames n;
  n.moe_router = "router";
  return n;
}();

}  // namespace

extern const Family kGptOss{"gpt_oss",
                            read,
                            write,
                            compose,
                            /*remote_code=*/false,
                            kNames,
                            {},
                            nullptr,
                            nullptr,
                            nullptr,
                            /*read_dequantized=*/kMxfp4};

}  // namespace zt::model
