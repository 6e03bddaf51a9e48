// Gemma 3 as published (model_type gemma3, Gemma3ForConditionalGeneration): its text decoder is
// Gemma 3's (gemma3.cpp), read from text_config, trained on text alone; the SigLIP tower and the
// projector are kept as they are (family.hpp, Multimodal).
#include "model/families/decoder.hpp"
#include "model/families/gemma.hpp"

namespace zt::model {
namespace {

// Gemma3TextConfig's defaults for the keys a diff-written text_config leaves out that
// gemma::read does not default itself (google/gemma-3-4b-it's gives six keys).
constexpr std::string_view kTextDefaults = R"({
  "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
  "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
  "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6,
  "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2
})";

constexpr Multimodal kMultimodal{
    "text_config", kTextDefaults, {"model.vision_tower.", "model.multi_modal_projector."}};

// transformers' module tree: Gemma3ForConditionalGeneration.model.language_model is the decoder.
constexpr ModuleNames kNames = [] {
  ModuleNames n;
  n.body = "model.language_model";
  return n;
}();

void read(json::ObjectReader& r, ModelConfig& c) {
  gemma::read(r, c, /*gemma3=*/true);
  r.known({"model_type"});
}

// Without a folder to start from (a config built in code): the text decoder under text_config
// and transformers' default vision tower.
void write(rapidjson::Document& doc, const ModelConfig& c) {
  rapidjson::Document text;
  gemma::write(text, c, "Gemma3ForCausalLM");
  text.RemoveMember("architectures");
  decoder::set_member(text, "model_type", rapidjson::Value("gemma3_text"), text.GetAllocator());
  doc.SetObject();
  decoder::Alloc& alloc = doc.GetAllocator();
  rapidjson::Value architectures(rapidjson::kArrayType);
  architectures.PushBack(rapidjson::Value("Gemma3ForConditionalGeneration"), alloc);
  decoder::set_member(doc, "architectures", std::move(architectures), alloc);
  decoder::set_member(doc, "model_type", rapidjson::Value("gemma3"), alloc);
  decoder::set_member(doc, "tie_word_embeddings", rapidjson::Value(c.tie_word_embeddings), alloc);
  decoder::set_member(doc, "text_config", rapidjson::Value(text, alloc), alloc);
}

}  // namespace

extern const Family kGemma3Multimodal{
    "gemma3", read, write,   gemma::compose,         false,
    kNames,   {},   nullptr, gemma::rope_parameters, &kMultimodal};

}  // namespace zt::model
