// LoRA's adapter_config.json (lora_config.hpp): the members PEFT 0.21 writes for a LoRA adapter
// and reads back, and target_modules in the form PEFT saves.
#include "peft/lora_config.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/family.hpp"
#include "peft/fused_experts.hpp"
#include "peft/lora_targets.hpp"
#include "peft/pissa.hpp"
#include "util/pattern.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {
namespace {

// PEFT's condensing of a long target list (at 20 names or more): the shortest dotted suffix of
// each target that ends no other module's name, so the list still picks exactly these modules.
constexpr size_t kCondenseFrom = 20;

std::vector<std::string> suffixes_of(
    const std::string& path) {  // shortest first, as PEFT orders them
  std::vector<std::string> out{path.substr(path.rfind('.') + 1)};
  for (size_t dot = path.rfind('.'); dot != std::string::npos && dot > 0;) {
    const size_t prev = path.rfind('.', dot - 1);
    out.push_back(path.substr(prev + 1));
    dot = prev;
  }
  return out;
}

std::set<std::string> condensed(const std::set<std::string>& targets,
                                const std::vector<std::string>& others) {
  std::set<std::string> taken;  // suffixes some other module's name ends with
  for (const std::string& o : others) {
    for (std::string& s : suffixes_of(o)) taken.insert(std::move(s));
  }
  std::vector<std::pair<std::vector<std::string>, std::string>> order;
  for (const std::string& t : targets) order.emplace_back(suffixes_of(t), t);
  std::sort(order.begin(), order.end());
  std::set<std::string> out;
  for (const auto& [suffixes, target] : order) {
    for (const std::string& s : suffixes) {
      if (out.count(s) || taken.count(s)) continue;
      const bool covered = std::any_of(out.begin(), out.end(), [&t = target](const std::string& r) {
        return t != r && ends_with_component(t, r);
      });
      if (!covered) {
        out.insert(s);
        break;
      }
    }
  }
  return out.empty() ? targets : out;
}

// target_modules as PEFT saves them: all-linear written out as the module paths it picked (PEFT
// expands the shorthand before saving, and reads "all-linear" only as a plain string, never
// inside a list), and a list of 20 or more condensed to suffixes as PEFT condenses it.
std::vector<std::string> saved_target_modules(CausalLM& model, const LoraOptions& o) {
  // A multimodal model's decoder alone is modelled here: a short name ("q_proj") would also pick
  // the vision tower's projections in PEFT, so its targets are written as the module paths.
  if (model::family_of(model.config()).multimodal != nullptr) return peft::lora_targets(model, o);
  std::set<std::string> names;
  for (const std::string& t : o.target_modules) {
    if (t != "all-linear" && t != kAllLinearNames) names.insert(t);
  }
  if (std::find_if(o.target_modules.begin(), o.target_modules.end(), [](const std::string& t) {
        return t == "all-linear" || t == kAllLinearNames;
      }) != o.target_modules.end()) {
    for (const std::string& path : peft::lora_targets(model, o)) names.insert(path);
  }
  if (names.size() >= kCondenseFrom) {
    auto targeted = [&](const std::string& m) {
      return std::any_of(names.begin(), names.end(),
                         [&](const std::string& t) { return ends_with_component(m, t); });
    };
    std::vector<std::string> others{
        ""};  // the base model's other modules (LoRA's own A/B left out)
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      const std::string& m = item.key();
      if (m.find(".lora_A") == std::string::npos && m.find(".lora_B") == std::string::npos &&
          !targeted(m)) {
        others.push_back(m);
      }
    }
    std::set<std::string> shorter = condensed(names, others);
    if (shorter.size() < names.size()) names = std::move(shorter);
  }
  return {names.begin(), names.end()};
}

// `key`: the list of `names`, or null when it is empty (as PEFT writes an unset list).
void names_or_null(JsonWriter& w, const char* key, const std::vector<std::string>& names) {
  w.Key(key);
  if (names.empty()) {
    w.Null();
    return;
  }
  w.StartArray();
  for (const std::string& n : names) w.String(n.c_str());
  w.EndArray();
}

// `key`: a list of non-empty names (of a `what`) or null, appended to `out`; anything else is
// refused naming the key.
void read_names_or_null(json::ObjectReader& r, const char* key, const char* what,
                        std::vector<std::string>& out) {
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr || v->IsNull()) return;
  const std::string expected = fmt::format("a list of {} names (non-empty strings) or null", what);
  if (!v->IsArray()) r.fail(key, expected);
  for (const auto& x : v->GetArray()) {
    if (!x.IsString() || x.GetStringLength() == 0) r.fail(key, expected);
    out.emplace_back(json::text(x));
  }
}

}  // namespace

