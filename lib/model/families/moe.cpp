// See moe.hpp.
#include "model/families/moe.hpp"

#include <fmt/format.h>

#include <memory>

#include "model/families/decoder.hpp"

namespace zt::model::moe {

const Settings& settings_of(const ModelConfig& c) {
  static const Settings defaults;
  const auto* s = dynamic_cast<const Settings*>(c.family_settings.get());
  return s != nullptr ? *s : defaults;
}

std::shared_ptr<Settings> read(json::ObjectReader& r, const ModelConfig& c, const char* experts_key,
                               const char* alias, int64_t experts, int64_t top_k,
                               int64_t intermediate) {
  auto s = std::make_shared<Settings>();
  const char* key = r.has(experts_key) || !r.has(alias) ? experts_key : alias;
  s->spec.experts = r.integer(key, 1, 4096).value_or(experts);
  s->spec.top_k = r.integer("num_experts_per_tok", 1, 4096).value_or(top_k);
  if (s->spec.top_k > s->spec.experts) {
    r.fail_value("num_experts_per_tok",
                 fmt::format("{} experts per token, but the model has {} experts ({})",
                             s->spec.top_k, s->spec.experts, key));
  }
  s->spec.intermediate = intermediate;
  // The experts' parameters must fit the counts that memory planning multiplies.
  const double per_layer = static_cast<double>(s->spec.experts) *
                           static_cast<double>(c.hidden_size) *
                           (1.0 + 3.0 * static_cast<double>(intermediate));
  if (per_layer * static_cast<double>(c.num_hidden_layers) > 0x1p52) {
    r.fail_value(key, fmt::format("the experts' parameters overflow any model this library "
                                  "trains; check {}, the experts' width and hidden_size",
                                  key));
  }
  s->output_router_logits = r.boolean("output_router_logits").value_or(false);
  if (auto v = r.number("router_aux_loss_coef", 0.0, 1e6)) s->router_aux_loss_coef = *v;
  s->sparse.assign(static_cast<size_t>(c.num_hidden_layers), true);
  return s;
}

bool set_router_aux(ModelConfig& c, double coefficient) {
  const auto* s = dynamic_cast<const Settings*>(c.family_settings.get());
  if (s == nullptr || !s->balance_loss) return false;
  auto changed = std::make_shared<Settings>(*s);
  changed->output_router_logits = true;
  changed->router_aux_loss_coef = coefficient;
  c.family_settings = std::move(changed);
  return true;
}

void compose(const Settings& s, DecoderSpec& d) {
  for (size_t i = 0; i < d.layers.size(); ++i) {
    if (i < s.sparse.size() ? s.sparse[i] : true) d.layers[i].moe = s.spec;
  }
  if (s.output_router_logits && s.balance_loss) d.router_aux_coef = s.router_aux_loss_coef;
}

void write(rapidjson::Document& doc, const Settings& s) {
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "num_experts_per_tok", rapidjson::Value(s.spec.top_k), alloc);
  decoder::set_member(doc, "output_router_logits", rapidjson::Value(s.output_router_logits), alloc);
  decoder::set_member(doc, "router_aux_loss_coef", rapidjson::Value(s.router_aux_loss_coef), alloc);
}

}  // namespace zt::model::moe
