// See fused_experts.hpp. The tables are transformers 5.17's _MODEL_TO_CONVERSION_PATTERN and
// PEFT 0.21's _MOE_TARGET_MODULE_MAPPING / _MOE_FUSED_TARGETS, as data.
#include "peft/fused_experts.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/layers.hpp"
#include "peft/lora_targets.hpp"
#include "util/pattern.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {
namespace {

struct Rename {
  std::string_view old_name, new_name;
};

// PEFT's mapping of each pattern, in its order (the first old name a target ends with wins).
constexpr std::array<Rename, 4> kQwen2Moe{{{"gate", "gate.weight"},
                                           {"gate_proj", "gate_up_proj"},
                                           {"up_proj", "gate_up_proj"},
                                           {"down_proj", "down_proj"}}};
constexpr std::array<Rename, 4> kMixtral{
    {{"gate", "gate.weight"}, {"w1", "gate_up_proj"}, {"w3", "gate_up_proj"}, {"w2", "down_proj"}}};

const std::array<Rename, 4>& renames_of(std::string_view pattern) {
  return pattern == "mixtral" ? kMixtral : kQwen2Moe;
}

// The two old names fused into gate_up_proj, gate's half first.
std::array<std::string_view, 2> fused_halves(std::string_view pattern) {
  if (pattern == "mixtral") return {"w1", "w3"};
  return {"gate_proj", "up_proj"};
}

bool targets_name(const std::string& target, std::string_view old_name) {
  return ends_with_component(target, std::string(old_name));
}

std::string leaf(const std::string& path) {
  return path.substr(path.rfind('.') + 1);
}

// A regex target_modules resolved to the leaf names of what it matches (modules and
// parameters), with the old names recovered from the fused tensors' containers.
std::set<std::string> resolve_regex(CausalLM& model, const std::string& regex,
                                    std::string_view pattern) {
  const Pattern re(regex, "lora_target_modules");
  // The base model's names, as PEFT sees them before it attaches anything (an adapter's own
  // modules and parameters left out).
  auto adapter_part = [](const std::string& name) {
    return name.find(".lora_") != std::string::npos ||
           name.find(".base_layer") != std::string::npos;
  };
  std::set<std::string> matched;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (!adapter_part(item.key()) && re.full_match(item.key())) matched.insert(leaf(item.key()));
  }
  std::map<std::string, std::set<std::string>> containers;  // a parameter's leaf -> its modules
  for (const auto& item : model.named_parameters(true)) {
    const std::string& key = item.key();
    if (adapter_part(key)) continue;
    if (re.full_match(key)) matched.insert(leaf(key));
    containers[leaf(key)].insert(key.substr(0, key.rfind('.')));
  }
  for (const Rename& m : renames_of(pattern)) {
    const std::string old_name(m.old_name);
    if (matched.count(old_name) != 0) continue;
    for (const std::string& c : containers[std::string(m.new_name)]) {
      if (re.full_match(c + "." + old_name)) {
        matched.insert(old_name);
        break;
      }
    }
  }
  // Names that can pick nothing (a parameter's leaf such as gate_up_proj, a holder such as
  // self_attn) change nothing in PEFT's run; they are dropped here, where each name kept must
  // pick a projection.
  std::set<std::string> projections;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (!adapter_part(item.key()) && std::dynamic_pointer_cast<model::Linear>(item.value()))
      projections.insert(leaf(item.key()));
  }
  std::set<std::string> out;
  for (const std::string& name : matched) {
    bool renamed = false;
    for (const Rename& m : renames_of(pattern)) renamed = renamed || m.old_name == name;
    if (renamed || projections.count(name) != 0) out.insert(name);
  }
  return out;
}

template <typename Value>
void set_pattern(std::vector<std::pair<std::string, Value>>& patterns, const std::string& key,
                 Value value) {
  for (auto& [k, v] : patterns) {
    if (k == key) {
      v = value;
      return;
    }
  }
  patterns.emplace_back(key, value);
}

}  // namespace

