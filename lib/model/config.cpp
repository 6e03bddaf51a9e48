// HF config.json ↔ ModelConfig, in transformers' 4.x and 5.x spellings.
#include <cmath>

#include <filesystem>

#include <fmt/format.h>

#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"

namespace zt {
namespace {

using json::ObjectReader;

at::ScalarType dtype_from_name(ObjectReader& r, const char* key, const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16" || name == "half") return at::kHalf;
  r.fail(key, "\"float32\", \"bfloat16\" or \"float16\"");
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return "float32";
  }
}

// The RoPE block: 4.x rope_theta + rope_scaling, or 5.x rope_parameters.
void read_rope(ObjectReader& top, ModelConfig& c) {
  std::optional<ObjectReader> params = top.object("rope_parameters");
  std::optional<ObjectReader> scaling = top.object("rope_scaling");
  if (auto v = top.number("rope_theta", 1e-12)) c.rope_theta = *v;
  std::optional<ObjectReader>& r = params ? params : scaling;
  if (!r) return;
  if (params) {
    if (auto v = params->number("rope_theta", 1e-12)) c.rope_theta = *v;
  }
  std::optional<std::string> type = r->string("rope_type");
  if (!type) type = r->string("type");
  if (!type) type = std::string("default");
  r->known({"type", "rope_type"});
  if (*type != "default" && *type != "linear" && *type != "llama3") {
    r->fail_value("rope_type", fmt::format("RoPE type \"{}\" is not supported; supported: "
                                           "default, linear, llama3",
                                           *type));
  }
  c.rope_scaling.type = *type;
  if (*type == "default") return;
  std::optional<double> factor = r->number("factor", 1e-12);
  if (!factor) r->fail("factor", fmt::format("a scaling factor for RoPE type \"{}\"", *type));
  c.rope_scaling.factor = *factor;
  if (*type == "llama3") {
    if (auto v = r->number("low_freq_factor", 1e-12)) c.rope_scaling.low_freq_factor = *v;
    if (auto v = r->number("high_freq_factor", 1e-12)) c.rope_scaling.high_freq_factor = *v;
    std::optional<int64_t> orig = r->integer("original_max_position_embeddings", 1);
    if (!orig) r->fail("original_max_position_embeddings", "an integer for llama3 RoPE scaling");
    c.rope_scaling.original_max_position_embeddings = *orig;
    if (c.rope_scaling.high_freq_factor <= c.rope_scaling.low_freq_factor) {
      r->fail_value("high_freq_factor", "must exceed low_freq_factor");
    }
  }
}

// GLM (glm-4-9b-chat-hf) and GLM-4-0414 (glm4): q/k/v biases without an o_proj bias
// (attention_bias, default true), a fused gate_up_proj, interleaved RoPE on part of each head
// (partial_rotary_factor, default 0.5, top-level or in 5.x's rope_parameters); glm4 norms each
// sublayer's output too.
void read_glm(ObjectReader& r, ModelConfig& c) {
  c.qkv_bias = r.boolean("attention_bias").value_or(true);
  c.fused_gate_up = true;
  c.rope_interleaved = true;
  c.post_sublayer_norms = c.model_type == "glm4";
  c.partial_rotary_factor = 0.5;
  if (auto v = r.number("partial_rotary_factor", 1e-6)) c.partial_rotary_factor = *v;
  if (std::optional<ObjectReader> p = r.object("rope_parameters")) {
    if (auto v = p->number("partial_rotary_factor", 1e-6)) c.partial_rotary_factor = *v;
  }
  const int64_t dim = c.rotary_dim();
  if (c.partial_rotary_factor > 1.0 || dim < 2 || dim % 2 != 0) {
    r.fail_value("partial_rotary_factor",
                 fmt::format("{} of head_dim {} gives {} rotary dimensions; RoPE needs an even "
                             "number between 2 and head_dim",
                             c.partial_rotary_factor, c.head_dim, dim));
  }
  if (auto v = r.boolean("mlp_bias"); v && *v) {
    r.fail_value("mlp_bias", "GLM's MLP has no biases");
  }
  r.known({"attention_dropout", "pad_token_id"});
}

// Each size within what any real model has by a wide margin (token ids are 32-bit), so that no
// product overflows and a corrupt file is refused before anything is allocated.
int64_t required_size(ObjectReader& r, const char* key, int64_t max) {
  std::optional<int64_t> v = r.integer(key, 1, max);
  if (!v) r.fail(key, fmt::format("a positive integer up to {}", max));
  return *v;
}

// The sizes and family switches of transformers' own decoders (llama, qwen2, mistral, glm,
// glm4).
void read_hf_decoder(ObjectReader& r, ModelConfig& c) {
  auto required = [&](const char* key, int64_t max) { return required_size(r, key, max); };
  c.vocab_size = required("vocab_size", int64_t{1} << 31);
  c.hidden_size = required("hidden_size", int64_t{1} << 20);
  c.intermediate_size = required("intermediate_size", int64_t{1} << 22);
  c.num_hidden_layers = required("num_hidden_layers", int64_t{1} << 12);
  c.num_attention_heads = required("num_attention_heads", int64_t{1} << 14);
  c.num_key_value_heads =
      r.integer("num_key_value_heads", 1, c.num_attention_heads).value_or(c.num_attention_heads);
  if (auto v = r.integer("head_dim", 1, int64_t{1} << 14)) {
    c.head_dim = *v;
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.fail_value("num_attention_heads", fmt::format("hidden_size {} is not divisible by {} heads",
                                                      c.hidden_size, c.num_attention_heads));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.fail_value("num_key_value_heads", fmt::format("{} attention heads are not a multiple of {} "
                                                    "key/value heads",
                                                    c.num_attention_heads, c.num_key_value_heads));
  }
  if (auto v = r.integer("max_position_embeddings", 1, int64_t{1} << 30))
    c.max_position_embeddings = *v;
  if (auto v = r.number("rms_norm_eps", 1e-30)) c.rms_norm_eps = *v;
  if (auto v = r.number("initializer_range", 0.0)) c.initializer_range = *v;
  read_rope(r, c);
  if (auto v = r.boolean("tie_word_embeddings")) c.tie_word_embeddings = *v;
  if (auto act = r.string("hidden_act"); act && *act != "silu") {
    r.fail_value("hidden_act", fmt::format("\"{}\" is not supported; the decoder uses silu", *act));
  }
  if (c.model_type == "qwen2") {
    c.qkv_bias = true;  // Qwen2 always has q/k/v biases
    if (auto v = r.boolean("use_sliding_window"); v && *v) {
      r.fail_value("use_sliding_window",
                   "Qwen2's per-layer sliding window is not supported; set "
                   "it to false (Qwen2.5 releases ship it off)");
    }
    r.known({"sliding_window", "max_window_layers", "layer_types"});
  } else if (c.model_type == "glm" || c.model_type == "glm4") {
    read_glm(r, c);
  } else {
    if (auto v = r.boolean("attention_bias")) c.qkv_bias = c.o_proj_bias = *v;
    if (auto v = r.boolean("mlp_bias")) c.mlp_bias = *v;
    if (c.model_type == "mistral") {
      const rapidjson::Value* w = r.find("sliding_window");
      if (w != nullptr) {
        std::optional<int64_t> window = w->IsNumber() ? json::as_integer(*w) : std::nullopt;
        if (!window || *window < 1) r.fail("sliding_window", "a positive integer or null");
        c.sliding_window = *window;
      }
    }
  }
}

// ChatGLM2/3-6B's remote-code config (THUDM's configuration_chatglm.py): glm's arithmetic in
// Megatron's names — padded_vocab_size, num_layers, ffn_hidden_size, kv_channels (head size),
// multi_query_group_num (key/value heads when multi_query_attention), layernorm_epsilon,
// seq_length, add_qkv_bias, rope_ratio (RoPE base 10000 × rope_ratio) — with RoPE on the first
// half of each head in adjacent pairs. The switches its code offers but these models never set
// are refused rather than computed differently.
void read_chatglm(ObjectReader& r, ModelConfig& c) {
  c.chatglm_layout = true;
  c.fused_gate_up = true;
  c.rope_interleaved = true;
  c.partial_rotary_factor = 0.5;
  c.tie_word_embeddings = false;  // output_layer is its own matrix whatever the flag says
  c.rms_norm_eps = 1e-5;
  std::optional<int64_t> padded = r.integer("padded_vocab_size", 1, int64_t{1} << 31);
  c.vocab_size = padded ? *padded : required_size(r, "vocab_size", int64_t{1} << 31);
  c.hidden_size = required_size(r, "hidden_size", int64_t{1} << 20);
  c.intermediate_size = required_size(r, "ffn_hidden_size", int64_t{1} << 22);
  c.num_hidden_layers = required_size(r, "num_layers", int64_t{1} << 12);
  c.num_attention_heads = required_size(r, "num_attention_heads", int64_t{1} << 14);
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

std::optional<int64_t> first_token_id(ObjectReader& r, const char* key) {
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return std::nullopt;
  if (v->IsArray()) {
    if (v->Size() == 0) return std::nullopt;
    v = &(*v)[0];
  }
  std::optional<int64_t> id = v->IsNumber() ? json::as_integer(*v) : std::nullopt;
  if (!id) r.fail(key, "a token id or a list of token ids");
  return id;
}

}  // namespace

int64_t ModelConfig::parameter_count() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim, kv = kv_dim();
  int64_t layer = h * q + 2 * h * kv + q * h + 3 * h * intermediate_size + 2 * h;
  if (post_sublayer_norms) layer += 2 * h;
  if (qkv_bias) layer += q + 2 * kv;
  if (o_proj_bias) layer += h;
  if (mlp_bias) layer += 2 * intermediate_size + h;
  int64_t total = vocab_size * h + num_hidden_layers * layer + h;
  if (!tie_word_embeddings) total += vocab_size * h;
  return total;
}

