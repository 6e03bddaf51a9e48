// Mistral-Small-3.1 / 3.2 as published (model_type mistral3, Mistral3ForConditionalGeneration):
// its text decoder is Mistral's (mistral.cpp), read from text_config, trained on text alone; the
// Pixtral tower and the projector are kept as they are (family.hpp, Multimodal).
#include "model/families/multimodal.hpp"

namespace zt::model {
namespace {

// MistralConfig's defaults for the keys a diff-written text_config leaves out that the mistral
// family does not default itself.
constexpr std::string_view kTextDefaults = R"({
  "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2
})";

constexpr Multimodal kMultimodal{"text_config",
                                 "mistral",
                                 kTextDefaults,
                                 {"model.vision_tower.", "model.multi_modal_projector."}};

void read(json::ObjectReader& r, ModelConfig& c) {
  multimodal::read(r, c, kMultimodal.text_model_type);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  multimodal::write(doc, c, kMultimodal.text_model_type, "Mistral3ForConditionalGeneration");
}

}  // namespace

extern const Family kMistral3{
    "mistral3", read,    write,   nullptr,     false, multimodal::kLanguageModel,
    {},         nullptr, nullptr, &kMultimodal};

}  // namespace zt::model