void write_lora_config(JsonWriter& w, CausalLM& model, const LoraOptions& given) {
  // As PEFT saves it on transformers 5: converted for the model's fused experts.
  const LoraOptions o = converted_for_fused_experts(model, given);
  w.Key("peft_type");
  w.String("LORA");
  w.Key("r");
  w.Int64(o.r);
  w.Key("lora_alpha");
  w.Double(o.alpha);
  w.Key("lora_dropout");
  w.Double(o.dropout);
  w.Key("target_modules");
  if (!o.target_regex.empty()) {
    w.String(o.target_regex.c_str());
  } else {
    w.StartArray();
    for (const std::string& t : saved_target_modules(model, o)) w.String(t.c_str());
    w.EndArray();
  }
  names_or_null(w, "target_parameters", o.target_parameters);
  w.Key("bias");
  w.String(o.bias.c_str());
  names_or_null(w, "modules_to_save", o.modules_to_save);
  w.Key("use_rslora");
  w.Bool(o.use_rslora);
  w.Key("use_dora");
  w.Bool(o.use_dora);
  w.Key("fan_in_fan_out");
  w.Bool(false);
  w.Key("init_lora_weights");
  if (o.init_lora_weights == "true") {
    w.Bool(true);
  } else {
    w.String(o.init_lora_weights.c_str());
  }
  w.Key("layers_to_transform");
  w.Null();
  w.Key("layers_pattern");
  w.Null();
  w.Key("rank_pattern");
  w.StartObject();
  for (const auto& [key, rank] : o.rank_pattern) {
    w.Key(key.c_str());
    w.Int64(rank);
  }
  w.EndObject();
  w.Key("alpha_pattern");
  w.StartObject();
  for (const auto& [key, alpha] : o.alpha_pattern) {
    w.Key(key.c_str());
    w.Double(alpha);
  }
  w.EndObject();
}

void read_lora_config(json::ObjectReader& r, LoraOptions& o) {
  if (auto v = r.integer("r", 1)) o.r = *v;
  if (auto v = r.number("lora_alpha", 0.0)) o.alpha = *v;
  if (auto v = r.number("lora_dropout", 0.0, 1.0)) o.dropout = *v;
  const rapidjson::Value* t = r.find("target_modules");
  if (t != nullptr && t->IsString()) {
    o.target_regex = json::text(*t);
    o.target_modules.clear();
    if (o.target_regex == "all-linear") {
      o.target_regex.clear();
      o.target_modules = {"all-linear"};
    }
  } else if (t != nullptr && t->IsArray()) {
    o.target_modules.clear();
    for (const auto& x : t->GetArray()) {
      if (!x.IsString()) r.fail("target_modules", "a list of module names or a regex");
      o.target_modules.emplace_back(json::text(x));
    }
  }
  read_names_or_null(r, "target_parameters", "parameter", o.target_parameters);
  if (auto v = r.choice("bias", {"none", "all", "lora_only"})) o.bias = *v;
  read_names_or_null(r, "modules_to_save", "module", o.modules_to_save);
  if (auto v = r.boolean("use_rslora")) o.use_rslora = *v;
  if (auto v = r.boolean("use_dora")) o.use_dora = *v;
  if (const rapidjson::Value* v = r.find("init_lora_weights"); v != nullptr && !v->IsNull()) {
    if (v->IsBool()) {
      o.init_lora_weights = "true";  // True / False: where A and B start, which the file replaces
    } else if (v->IsString()) {
      const std::optional<std::string> init = canonical_init(json::text(*v));
      if (!init) {
        r.fail_value("init_lora_weights", fmt::format("\"{}\" is not supported by zerotrain; {}",
                                                      json::text(*v), kInitChoices));
      }
      o.init_lora_weights = *init;
    } else {
      r.fail("init_lora_weights", "true, false, \"pissa\" or \"pissa_niter_<n>\"");
    }
  }
  // PEFT options that would change what the adapter computes and that zerotrain lacks.
  for (const char* k : {"fan_in_fan_out", "use_qalora"}) {
    if (auto v = r.boolean(k); v && *v) {
      r.fail_value(k, "is not supported by zerotrain; remove it or set false");
    }
  }
  for (const char* k :
       {"layers_to_transform", "layer_replication", "exclude_modules", "trainable_token_indices"}) {
    const rapidjson::Value* v = r.find(k);
    if (v != nullptr && !(v->IsArray() && v->Empty())) {
      r.fail_value(k, "is not supported by zerotrain; remove it");
    }
  }
  // Per-module ranks and alphas: {pattern: value}, each pattern a regex RE2 takes.
  for (const char* k : {"rank_pattern", "alpha_pattern"}) {
    const rapidjson::Value* v = r.find(k);
    if (v == nullptr || v->IsNull()) continue;
    const bool rank = std::string_view(k) == "rank_pattern";
    const char* expected =
        rank ? "an object of {pattern: rank >= 1}" : "an object of {pattern: alpha >= 0}";
    // Each pattern is matched against every module: bounded, so a hostile file cannot make
    // loading quadratic.
    if (!v->IsObject() || v->MemberCount() > 1024) {
      r.fail(k, std::string(expected) + ", at most 1024 patterns");
    }
    for (const auto& m : v->GetObject()) {
      const std::string key = json::text(m.name);
      if (key.empty() || !m.value.IsNumber()) r.fail(k, expected);
      try {
        Pattern(key, fmt::format("the key \"{}\"", key));  // refused here, not at a module
      } catch (const ConfigError& e) {
        r.fail_value(k, e.what());
      }
      if (rank) {
        const std::optional<int64_t> n = json::as_integer(m.value);
        if (!n || *n < 1 || *n > (int64_t{1} << 20)) r.fail(k, expected);
        o.rank_pattern.emplace_back(key, *n);
      } else {
        const double a = m.value.GetDouble();
        if (!(a >= 0.0) || !std::isfinite(a)) r.fail(k, expected);
        o.alpha_pattern.emplace_back(key, a);
      }
    }
  }
}

}  // namespace zt::peft