std::string ModelConfig::layer_prefix(int64_t i) const {
  return fmt::format(chatglm_layout ? "transformer.encoder.layers.{}." : "model.layers.{}.", i);
}

ModelConfig chatglm_as_glm(const ModelConfig& chatglm) {
  ModelConfig g = chatglm;
  g.model_type = "glm";
  g.chatglm_layout = false;
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

ModelConfig parse_model_config(std::string_view text, const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  ObjectReader r(doc, "", source);
  ModelConfig c;
  c.source = source;
  const std::string type = r.required_string(
      "model_type", "the model family (llama, qwen2, mistral, glm, glm4 or chatglm)");
  if (type != "llama" && type != "qwen2" && type != "mistral" && type != "glm" && type != "glm4" &&
      type != "chatglm") {
    r.fail_value("model_type", fmt::format("\"{}\" is not supported; supported: llama, qwen2, "
                                           "mistral, glm, glm4, chatglm",
                                           type));
  }
  c.model_type = type;
  if (type == "chatglm") {
    read_chatglm(r, c);
  } else {
    read_hf_decoder(r, c);
  }
  // RoPE rotates pairs of dimensions: every family needs an even rotary width.
  if (const int64_t dim = c.rotary_dim(); dim < 2 || dim % 2 != 0) {
    r.fail_value(r.has("head_dim") ? "head_dim" : "num_attention_heads",
                 fmt::format("head_dim {} gives {} rotary dimensions; RoPE rotates pairs, so it "
                             "needs an even number of at least 2 (check hidden_size / "
                             "num_attention_heads or head_dim)",
                             c.head_dim, dim));
  }
  if (auto d = r.string("dtype")) {
    c.dtype = dtype_from_name(r, "dtype", *d);
  } else if (auto td = r.string("torch_dtype")) {
    c.dtype = dtype_from_name(r, "torch_dtype", *td);
  }
  c.bos_token_id = first_token_id(r, "bos_token_id");
  c.eos_token_id = first_token_id(r, "eos_token_id");
  c.pad_token_id = first_token_id(r, "pad_token_id");
  // An id beyond the embedding would fail deep inside LibTorch; old configs write -1 for none.
  for (auto [key, id] :
       {std::pair{"bos_token_id", &c.bos_token_id}, std::pair{"eos_token_id", &c.eos_token_id},
        std::pair{"pad_token_id", &c.pad_token_id}}) {
    if (*id && **id < 0) id->reset();
    if (*id && **id >= c.vocab_size) {
      r.fail_value(key, fmt::format("{} is outside the vocabulary [0, {})", **id, c.vocab_size));
    }
  }
  if (auto tp = r.integer("pretraining_tp", 1); tp && *tp != 1) {
    r.fail_value("pretraining_tp",
                 "tensor-parallel pretraining slices (pretraining_tp > 1) are "
                 "not supported");
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::string file = path;
  if (file.size() < 5 || file.compare(file.size() - 5, 5, ".json") != 0) file += "/config.json";
  std::error_code ec;
  const size_t slash = path.find('/');
  if (!std::filesystem::exists(path, ec) && slash != std::string::npos && slash > 0 &&
      path.find('/', slash + 1) == std::string::npos && path[0] != '.' && slash + 1 < path.size()) {
    // "Qwen/Qwen2.5-7B": a hub id, where zerotrain reads local folders only.
    throw IoError(fmt::format(
        "'{}' is not a folder here; it looks like a Hugging Face hub id, and zerotrain reads local "
        "model folders only: download it first (huggingface-cli download {} --local-dir DIR, or "
        "git clone https://huggingface.co/{}) and pass DIR",
        path, path, path));
  }
  std::string text = files::read_text(file, "model config");
  ModelConfig c = parse_model_config(text, file);
  c.source_json = std::move(text);
  return c;
}

namespace {

using Alloc = rapidjson::Document::AllocatorType;

void set_member(rapidjson::Value& obj, const char* key, rapidjson::Value value, Alloc& alloc) {
  if (auto it = obj.FindMember(key); it != obj.MemberEnd()) {
    it->value = std::move(value);
  } else {
    obj.AddMember(rapidjson::Value(key, alloc), std::move(value), alloc);
  }
}

rapidjson::Value string_value(const std::string& s, Alloc& alloc) {
  return rapidjson::Value(s.c_str(), static_cast<rapidjson::SizeType>(s.size()), alloc);
}

// RoPE scaling's own members (factor and, for llama3, its frequency bounds); none for default.
void add_scaling_members(rapidjson::Value& obj, const RopeScaling& r, Alloc& alloc) {
  if (r.type == "default") return;
  set_member(obj, "factor", rapidjson::Value(r.factor), alloc);
  if (r.type == "llama3") {
    set_member(obj, "low_freq_factor", rapidjson::Value(r.low_freq_factor), alloc);
    set_member(obj, "high_freq_factor", rapidjson::Value(r.high_freq_factor), alloc);
    set_member(obj, "original_max_position_embeddings",
               rapidjson::Value(static_cast<int64_t>(r.original_max_position_embeddings)), alloc);
  }
}

// 5.x: rope_parameters {rope_type, rope_theta, ...}.
rapidjson::Value rope_parameters(const ModelConfig& c, Alloc& alloc) {
  rapidjson::Value p(rapidjson::kObjectType);
  set_member(p, "rope_type", string_value(c.rope_scaling.type, alloc), alloc);
  set_member(p, "rope_theta", rapidjson::Value(c.rope_theta), alloc);
  if (c.partial_rotary_factor != 1.0) {
    set_member(p, "partial_rotary_factor", rapidjson::Value(c.partial_rotary_factor), alloc);
  }
  add_scaling_members(p, c.rope_scaling, alloc);
  return p;
}

// 4.x: rope_scaling {rope_type, ...}, null for plain RoPE.
rapidjson::Value rope_scaling(const ModelConfig& c, Alloc& alloc) {
  if (c.rope_scaling.type == "default") return rapidjson::Value(rapidjson::kNullType);
  rapidjson::Value p(rapidjson::kObjectType);
  set_member(p, "rope_type", string_value(c.rope_scaling.type, alloc), alloc);
  add_scaling_members(p, c.rope_scaling, alloc);
  return p;
}

rapidjson::Value token_value(const std::optional<int64_t>& v) {
  return v ? rapidjson::Value(static_cast<int64_t>(*v)) : rapidjson::Value(rapidjson::kNullType);
}

// Every member of an inline config, as transformers' save_pretrained would write them.
void write_full_config(rapidjson::Document& doc, const ModelConfig& c) {
  Alloc& alloc = doc.GetAllocator();
  doc.SetObject();
  const char* arch = c.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                     : c.model_type == "mistral" ? "MistralForCausalLM"
                     : c.model_type == "glm"     ? "GlmForCausalLM"
                     : c.model_type == "glm4"    ? "Glm4ForCausalLM"
                                                 : "LlamaForCausalLM";
  rapidjson::Value archs(rapidjson::kArrayType);
  archs.PushBack(rapidjson::Value(arch, alloc), alloc);
  auto put = [&](const char* k, rapidjson::Value v) { set_member(doc, k, std::move(v), alloc); };
  auto integer = [&](const char* k, int64_t v) { put(k, rapidjson::Value(v)); };
  put("architectures", std::move(archs));
  put("model_type", string_value(c.model_type, alloc));
  integer("vocab_size", c.vocab_size);
  integer("hidden_size", c.hidden_size);
  integer("intermediate_size", c.intermediate_size);
  integer("num_hidden_layers", c.num_hidden_layers);
  integer("num_attention_heads", c.num_attention_heads);
  integer("num_key_value_heads", c.num_key_value_heads);
  integer("head_dim", c.head_dim);
  integer("max_position_embeddings", c.max_position_embeddings);
  put("rms_norm_eps", rapidjson::Value(c.rms_norm_eps));
  put("initializer_range", rapidjson::Value(c.initializer_range));
  put("hidden_act", rapidjson::Value("silu", alloc));
  put("tie_word_embeddings", rapidjson::Value(c.tie_word_embeddings));
  put("use_cache", rapidjson::Value(true));
  if (c.model_type == "qwen2") {
    put("use_sliding_window", rapidjson::Value(false));
    put("sliding_window", rapidjson::Value(rapidjson::kNullType));
    integer("max_window_layers", c.num_hidden_layers);
  } else if (c.fused_gate_up) {  // glm, glm4
    put("attention_bias", rapidjson::Value(c.qkv_bias));
    put("partial_rotary_factor", rapidjson::Value(c.partial_rotary_factor));
  } else {
    put("attention_bias", rapidjson::Value(c.qkv_bias));
    put("mlp_bias", rapidjson::Value(c.mlp_bias));
  }
  if (c.model_type == "mistral") put("sliding_window", token_value(c.sliding_window));
  put("bos_token_id", token_value(c.bos_token_id));
  put("eos_token_id", token_value(c.eos_token_id));
  put("pad_token_id", token_value(c.pad_token_id));
}

// An inline ChatGLM config in configuration_chatglm.py's names (THUDM's remote code reads it
// through auto_map; the folder must carry that code to be loaded by transformers).
void write_chatglm_config(rapidjson::Document& doc, const ModelConfig& c) {
  Alloc& alloc = doc.GetAllocator();
  doc.SetObject();
  rapidjson::Value archs(rapidjson::kArrayType);
  archs.PushBack(rapidjson::Value("ChatGLMModel", alloc), alloc);
  auto put = [&](const char* k, rapidjson::Value v) { set_member(doc, k, std::move(v), alloc); };
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
  put("eos_token_id", token_value(c.eos_token_id));
  put("pad_token_id", token_value(c.pad_token_id));
}

}  // namespace

std::string model_config_json(const ModelConfig& c) {
  rapidjson::Document doc;
  if (!c.source_json.empty()) {
    doc = json::parse(c.source_json, c.source);
  } else if (c.chatglm_layout) {
    write_chatglm_config(doc, c);
  } else {
    write_full_config(doc, c);
  }
  Alloc& alloc = doc.GetAllocator();
  if (c.chatglm_layout) {  // remote code reads torch_dtype and nothing of RoPE's HF spellings
    set_member(doc, "torch_dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
    return json::dump(doc, /*pretty=*/true);
  }
  // The dtype is what zerotrain changes (the weights it writes); both spellings carry it.
  set_member(doc, "torch_dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
  set_member(doc, "dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
  // RoPE in the spelling a line reads, added where the file had only the other's.
  if (!doc.HasMember("rope_theta"))
    set_member(doc, "rope_theta", rapidjson::Value(c.rope_theta), alloc);
  if (!doc.HasMember("rope_scaling"))
    set_member(doc, "rope_scaling", rope_scaling(c, alloc), alloc);
  if (!doc.HasMember("rope_parameters"))
    set_member(doc, "rope_parameters", rope_parameters(c, alloc), alloc);
  return json::dump(doc, /*pretty=*/true);
}

}  // namespace zt
