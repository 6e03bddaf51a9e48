// HF config.json ↔ ModelConfig, in transformers' 4.x and 5.x spellings.
#include <cmath>

#include <filesystem>
#include <optional>

#include <fmt/format.h>

#include "model/families/decoder.hpp"
#include "model/family.hpp"
#include "util/dtype_names.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"

namespace zt {
namespace {

using json::ObjectReader;

at::ScalarType dtype_from_name(ObjectReader& r, const char* key, const std::string& name) {
  if (const std::optional<at::ScalarType> t = torch_float_dtype(name)) return *t;
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
  return model::parameter_count(model::decoder_spec(*this), hidden_size, vocab_size,
                                tie_word_embeddings);
}

std::string ModelConfig::layer_prefix(int64_t i) const {
  const model::ModuleNames& names = model::family_of(*this).names;
  return fmt::format("{}.{}.{}.", names.body, names.layers, i);
}

ModelConfig parse_model_config(std::string_view text, const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  ObjectReader r(doc, "", source);
  ModelConfig c;
  c.source = source;
  const std::string type =
      r.required_string("model_type", fmt::format("the model family ({})", model::family_names()));
  const model::Family* family = model::find_family(type);
  if (family == nullptr) {
    r.fail_value("model_type", fmt::format("\"{}\" is not supported; supported: {}", type,
                                           model::family_names()));
  }
  c.model_type = type;
  // A multimodal folder: its text decoder's config, every key left out at the text config
  // class's default (as transformers' Gemma3TextConfig(**text_config) reads it).
  rapidjson::Document text_doc(rapidjson::kObjectType);
  std::optional<ObjectReader> text_reader;
  if (const model::Multimodal* mm = family->multimodal) {
    const std::string key(mm->text_config);
    text_doc.Parse(mm->text_defaults.data(), mm->text_defaults.size());
    const rapidjson::Value* given = r.find(key.c_str());
    if (given != nullptr && !given->IsNull()) {
      ObjectReader(*given, key, source);  // an object, without repeated keys
      for (auto it = given->MemberBegin(); it != given->MemberEnd(); ++it) {
        rapidjson::Value copy(it->value, text_doc.GetAllocator());
        if (text_doc.HasMember(it->name)) {
          text_doc[it->name] = copy;
        } else {
          text_doc.AddMember(rapidjson::Value(it->name, text_doc.GetAllocator()), copy,
                             text_doc.GetAllocator());
        }
      }
    }
    text_reader.emplace(text_doc, key, source);
    if (auto t = text_reader->string("model_type"); t && *t != mm->text_model_type) {
      text_reader->fail_value(
          "model_type", fmt::format("\"{}\" is not supported under {}; supported: {}", *t, type,
                                    mm->text_model_type));
    }
  }
  ObjectReader& m = text_reader ? *text_reader : r;  // the decoder's members
  family->read_config(m, c);
  // transformers 5 ties a multimodal model's head by its top-level key (default true).
  if (text_reader) {
    if (auto v = r.boolean("tie_word_embeddings")) c.tie_word_embeddings = *v;
  }
  // RoPE rotates pairs of dimensions: every family needs an even rotary width.
  if (const int64_t dim = c.rotary_dim(); dim < 2 || dim % 2 != 0) {
    m.fail_value(m.has("head_dim") ? "head_dim" : "num_attention_heads",
                 fmt::format("head_dim {} gives {} rotary dimensions; RoPE rotates pairs, so it "
                             "needs an even number of at least 2 (check hidden_size / "
                             "num_attention_heads or head_dim)",
                             c.head_dim, dim));
  }
  // LongRoPE divides each rotated frequency by its own factor.
  for (const model::RotarySpec& rotary : model::decoder_spec(c).rotaries) {
    const RopeScaling& s = rotary.scaling;
    if (s.type != "longrope") continue;
    for (auto [key, list] :
         {std::pair{"short_factor", &s.short_factor}, std::pair{"long_factor", &s.long_factor}}) {
      if (static_cast<int64_t>(list->size()) == rotary.rotary_dim / 2) continue;
      m.fail_value(m.has("rope_parameters") ? "rope_parameters" : "rope_scaling",
                   fmt::format("{} has {} factors; LongRoPE needs one per rotated frequency: "
                               "{} (rotary_dim {} / 2, from head_dim {} × "
                               "partial_rotary_factor {})",
                               key, list->size(), rotary.rotary_dim / 2, rotary.rotary_dim,
                               c.head_dim, c.partial_rotary_factor));
    }
  }
  // The dtype and token ids: the top level's, else (a multimodal folder) the decoder's.
  ObjectReader& dtype_at = r.has("dtype") || r.has("torch_dtype") ? r : m;
  if (auto d = dtype_at.string("dtype")) {
    c.dtype = dtype_from_name(dtype_at, "dtype", *d);
  } else if (auto td = dtype_at.string("torch_dtype")) {
    c.dtype = dtype_from_name(dtype_at, "torch_dtype", *td);
  }
  for (auto [key, id] :
       {std::pair{"bos_token_id", &c.bos_token_id}, std::pair{"eos_token_id", &c.eos_token_id},
        std::pair{"pad_token_id", &c.pad_token_id}}) {
    ObjectReader& at = r.has(key) ? r : m;
    *id = first_token_id(at, key);
    // An id beyond the embedding would fail deep inside LibTorch; old configs write -1 for none.
    if (*id && **id < 0) id->reset();
    if (*id && **id >= c.vocab_size) {
      at.fail_value(key, fmt::format("{} is outside the vocabulary [0, {})", **id, c.vocab_size));
    }
  }
  if (auto tp = m.integer("pretraining_tp", 1); tp && *tp != 1) {
    m.fail_value("pretraining_tp",
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

using model::decoder::Alloc;
using model::decoder::set_member;
using model::decoder::string_value;

// 5.x: rope_parameters, one block, unless the family writes its own (Gemma 3: one per layer
// type).
rapidjson::Value rope_parameters(const model::Family& family, const ModelConfig& c, Alloc& alloc) {
  if (family.rope_parameters) return family.rope_parameters(c, alloc);
  return model::decoder::rope_parameters_block(c.rope_theta, c.rope_scaling,
                                               c.partial_rotary_factor, alloc);
}

}  // namespace

std::string model_config_json(const ModelConfig& c) {
  const model::Family* family = &model::family_of(c);
  rapidjson::Document doc;
  if (!c.source_json.empty()) {
    doc = json::parse(c.source_json, c.source);
  } else {
    family->write_config(doc, c);
  }
  Alloc& alloc = doc.GetAllocator();
  // zerotrain writes floating-point weights only: a 4-bit base's quantization_config would make
  // transformers read them as bitsandbytes' (a merged QLoRA model is dequantized).
  if (doc.IsObject()) doc.RemoveMember("quantization_config");
  if (family->remote_code) {  // remote code reads torch_dtype and nothing of RoPE's HF spellings
    set_member(doc, "torch_dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
    return json::dump(doc, /*pretty=*/true);
  }
  // The dtype is what zerotrain changes (the weights it writes); both spellings carry it.
  set_member(doc, "torch_dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
  set_member(doc, "dtype", rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
  // RoPE in the spelling a line reads, added where the file had only the other's: beside the
  // decoder's other members (a multimodal folder's text_config).
  rapidjson::Value* decoder = &doc;
  if (const model::Multimodal* mm = family->multimodal) {
    const std::string key(mm->text_config);
    if (!doc.HasMember(key.c_str()) || !doc[key.c_str()].IsObject())
      set_member(doc, key.c_str(), rapidjson::Value(rapidjson::kObjectType), alloc);
    decoder = &doc[key.c_str()];
    // A dtype the text config states itself follows the weights written, as the top's does.
    for (const char* d : {"torch_dtype", "dtype"}) {
      if (decoder->HasMember(d))
        set_member(*decoder, d, rapidjson::Value(dtype_name(c.dtype), alloc), alloc);
    }
  }
  if (!decoder->HasMember("rope_theta"))
    set_member(*decoder, "rope_theta", rapidjson::Value(c.rope_theta), alloc);
  if (!decoder->HasMember("rope_scaling"))
    set_member(*decoder, "rope_scaling", model::decoder::rope_scaling_block(c.rope_scaling, alloc),
               alloc);
  if (!decoder->HasMember("rope_parameters"))
    set_member(*decoder, "rope_parameters", rope_parameters(*family, c, alloc), alloc);
  return json::dump(doc, /*pretty=*/true);
}

}  // namespace zt
