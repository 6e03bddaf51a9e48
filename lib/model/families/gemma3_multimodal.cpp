// Gemma 3 as published (model_type gemma3, Gemma3ForConditionalGeneration): its text decoder is
// Gemma 3's (gemma3.cpp), read from text_config, trained on text alone; the SigLIP tower and the
// projector are kept as they are (family.hpp, Multimodal).
#include "model/families/gemma.hpp"
#include "model/families/multimodal.hpp"

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

constexpr Multimodal kMultimodal{"text_config",
                                 "gemma3_text",
                                 kTextDefaults,
                                 {"model.vision_tower.", "model.multi_modal_projector."}};

void read(json::ObjectReader& r, ModelConfig& c) {
  multimodal::read(r, c, kMultimodal.text_model_type);
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  multimodal::write(doc, c, kMultimodal.text_model_type, "Gemma3ForConditionalGeneration");
}

}  // namespace

extern const Family kGemma3Multimodal{"gemma3",
                                      read,
                                      write,
                                      gemma::compose,
                                      false,
                                      multimodal::kLanguageModel,
                                      {},
                                      nullptr,
                                      gemma::rope_parameters,
                                      &kMultimodal};

}  // namespace zt::model
