// See decoder.hpp.
#include "model/families/decoder.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <iterator>

#include "zerotrain/error.hpp"

namespace zt::model::decoder {

using json::ObjectReader;

void read_rope_block(ObjectReader& block, double& theta, RopeScaling& scaling) {
  ObjectReader* r = &block;
  if (auto v = r->number("rope_theta", 1e-12)) theta = *v;
  std::optional<std::string> type = r->string("rope_type");
  if (!type) type = r->string("type");
  if (!type) type = std::string("default");
  r->known({"type", "rope_type", "partial_rotary_factor"});
  constexpr const char* kTypes[] = {"default", "linear", "dynamic", "llama3", "yarn", "longrope"};
  if (std::find(std::begin(kTypes), std::end(kTypes), *type) == std::end(kTypes)) {
    r->fail_value("rope_type", fmt::format("RoPE type \"{}\" is not supported; supported: {}",
                                           *type, fmt::join(kTypes, ", ")));
  }
  scaling.type = *type;
  if (*type == "default") return;
  std::optional<double> factor = r->number("factor", 1e-12);
  const bool factor_optional = *type == "yarn" || *type == "longrope";
  if (!factor && !factor_optional)
    r->fail("factor", fmt::format("a scaling factor for RoPE type \"{}\"", *type));
  if (factor) {
    if (*factor < 1.0 && *type != "linear") {
      r->fail_value("factor", fmt::format("{} < 1: RoPE type \"{}\" extends the context by a "
                                          "factor of at least 1",
                                          *factor, *type));
    }
    scaling.factor = *factor;
    scaling.factor_given = true;
  }
  if (auto v = r->integer("original_max_position_embeddings", 1, int64_t{1} << 30))
    scaling.original_max_position_embeddings = *v;
  if (*type == "llama3") {
    if (auto v = r->number("low_freq_factor", 1e-12)) scaling.low_freq_factor = *v;
    if (auto v = r->number("high_freq_factor", 1e-12)) scaling.high_freq_factor = *v;
    if (scaling.original_max_position_embeddings == 0)
      r->fail("original_max_position_embeddings", "an integer for llama3 RoPE scaling");
    if (scaling.high_freq_factor <= scaling.low_freq_factor) {
      r->fail_value("high_freq_factor", "must exceed low_freq_factor");
    }
  }
  if (*type == "yarn" || *type == "longrope") {
    const rapidjson::Value* a = r->find("attention_factor");
    if (a != nullptr && !a->IsNull()) {
      scaling.attention_factor = r->number("attention_factor", 1e-12);
      if (!scaling.attention_factor) r->fail("attention_factor", "a positive number or null");
    }
  }
  if (*type == "yarn") {
    // transformers: a missing (or zero) beta_fast / beta_slow is 32 / 1.
    if (auto v = r->number("beta_fast", 0.0); v && *v > 0) scaling.beta_fast = *v;
    if (auto v = r->number("beta_slow", 0.0); v && *v > 0) scaling.beta_slow = *v;
    if (auto v = r->number("mscale", 0.0)) scaling.mscale = *v;
    if (auto v = r->number("mscale_all_dim", 0.0)) scaling.mscale_all_dim = *v;
    if (auto v = r->boolean("truncate")) scaling.truncate = *v;
  }
  if (*type == "longrope") {
    for (auto [key, list] : {std::pair{"short_factor", &scaling.short_factor},
                             std::pair{"long_factor", &scaling.long_factor}}) {
      const rapidjson::Value* v = r->find(key);
      if (v == nullptr || !v->IsArray() || v->Empty())
        r->fail(key, "a list of positive numbers, one per rotated frequency (rotary_dim / 2)");
      list->clear();
      for (const rapidjson::Value& x : v->GetArray()) {
        if (!x.IsNumber() || !(x.GetDouble() > 0.0) || !std::isfinite(x.GetDouble()))
          r->fail(key, "a list of positive numbers, one per rotated frequency (rotary_dim / 2)");
        list->push_back(x.GetDouble());
      }
    }
  }
}

void complete_rope(ObjectReader& top, const ModelConfig& c, RopeScaling& s) {
  if (s.type != "yarn" && s.type != "longrope") return;
  // transformers' standardize_rope_params: the original length from the block, else from the
  // top (Phi-3 writes it there), else max_position_embeddings.
  if (s.original_max_position_embeddings == 0) {
    s.original_max_position_embeddings =
        top.integer("original_max_position_embeddings", 1, int64_t{1} << 30)
            .value_or(c.max_position_embeddings);
  }
  if (!s.factor_given) {
    s.factor = static_cast<double>(c.max_position_embeddings) /
               static_cast<double>(s.original_max_position_embeddings);
  }
}

namespace {

// The RoPE settings: 4.x rope_theta + rope_scaling, or 5.x rope_parameters. rope_parameters
// with one block per layer type (Gemma 3) is left to the family.
void read_rope(ObjectReader& top, ModelConfig& c) {
  std::optional<ObjectReader> params = top.object("rope_parameters");
  std::optional<ObjectReader> scaling = top.object("rope_scaling");
  if (auto v = top.number("rope_theta", 1e-12)) c.rope_theta = *v;
  if (params && (params->has("full_attention") || params->has("sliding_attention"))) return;
  if (params) {
    read_rope_block(*params, c.rope_theta, c.rope_scaling);
  } else if (scaling) {
    double unused = c.rope_theta;  // 4.x keeps theta at the top
    read_rope_block(*scaling, unused, c.rope_scaling);
  }
  complete_rope(top, c, c.rope_scaling);
}

}  // namespace

int64_t required_size(ObjectReader& r, const char* key, int64_t max) {
  std::optional<int64_t> v = r.integer(key, 1, max);
  if (!v) r.fail(key, fmt::format("a positive integer up to {}", max));
  return *v;
}

void read_common(ObjectReader& r, ModelConfig& c, std::string_view activation) {
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
  if (auto act = r.string("hidden_act"); act && *act != activation) {
    r.fail_value("hidden_act",
                 fmt::format("\"{}\" is not supported; the decoder uses {}", *act, activation));
  }
}

void read_projection_biases(ObjectReader& r, ModelConfig& c) {
  if (auto v = r.boolean("attention_bias")) c.qkv_bias = c.o_proj_bias = *v;
  if (auto v = r.boolean("mlp_bias")) c.mlp_bias = *v;
}

void read_partial_rotary(ObjectReader& r, ModelConfig& c, double otherwise) {
  c.partial_rotary_factor = otherwise;
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
}

void read_sliding_window(ObjectReader& r, ModelConfig& c) {
  const rapidjson::Value* w = r.find("sliding_window");
  if (w == nullptr || w->IsNull()) return;
  std::optional<int64_t> window = w->IsNumber() ? json::as_integer(*w) : std::nullopt;
  if (!window || *window < 1) r.fail("sliding_window", "a positive integer or null");
  c.sliding_window = *window;
}

void refuse_attention_dropout(ObjectReader& r) {
  if (auto p = r.number("attention_dropout", 0.0); p && *p > 0.0) {
    r.fail_value("attention_dropout", "dropout inside the decoder is not supported; set it to 0");
  }
}

std::optional<std::vector<bool>> read_sliding_layers(ObjectReader& r, const ModelConfig& c) {
  const rapidjson::Value* types = r.find("layer_types");
  if (types == nullptr || types->IsNull()) return std::nullopt;
  const int64_t layers = c.num_hidden_layers;
  if (!types->IsArray() || static_cast<int64_t>(types->Size()) != layers) {
    r.fail_value("layer_types", fmt::format("expected a list of {} layer types (one per layer "
                                            "of num_hidden_layers)",
                                            layers));
  }
  std::vector<bool> sliding;
  for (rapidjson::SizeType i = 0; i < types->Size(); ++i) {
    const rapidjson::Value& t = (*types)[i];
    const std::string type = t.IsString() ? json::text(t) : "";
    if (type != "sliding_attention" && type != "full_attention") {
      r.fail_value("layer_types", fmt::format("layer {}: expected \"sliding_attention\" or "
                                              "\"full_attention\"",
                                              i));
    }
    sliding.push_back(type == "sliding_attention");
  }
  return sliding;
}

void read_full_attention_layers(ObjectReader& r, const ModelConfig& c) {
  const rapidjson::Value* types = r.find("layer_types");
  if (types == nullptr || types->IsNull()) return;
  if (!types->IsArray() || static_cast<int64_t>(types->Size()) != c.num_hidden_layers) {
    r.fail_value("layer_types",
                 fmt::format("expected a list of {} layer types (one per layer of "
                             "num_hidden_layers), found {}",
                             c.num_hidden_layers,
                             types->IsArray() ? fmt::format("{} entries", types->Size())
                                              : std::string("no list")));
  }
  for (rapidjson::SizeType i = 0; i < types->Size(); ++i) {
    const rapidjson::Value& t = (*types)[i];
    if (!t.IsString() || json::text(t) != "full_attention") {
      r.fail_value("layer_types",
                   fmt::format("layer {} is {}; this family attends in full on every layer "
                               "(\"full_attention\")",
                               i, t.IsString() ? "\"" + json::text(t) + "\"" : "not a string"));
    }
  }
}

void read_qwen_sliding_window(ObjectReader& r, const ModelConfig& c, std::string_view family) {
  if (auto v = r.boolean("use_sliding_window"); v && *v) {
    r.fail_value("use_sliding_window",
                 fmt::format("{}'s per-layer sliding window is not supported; set it to false "
                             "(the released models ship it off)",
                             family));
  }
  read_full_attention_layers(r, c);
  r.known({"sliding_window", "max_window_layers"});
}

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

rapidjson::Value token_value(const std::optional<int64_t>& v) {
  return v ? rapidjson::Value(static_cast<int64_t>(*v)) : rapidjson::Value(rapidjson::kNullType);
}

void write_common(rapidjson::Document& doc, const ModelConfig& c, const char* architecture) {
  Alloc& alloc = doc.GetAllocator();
  doc.SetObject();
  rapidjson::Value archs(rapidjson::kArrayType);
  archs.PushBack(rapidjson::Value(architecture, alloc), alloc);
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
}

void write_projection_biases(rapidjson::Document& doc, const ModelConfig& c) {
  set_member(doc, "attention_bias", rapidjson::Value(c.qkv_bias), doc.GetAllocator());
  set_member(doc, "mlp_bias", rapidjson::Value(c.mlp_bias), doc.GetAllocator());
}

namespace {

rapidjson::Value number_list(const std::vector<double>& values, Alloc& alloc) {
  rapidjson::Value list(rapidjson::kArrayType);
  for (double v : values) list.PushBack(rapidjson::Value(v), alloc);
  return list;
}

// RoPE scaling's own members (none for default), as transformers reads them back: a yarn or
// longrope factor only where the file gave one (else transformers derives the same from the
// lengths).
void add_scaling_members(rapidjson::Value& obj, const RopeScaling& r, Alloc& alloc) {
  if (r.type == "default") return;
  const bool derived = r.type == "yarn" || r.type == "longrope";
  if (!derived || r.factor_given) set_member(obj, "factor", rapidjson::Value(r.factor), alloc);
  if (r.type == "llama3") {
    set_member(obj, "low_freq_factor", rapidjson::Value(r.low_freq_factor), alloc);
    set_member(obj, "high_freq_factor", rapidjson::Value(r.high_freq_factor), alloc);
  }
  if (r.type == "llama3" || derived) {
    set_member(obj, "original_max_position_embeddings",
               rapidjson::Value(static_cast<int64_t>(r.original_max_position_embeddings)), alloc);
  }
  if (derived && r.attention_factor)
    set_member(obj, "attention_factor", rapidjson::Value(*r.attention_factor), alloc);
  if (r.type == "yarn") {
    set_member(obj, "beta_fast", rapidjson::Value(r.beta_fast), alloc);
    set_member(obj, "beta_slow", rapidjson::Value(r.beta_slow), alloc);
    if (r.mscale) set_member(obj, "mscale", rapidjson::Value(*r.mscale), alloc);
    if (r.mscale_all_dim)
      set_member(obj, "mscale_all_dim", rapidjson::Value(*r.mscale_all_dim), alloc);
    if (!r.truncate) set_member(obj, "truncate", rapidjson::Value(false), alloc);
  }
  if (r.type == "longrope") {
    set_member(obj, "short_factor", number_list(r.short_factor, alloc), alloc);
    set_member(obj, "long_factor", number_list(r.long_factor, alloc), alloc);
  }
}

}  // namespace

rapidjson::Value rope_parameters_block(double theta, const RopeScaling& scaling,
                                       double partial_rotary_factor, Alloc& alloc) {
  rapidjson::Value p(rapidjson::kObjectType);
  set_member(p, "rope_type", string_value(scaling.type, alloc), alloc);
  set_member(p, "rope_theta", rapidjson::Value(theta), alloc);
  if (partial_rotary_factor != 1.0) {
    set_member(p, "partial_rotary_factor", rapidjson::Value(partial_rotary_factor), alloc);
  }
  add_scaling_members(p, scaling, alloc);
  return p;
}

rapidjson::Value rope_scaling_block(const RopeScaling& scaling, Alloc& alloc) {
  if (scaling.type == "default") return rapidjson::Value(rapidjson::kNullType);
  rapidjson::Value p(rapidjson::kObjectType);
  if (scaling.type == "longrope") {
    set_member(p, "type", string_value("longrope", alloc), alloc);
    set_member(p, "short_factor", number_list(scaling.short_factor, alloc), alloc);
    set_member(p, "long_factor", number_list(scaling.long_factor, alloc), alloc);
    return p;
  }
  set_member(p, "rope_type", string_value(scaling.type, alloc), alloc);
  add_scaling_members(p, scaling, alloc);
  return p;
}

rapidjson::Value layer_types_value(int64_t layers, const std::function<bool(int64_t)>& sliding,
                                   Alloc& alloc) {
  rapidjson::Value types(rapidjson::kArrayType);
  for (int64_t i = 0; i < layers; ++i) {
    types.PushBack(rapidjson::Value(sliding(i) ? "sliding_attention" : "full_attention", alloc),
                   alloc);
  }
  return types;
}

void write_token_ids(rapidjson::Document& doc, const ModelConfig& c) {
  Alloc& alloc = doc.GetAllocator();
  set_member(doc, "bos_token_id", token_value(c.bos_token_id), alloc);
  set_member(doc, "eos_token_id", token_value(c.eos_token_id), alloc);
  set_member(doc, "pad_token_id", token_value(c.pad_token_id), alloc);
}

}  // namespace zt::model::decoder
