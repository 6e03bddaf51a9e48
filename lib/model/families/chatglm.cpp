// ChatGLM2/3-6B in THUDM's remote code (model_type chatglm, ChatGLMModel): glm's arithmetic
// under Megatron's names. Its config is read here, and its conversion to transformers' glm
// (the weights' names and the fused q/k/v split) is here too.
#include <fmt/format.h>

#include "model/families/decoder.hpp"
#include "model/family.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace model {
namespace {

// ChatGLM2/3-6B's remote-code config (THUDM's configuration_chatglm.py): glm's arithmetic in
// Megatron's names — padded_vocab_size, num_layers, ffn_hidden_size, kv_channels (head size),
// multi_query_group_num (key/value heads when multi_query_attention), layernorm_epsilon,
// seq_length, add_qkv_bias, rope_ratio (RoPE base 10000 × rope_ratio) — with RoPE on the first
// half of each head in adjacent pairs. The switches its code offers but these models never set
// are refused rather than computed differently.
void read(json::ObjectReader& r, ModelConfig& c) {
  c.fused_gate_up = true;
  c.rope_interleaved = true;
  c.partial_rotary_factor = 0.5;
  c.tie_word_embeddings = false;  // output_layer is its own matrix whatever the flag says
  c.rms_norm_eps = 1e-5;
  std::optional<int64_t> padded = r.integer("padded_vocab_size", 1, int64_t{1} << 31);
  c.vocab_size = padded ? *padded : decoder::required_size(r, "vocab_size", int64_t{1} << 31);
  c.hidden_size = decoder::required_size(r, "hidden_size", int64_t{1} << 20);
  c.intermediate_size = decoder::required_size(r, "ffn_hidden_size", int64_t{1} << 22);
  c.num_hidden_layers = decoder::required_size(r, "num_layers", int64_t{1} << 12);
  c.num_attention_heads = decoder::required_size(r, "num_attention_heads", int64_t{1} << 14);
  if (auto v = r.integer("kv_channels", 1, int64_t{1} << 14)) {
    c.head_dim = *v;
  } else if (c.hidden_size % c.num_attention_heads == 0) {
    c.head_dim = c.hidden_size / c.num_attention_heads;
  } else {
    r.fail_value("num_attention_heads", fmt::format("hidden_size {} is not divisible by {} heads",
                                                    c.hidden_size, c.num_attention_heads));
  }
  c.num_key_value_heads = c.num_attention_heads;
  if (r.boolean("multi_query_attention").value_or(false)) {
    c.num_key_value_heads =
        r.integer("multi_query_group_num", 1, c.num_attention_heads).value_or(1);
    if (c.num_attention_heads % c.num_key_value_heads != 0) {
      r.fail_value("multi_query_group_num",
                   fmt::format("{} attention heads are not a multiple of {} groups",
                               c.num_attention_heads, c.num_key_value_heads));
    }
  }
  r.known({"multi_query_group_num"});
  if (c.head_dim % 4 != 0) {
    r.fail_value("kv_channels", fmt::format("{} is not a multiple of 4; ChatGLM rotates half of "
                                            "each head in pairs",
                                            c.head_dim));
  }
  if (auto v = r.integer("seq_length", 1, int64_t{1} << 30)) c.max_position_embeddings = *v;
  if (auto v = r.number("layernorm_epsilon", 1e-30)) c.rms_norm_eps = *v;
  if (auto v = r.number("initializer_range", 0.0)) c.initializer_range = *v;
  c.qkv_bias = r.boolean("add_qkv_bias").value_or(false);
  c.rope_theta = 10000.0 * r.number("rope_ratio", 1e-12).value_or(1.0);
  // Switches of the remote code that change the arithmetic: only the values ChatGLM2/3 use.
  auto require = [&](const char* key, bool wanted, bool fallback, const char* why) {
    if (r.boolean(key).value_or(fallback) != wanted) r.fail_value(key, why);
  };
  require("rmsnorm", true, true, "only RMSNorm (true) is supported, as ChatGLM2/3 use");
  require("apply_residual_connection_post_layernorm", false, false,
          "residuals from the normed input are not supported (ChatGLM2/3 use false)");
  require("post_layer_norm", true, true,
          "a model without the final layer norm is not supported (ChatGLM2/3 use true)");
  require("add_bias_linear", false, false,
          "biases on every projection are not supported (ChatGLM2/3 use false; add_qkv_bias "
          "gives q/k/v theirs)");
  require("original_rope", true, true, "only ChatGLM's original RoPE (true) is supported");
  require("fp32_residual_connection", false, false,
          "fp32 residuals are not supported (ChatGLM2/3 use false)");
  if (auto q = r.integer("quantization_bit", 0); q && *q != 0) {
    r.fail_value("quantization_bit",
                 "quantized weights are not supported; use the folder's unquantized release");
  }
  // A P-Tuning v2 model saved whole records its prefix settings; the prefix encoder itself is
  // trained (or loaded) by finetuning_type prefix, not built from the base model's config.
  r.known({"pre_seq_len", "prefix_projection", "hidden_dropout", "attention_dropout",
           "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "bias_dropout_fusion",
           "auto_map", "use_cache", "interleaved_qkv", "classifier_dropout"});
}

// An inline ChatGLM config in configuration_chatglm.py's names (THUDM's remote code reads it
// through auto_map; the folder must carry that code to be loaded by transformers).
void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::Alloc& alloc = doc.GetAllocator();
  doc.SetObject();
  rapidjson::Value archs(rapidjson::kArrayType);
  archs.PushBack(rapidjson::Value("ChatGLMModel", alloc), alloc);
  auto put = [&](const char* k, rapidjson::Value v) {
    decoder::set_member(doc, k, std::move(v), alloc);
  };
  auto integer = [&](const char* k, int64_t v) { put(k, rapidjson::Value(v)); };
  put("architectures", std::move(archs));
  put("model_type", rapidjson::Value("chatglm", alloc));
  integer("padded_vocab_size", c.vocab_size);
  integer("hidden_size", c.hidden_size);
  integer("ffn_hidden_size", c.intermediate_size);
  integer("num_layers", c.num_hidden_layers);
  integer("num_attention_heads", c.num_attention_heads);
  integer("kv_channels", c.head_dim);
  put("multi_query_attention", rapidjson::Value(c.num_key_value_heads != c.num_attention_heads));
  integer("multi_query_group_num", c.num_key_value_heads);
  integer("seq_length", c.max_position_embeddings);
  put("layernorm_epsilon", rapidjson::Value(c.rms_norm_eps));
  put("rmsnorm", rapidjson::Value(true));
  put("apply_residual_connection_post_layernorm", rapidjson::Value(false));
  put("post_layer_norm", rapidjson::Value(true));
  put("add_bias_linear", rapidjson::Value(false));
  put("add_qkv_bias", rapidjson::Value(c.qkv_bias));
  put("original_rope", rapidjson::Value(true));
  put("rope_ratio", rapidjson::Value(c.rope_theta / 10000.0));
  put("tie_word_embeddings", rapidjson::Value(false));
  put("eos_token_id", decoder::token_value(c.eos_token_id));
  put("pad_token_id", decoder::token_value(c.pad_token_id));
}