std::string_view fused_experts_pattern(std::string_view model_type) {
  static const std::map<std::string_view, std::string_view> kPatterns{
      {"mixtral", "mixtral"},          {"minimax", "mixtral"},
      {"minimax_m2", "mixtral"},       {"qwen2_moe", "qwen2_moe"},
      {"deepseek_v2", "qwen2_moe"},    {"deepseek_v3", "qwen2_moe"},
      {"dots1", "qwen2_moe"},          {"ernie4_5_moe", "qwen2_moe"},
      {"glm4_moe", "qwen2_moe"},       {"glm4_moe_lite", "qwen2_moe"},
      {"glm4v_moe", "qwen2_moe"},      {"longcat_flash", "qwen2_moe"},
      {"solar_open", "qwen2_moe"},     {"qwen3_moe", "qwen2_moe"},
      {"qwen3_omni_moe", "qwen2_moe"}, {"qwen3_next", "qwen2_moe"},
      {"hunyuan_v1_moe", "qwen2_moe"}, {"flex_olmo", "qwen2_moe"},
      {"olmoe", "qwen2_moe"}};
  const auto found = kPatterns.find(model_type);
  return found == kPatterns.end() ? std::string_view() : found->second;
}

LoraOptions converted_for_fused_experts(CausalLM& model, const LoraOptions& given) {
  const std::string_view pattern = fused_experts_pattern(model.config().model_type);
  if (pattern.empty()) return given;
  LoraOptions o = given;
  const auto& renames = renames_of(pattern);
  // A string (a regex, or all-linear) resolved to names first.
  std::vector<std::string> targets = o.target_modules;
  if (!o.target_regex.empty()) {
    const std::set<std::string> resolved = resolve_regex(model, o.target_regex, pattern);
    if (resolved.empty()) return given;  // left for the usual "matches nothing" error
    targets.assign(resolved.begin(), resolved.end());
  } else if (targets.size() == 1 &&
             (targets.front() == "all-linear" || targets.front() == kAllLinearNames)) {
    // Every projection's name; PEFT's string all-linear adds the experts' and router's old
    // names (they were nn.Linear in 4.x), LLaMA-Factory's list holds what it found only.
    std::set<std::string> names;
    for (const std::string& path : lora_targets(model, o)) names.insert(leaf(path));
    if (targets.front() == "all-linear") {
      for (const Rename& m : renames) names.insert(std::string(m.old_name));
    }
    targets.assign(names.begin(), names.end());
  } else {
    bool any = false;
    for (const std::string& t : targets) {
      for (const Rename& m : renames) any = any || targets_name(t, m.old_name);
    }
    if (!any) return given;
  }
  std::vector<std::string> remaining;
  std::set<std::string_view> halves;  // the fused halves named
  for (const std::string& t : targets) {
    const Rename* mapped = nullptr;
    for (const Rename& m : renames) {
      if (targets_name(t, m.old_name)) {
        mapped = &m;
        break;
      }
    }
    if (mapped == nullptr) {
      remaining.push_back(t);
      continue;
    }
    const std::string name(mapped->new_name);
    if (std::find(o.target_parameters.begin(), o.target_parameters.end(), name) ==
        o.target_parameters.end()) {
      o.target_parameters.push_back(name);
    }
    if (mapped->new_name == "gate_up_proj") halves.insert(mapped->old_name);
  }
  const auto both = fused_halves(pattern);
  if (halves.size() == 1) {
    const std::string_view named = *halves.begin();
    throw ConfigError(fmt::format(
        "lora_target_modules: {} alone cannot be adapted on {}: transformers 5 fuses {} and {} "
        "of each expert into one gate_up_proj tensor, so PEFT (and zerotrain) target both or "
        "neither; add {}",
        named, model.config().model_type, both[0], both[1], named == both[0] ? both[1] : both[0]));
  }
  if (halves.size() == 2) {
    set_pattern(o.rank_pattern, ".*\\.gate_up_proj", o.r * 2);
    set_pattern(o.alpha_pattern, ".*\\.gate_up_proj", o.alpha * 2);
  }
  o.target_modules = remaining;
  o.target_regex.clear();
  return o;
}

}  // namespace zt::peft
