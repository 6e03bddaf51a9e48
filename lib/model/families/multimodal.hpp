// What the families of multimodal folders share (family.hpp, Multimodal): transformers' module
// tree for the text decoder of a *ForConditionalGeneration, and its config.json written around
// the text family's.
#pragma once

#include <rapidjson/document.h>

#include "model/family.hpp"

namespace zt::model::multimodal {

/// *ForConditionalGeneration.model.language_model is the decoder; lm_head at the top.
inline constexpr ModuleNames kLanguageModel = [] {
  ModuleNames n;
  n.body = "model.language_model";
  return n;
}();

/// Reads the decoder's members as `text_family` reads them (`r`: text_config, completed with
/// its class's defaults).
void read(json::ObjectReader& r, ModelConfig& c, std::string_view text_family);

/// A whole config.json for `c` without a folder to start from (a config built in code):
/// `architecture` and `c`'s model_type at the top, the text family's config under text_config,
/// and no vision_config (transformers then builds its class's default tower).
void write(rapidjson::Document& doc, const ModelConfig& c, std::string_view text_family,
           const char* architecture);

}  // namespace zt::model::multimodal