// Megatron's names: transformer.{embedding.word_embeddings, encoder.layers.N.{self_attention.
// {query_key_value, dense}, mlp.{dense_h_to_4h, dense_4h_to_h}}, encoder.final_layernorm,
// output_layer}.
constexpr ModuleNames kNames{"transformer",    "embedding.word_embeddings",
                             "encoder.layers", "encoder.final_layernorm",
                             "output_layer",   /*head_in_body=*/true,
                             "self_attention", "query_key_value",
                             "dense",          "dense_h_to_4h",
                             "dense_4h_to_h"};

// THUDM's PrefixEncoder (modeling_chatglm.py), with ChatGLMModel.dropout 0.1 on its output in
// training (get_prompt).
constexpr PrefixTuning kPrefix{/*model_own=*/true, /*embed_at_output_width=*/true, "trans",
                               /*train_dropout=*/0.1, /*positions_from_zero=*/true};

}  // namespace

// zerotrain merge --as glm: transformers' own statement of the same model.
constexpr Conversion kToGlm{"glm", chatglm_as_glm, glm_names_of_chatglm};

extern const Family kChatGlm{"chatglm", read,    write,  /*compose=*/nullptr, /*remote_code=*/true,
                             kNames,    kPrefix, &kToGlm};

}  // namespace model

ModelConfig chatglm_as_glm(const ModelConfig& chatglm) {
  ModelConfig g = chatglm;
  g.model_type = "glm";
  g.source_json.clear();
  return g;
}

std::vector<GlmTensorFrom> glm_names_of_chatglm(const ModelConfig& c, const std::string& name) {
  // transformers' convert_glm_weights_to_hf.py renames by these substrings, in this order.
  static const std::pair<const char*, const char*> kRenames[] = {
      {"transformer.output_layer.", "lm_head."},
      {"transformer.", "model."},
      {".embedding.word_embeddings.", ".embed_tokens."},
      {".encoder.layers.", ".layers."},
      {".encoder.final_layernorm.", ".norm."},
      {"mlp.dense_h_to_4h.", "mlp.gate_up_proj."},
      {"mlp.dense_4h_to_h.", "mlp.down_proj."},
      {".self_attention.", ".self_attn."},
      {"self_attn.dense.", "self_attn.o_proj."},
  };
  std::string out = name;
  for (const auto& [from, to] : kRenames) {
    const size_t at = out.find(from);
    if (at != std::string::npos) out.replace(at, std::string_view(from).size(), to);
  }
  const std::string fused = "self_attn.query_key_value.";
  const size_t at = out.find(fused);
  if (at == std::string::npos) return {{out, 0, -1}};
  const std::string head = out.substr(0, at) + "self_attn.", tail = out.substr(at + fused.size());
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.kv_dim();
  return {{head + "q_proj." + tail, 0, q},
          {head + "k_proj." + tail, q, kv},
          {head + "v_proj." + tail, q + kv, kv}};
}

}  // namespace zt
