// See multimodal.hpp.
#include "model/families/multimodal.hpp"

#include "model/families/decoder.hpp"

namespace zt::model::multimodal {

void read(json::ObjectReader& r, ModelConfig& c, std::string_view text_family) {
  find_family(text_family)->read_config(r, c);
  r.known({"model_type"});  // checked against text_family by parse_model_config
}

void write(rapidjson::Document& doc, const ModelConfig& c, std::string_view text_family,
           const char* architecture) {
  rapidjson::Document text;
  find_family(text_family)->write_config(text, c);
  text.RemoveMember("architectures");
  decoder::set_member(
      text, "model_type",
      rapidjson::Value(text_family.data(), static_cast<rapidjson::SizeType>(text_family.size()),
                       text.GetAllocator()),
      text.GetAllocator());
  doc.SetObject();
  decoder::Alloc& alloc = doc.GetAllocator();
  rapidjson::Value architectures(rapidjson::kArrayType);
  architectures.PushBack(rapidjson::Value(architecture, alloc), alloc);
  decoder::set_member(doc, "architectures", std::move(architectures), alloc);
  decoder::set_member(doc, "model_type", rapidjson::Value(c.model_type.c_str(), alloc), alloc);
  decoder::set_member(doc, "tie_word_embeddings", rapidjson::Value(c.tie_word_embeddings), alloc);
  decoder::set_member(doc, "text_config", rapidjson::Value(text, alloc), alloc);
}

}  // namespace zt::model::multimodal
