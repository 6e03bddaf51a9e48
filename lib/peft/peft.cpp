// Applying PEFT methods to a CausalLM: LoRA injection, prompt encoders, Freeze, counting,
// merging.
#include "zerotrain/peft.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <iterator>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/family.hpp"
#include "model/layers.hpp"
#include "model/moe.hpp"
#include "model/quantized_weights.hpp"
#include "peft/expert_lora.hpp"
#include "peft/fused_experts.hpp"
#include "peft/linear_adapters.hpp"
#include "peft/lora_targets.hpp"
#include "peft/pissa.hpp"
#include "peft/prompt_encoders.hpp"
#include "util/capacity.hpp"
#include "util/pattern.hpp"
#include "zerotrain/error.hpp"

namespace zt {

bool peft::ends_with_component(const std::string& path, const std::string& name) {
  return path == name || (path.size() > name.size() &&
                          path.compare(path.size() - name.size(), name.size(), name) == 0 &&
                          path[path.size() - name.size() - 1] == '.');
}

bool peft::in_adapter(const std::string& name, const LoraOptions& o,
                      const std::vector<std::string>& wrapped) {
  if (is_adapter_parameter(name)) return true;
  const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const std::string module = name.substr(0, name.rfind('.'));
  if (bias && o.bias == "all") return true;
  if (bias && o.bias == "lora_only" &&
      std::find(wrapped.begin(), wrapped.end(), module) != wrapped.end()) {
    return true;
  }
  return std::any_of(o.modules_to_save.begin(), o.modules_to_save.end(),
                     [&](const std::string& m) { return ends_with_component(module, m); });
}

namespace {

using peft::ends_with_component;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    std::string item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(item.substr(a, b - a + 1));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

bool has_component(const std::string& path, const std::string& name) {
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('.', start);
    if (path.compare(start, end == std::string::npos ? std::string::npos : end - start, name) ==
            0 &&
        (end == std::string::npos ? path.size() - start : end - start) == name.size()) {
      return true;
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return false;
}

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// The projections of the model by module path: its Linears, not those an adapter registers on
// a projection (LoRA's lora_A / lora_B).
std::vector<std::pair<std::string, std::shared_ptr<model::Linear>>> projections(
    torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::shared_ptr<model::Linear>>> out;
  std::set<std::string> linear_paths;
  for (const auto& item : m.named_modules("", /*include_self=*/false)) {
    auto lin = std::dynamic_pointer_cast<model::Linear>(item.value());
    if (!lin) continue;
    linear_paths.insert(item.key());
    const size_t dot = item.key().rfind('.');
    if (dot != std::string::npos && linear_paths.count(item.key().substr(0, dot))) continue;
    out.emplace_back(item.key(), lin);
  }
  return out;
}

// The mixtures' experts modules by path (their fused tensors are what target_parameters names).
std::vector<std::pair<std::string, std::shared_ptr<model::MoeExperts>>> experts_modules(
    torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::shared_ptr<model::MoeExperts>>> out;
  for (const auto& item : m.named_modules("", /*include_self=*/false)) {
    if (auto e = std::dynamic_pointer_cast<model::MoeExperts>(item.value()))
      out.emplace_back(item.key(), e);
  }
  return out;
}

// The output layer's module path, by the model's family (lm_head, transformer.output_layer).
std::string output_layer_path(const ModelConfig& c) {
  const model::ModuleNames& n = model::family_of(c).names;
  return n.head_in_body ? fmt::format("{}.{}", n.body, n.lm_head) : std::string(n.lm_head);
}

// `pattern` is o.target_regex compiled (when there is one); `head` the output layer's path;
// `router`: the projection is a mixture's router, which target_parameters adapts by its weight
// ("gate.weight") and all-linear leaves out (transformers 5's router is no nn.Linear).
bool is_lora_target(const std::string& path, const LoraOptions& o, const Pattern* pattern,
                    const std::string& head, bool router) {
  if (router) {
    for (const std::string& t : o.target_parameters) {
      if (ends_with_component(path + ".weight", t)) return true;
    }
  }
  if (pattern != nullptr) return pattern->full_match(path);
  for (const std::string& t : o.target_modules) {
    // PEFT's all-linear, LLaMA-Factory's all: every projection but the output layer.
    if (t == "all-linear" || t == peft::kAllLinearNames) {
      if (path != head && !router) return true;
    } else if (ends_with_component(path, t)) {
      return true;
    }
  }
  return false;
}

void freeze_all(torch::nn::Module& m) {
  for (auto& p : m.parameters(true)) p.set_requires_grad(false);
}

}  // namespace

LoraOptions LoraOptions::at(const std::string& path) const {
  LoraOptions out = *this;
  out.rank_pattern.clear();
  out.alpha_pattern.clear();
  auto matches = [&](const std::string& key, const char* what) {
    return Pattern("(.*\\.)?(" + key + ")", fmt::format("lora {} key \"{}\"", what, key))
        .full_match(path);
  };
  for (const auto& [key, rank] : rank_pattern) {
    if (matches(key, "rank_pattern")) {
      out.r = rank;
      break;
    }
  }
  for (const auto& [key, value] : alpha_pattern) {
    if (matches(key, "alpha_pattern")) {
      out.alpha = value;
      break;
    }
  }
  return out;
}

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

namespace {

// The prompt encoder's fp32 parameters, counted before they are allocated (its embedding and
// linear layers; the LSTM's are left out, so this is a lower bound).
void check_prompt_fits(const ModelConfig& m, const PromptOptions& o, bool prefix) {
  const double n = static_cast<double>(o.num_virtual_tokens);
  const double hidden =
      static_cast<double>(o.encoder_hidden_size > 0 ? o.encoder_hidden_size : m.hidden_size);
  double elements = 0;
  if (prefix) {
    const double out =
        static_cast<double>(m.num_hidden_layers) * 2.0 * static_cast<double>(m.kv_dim());
    const double in =
        model::family_of(m).prefix.embed_at_output_width ? out : static_cast<double>(m.kv_dim());
    elements = o.prefix_projection ? n * in + in * hidden + hidden * out : n * out;
  } else {
    const double dim = static_cast<double>(m.hidden_size);
    elements = n * dim + 2 * dim * hidden + hidden * hidden;
  }
  capacity::check_fits(elements * 4, -1,
                       fmt::format("a prompt encoder of {} virtual tokens (encoder_hidden_size {})",
                                   o.num_virtual_tokens, static_cast<int64_t>(hidden)),
                       "lower num_virtual_tokens or encoder_hidden_size");
}

void apply_lora(CausalLM& model, const LoraOptions& given, uint64_t seed) {
  // What PEFT 0.21 trains on transformers 5 for this model's type (its experts fused).
  const LoraOptions o = peft::converted_for_fused_experts(model, given);
  if ((!o.rank_pattern.empty() || !o.alpha_pattern.empty()) &&
      (o.use_dora || o.init_lora_weights != "true")) {
    throw ConfigError(
        "lora rank_pattern / alpha_pattern (set by PEFT's conversion when gate_proj and up_proj "
        "name a mixture's fused experts) cannot be combined with DoRA or PiSSA in zerotrain; "
        "drop use_dora / pissa_init, or target the experts' tensors apart");
  }
  if (o.r < 1) throw ConfigError(fmt::format("lora_r: expected an integer >= 1, found {}", o.r));
  if (o.bias != "none" && o.bias != "all" && o.bias != "lora_only") {
    throw ConfigError(
        fmt::format("lora_bias: expected none, all or lora_only, found \"{}\"", o.bias));
  }
  const std::vector<std::string> targeted = peft::lora_targets(model, o);
  double adapter_elements = 0;
  for (auto& [path, lin] : projections(model)) {
    if (std::find(targeted.begin(), targeted.end(), path) != targeted.end())
      adapter_elements += static_cast<double>(o.at(path).r) *
                          static_cast<double>(lin->in_features + lin->out_features);
  }
  const auto experts = experts_modules(model);
  for (auto& [path, e] : experts) {
    for (size_t i : peft::targeted_expert_tensors(path, o)) {
      const std::vector<int64_t> w = e->shape(i);
      const int64_t r = o.at(path + "." + model::MoeExperts::kNames[i]).r;
      adapter_elements +=
          static_cast<double>(r) * static_cast<double>(w[0]) * static_cast<double>(w[1] + w[2]);
    }
  }
  capacity::check_fits(adapter_elements * 4, -1,
                       fmt::format("LoRA rank {} on {} projections{}", o.r, targeted.size(),
                                   o.target_parameters.empty() ? "" : " and the experts"),
                       "lower lora_r or target fewer modules");
  // target_parameters: the experts' fused tensors and the routers' weights, and each name must
  // pick some.
  for (const std::string& t : o.target_parameters) {
    bool any = std::any_of(experts.begin(), experts.end(), [&](const auto& item) {
      return std::any_of(
          std::begin(model::MoeExperts::kNames), std::end(model::MoeExperts::kNames),
          [&](const char* tensor) { return ends_with_component(item.first + "." + tensor, t); });
    });
    for (auto& [path, lin] : projections(model)) {
      any = any || (std::dynamic_pointer_cast<model::MoeRouter>(lin) != nullptr &&
                    ends_with_component(path + ".weight", t));
    }
    if (!any) {
      throw ConfigError(fmt::format(
          "lora_target_parameters: \"{}\" names none of this model's expert tensors or routers; {}",
          t,
          experts.empty()
              ? std::string("the model has no mixture-of-experts layers (target modules instead)")
              : fmt::format("they are {0}.gate_up_proj and {0}.down_proj in each mixture "
                            "layer (experts.gate_up_proj / experts.down_proj match them all; "
                            "gate.weight the routers)",
                            experts.front().first)));
    }
  }
  peft::check_expert_options(o);
  freeze_all(model);
  for (auto& [path, lin] : projections(model)) {
    if (std::find(targeted.begin(), targeted.end(), path) != targeted.end())
      peft::attach_adapter(path, *lin, o, seed);
  }
  for (auto& [path, e] : experts) peft::attach_expert_adapters(path, *e, o, seed);
  // Every name (or the regex) must pick something: a typo would otherwise leave a module
  // silently untrained.
  std::set<std::string> distinct;
  for (auto& [path, lin] : projections(model)) distinct.insert(path.substr(path.rfind('.') + 1));
  auto unmatched = [&](const std::string& pattern) {
    return ConfigError(
        fmt::format("lora_target_modules: \"{}\" matches no projection of this model; its "
                    "projections are named {} (or use all-linear)",
                    pattern, fmt::join(distinct, ", ")));
  };
  if (!o.target_regex.empty() && targeted.empty()) throw unmatched(o.target_regex);
  for (const std::string& t : o.target_modules) {
    if (t == "all-linear" || t == peft::kAllLinearNames) continue;
    const bool any = std::any_of(targeted.begin(), targeted.end(), [&](const std::string& path) {
      return ends_with_component(path, t);
    });
    if (!any) throw unmatched(t);
  }
  for (auto& item : model.named_parameters(true)) {
    item.value().set_requires_grad(peft::in_adapter(item.key(), o, targeted));
  }
}

// Every dotted component of the modules under the first decoder layer: the names Freeze's
// trainable_modules can pick (self_attn, q_proj, mlp, input_layernorm, ... in the family's
// spelling).
std::set<std::string> layer_components(CausalLM& model) {
  const std::string prefix = model.config().layer_prefix(0);
  std::set<std::string> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    if (name.rfind(prefix, 0) != 0) continue;
    for (size_t start = prefix.size(); start < name.size();) {
      const size_t dot = std::min(name.find('.', start), name.size());
      out.insert(name.substr(start, dot - start));
      start = dot + 1;
    }
  }
  return out;
}

void apply_freeze(CausalLM& model, const FreezeOptions& o) {
  const int64_t layers = model.config().num_hidden_layers;
  std::vector<int64_t> chosen;
  if (o.module_names.empty()) {
    const int64_t n = std::min<int64_t>(std::abs(o.trainable_layers), layers);
    for (int64_t i = 0; i < n; ++i) chosen.push_back(o.trainable_layers > 0 ? layers - n + i : i);
  }
  const bool all_modules = o.trainable_modules.empty() ||
                           (o.trainable_modules.size() == 1 && o.trainable_modules[0] == "all");
  if (!all_modules) {
    // The names a decoder layer of this model has (its family's): a name it lacks would
    // otherwise leave nothing trained without a word.
    const std::set<std::string> known = layer_components(model);
    for (const std::string& m : o.trainable_modules) {
      if (known.count(m) == 0) {
        throw ConfigError(fmt::format(
            "freeze_trainable_modules: \"{}\" is not a module of this model's decoder layers "
            "({}); use all, or some of: {}",
            m, model.config().model_type, fmt::join(known, ", ")));
      }
    }
  }
  std::vector<std::string> chosen_prefixes;  // made once, not per parameter
  for (int64_t i : chosen) chosen_prefixes.push_back(model.config().layer_prefix(i));
  int64_t trainable = 0;
  for (auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    bool train = false;
    for (const std::string& s : o.module_names) train = train || name.find(s) != std::string::npos;
    for (const std::string& prefix : chosen_prefixes) {
      if (name.rfind(prefix, 0) != 0) continue;
      if (all_modules) {
        train = true;
      } else {
        for (const std::string& m : o.trainable_modules) train = train || has_component(name, m);
      }
    }
    for (const std::string& m : o.extra_modules) train = train || has_component(name, m);
    item.value().set_requires_grad(train);
    if (train) trainable += item.value().numel();
  }
  if (trainable == 0) {
    throw ConfigError(
        "freeze: no parameter is left trainable (check freeze_trainable_layers, "
        "freeze_module_name and freeze_extra_modules against the model's names)");
  }
}

}  // namespace

std::vector<std::string> peft::lora_targets(CausalLM& model, const LoraOptions& o) {
  std::optional<Pattern> pattern;
  if (!o.target_regex.empty()) pattern.emplace(o.target_regex, "lora_target_modules");
  const std::string head = output_layer_path(model.config());
  std::vector<std::string> out;
  for (auto& [path, lin] : projections(model)) {
    const bool router = std::dynamic_pointer_cast<model::MoeRouter>(lin) != nullptr;
    if (is_lora_target(path, o, pattern ? &*pattern : nullptr, head, router)) out.push_back(path);
  }
  return out;
}

PeftConfig peft_config_for(const TrainingArguments& a) {
  PeftConfig c;
  const std::string& t = a.finetuning_type;
  c.type = t == "lora"                          ? FinetuningType::kLora
           : t == "ptuning"                     ? FinetuningType::kPTuning
           : t == "prefix" || t == "ptuning_v2" ? FinetuningType::kPrefix
           : t == "freeze"                      ? FinetuningType::kFreeze
                                                : FinetuningType::kFull;
  c.lora.r = a.lora_r;
  c.lora.alpha = a.lora_alpha;
  c.lora.dropout = a.lora_dropout;
  // A comma list of names, all-linear, or — when it holds regex syntax — a regex.
  const std::string& targets = a.lora_target_modules;
  if (targets.find_first_of("*()[]|\\^$+?{}") != std::string::npos) {
    c.lora.target_regex = targets;
    c.lora.target_modules.clear();
  } else {
    c.lora.target_modules = split_list(targets);
  }
  c.lora.target_parameters = split_list(a.lora_target_parameters);
  if (c.lora.target_modules.empty() && c.lora.target_regex.empty() &&
      c.lora.target_parameters.empty()) {
    throw ConfigError("lora_target_modules: empty (and no lora_target_parameters)");
  }
  c.lora.bias = a.lora_bias;
  c.lora.modules_to_save = split_list(a.lora_modules_to_save);
  c.lora.use_rslora = a.use_rslora;
  c.lora.use_dora = a.use_dora;
  // LLaMA-Factory's pissa_init / pissa_iter as PEFT's init_lora_weights, which may be given
  // itself (the two must then agree).
  const std::string factory = !a.pissa_init        ? "true"
                              : a.pissa_iter == -1 ? "pissa"
                                                   : fmt::format("pissa_niter_{}", a.pissa_iter);
  c.lora.init_lora_weights = factory;
  if (!a.init_lora_weights.empty()) {
    const std::optional<std::string> init = peft::canonical_init(a.init_lora_weights);
    if (!init) {
      throw ConfigError(fmt::format("init_lora_weights: \"{}\" is not supported by zerotrain; {}",
                                    a.init_lora_weights, peft::kInitChoices));
    }
    c.lora.init_lora_weights = *init;
    if (a.pissa_init && c.lora.init_lora_weights != factory) {
      throw ConfigError(fmt::format(
          "init_lora_weights {} contradicts pissa_init with pissa_iter {} ({}); give one of them",
          a.init_lora_weights, a.pissa_iter, factory));
    }
  }
  if (c.type != FinetuningType::kLora) {
    // LoRA's variants: on another method they would be ignored (LLaMA-Factory refuses them too).
    for (const auto& [given, name] :
         {std::pair{a.use_dora, "use_dora"}, std::pair{a.pissa_init, "pissa_init"},
          std::pair{a.pissa_convert, "pissa_convert"},
          std::pair{c.lora.init_lora_weights != "true", "init_lora_weights"}}) {
      if (given) {
        throw ConfigError(
            fmt::format("{}: a LoRA variant, but finetuning_type is {}; use "
                        "--finetuning_type lora or drop {}",
                        name, t, name));
      }
    }
  }
  if (a.pissa_convert && !peft::pissa_iterations(c.lora.init_lora_weights)) {
    throw ConfigError(
        "pissa_convert: converts a PiSSA adapter, but PiSSA is off; add --pissa_init true or "
        "drop pissa_convert");
  }
  if (a.pissa_convert && a.use_dora) {
    throw ConfigError(
        "pissa_convert with use_dora: a DoRA adapter's rescaling does not subtract as PiSSA's "
        "conversion needs (PEFT's conversion is for plain LoRA); drop one of them");
  }
  c.prompt.num_virtual_tokens = a.pre_seq_len.value_or(a.num_virtual_tokens);
  c.prompt.reparameterization = a.encoder_reparameterization_type;
  c.prompt.encoder_hidden_size = a.encoder_hidden_size;
  c.prompt.prefix_projection = a.prefix_projection;
  c.freeze.trainable_layers = a.freeze_trainable_layers;
  c.freeze.trainable_modules = split_list(a.freeze_trainable_modules);
  c.freeze.module_names = split_list(a.freeze_module_name);
  c.freeze.extra_modules = split_list(a.freeze_extra_modules);
  return c;
}

std::string ParameterCount::line() const {
  return fmt::format(
      "trainable params: {} || all params: {} || trainable%: {:.4f}", with_commas(trainable),
      with_commas(all),
      all > 0 ? 100.0 * static_cast<double>(trainable) / static_cast<double>(all) : 0.0);
}

ParameterCount count_parameters(const torch::nn::Module& model) {
  ParameterCount c;
  for (const auto& p : model.parameters(true)) {
    c.all += p.numel();
    if (p.requires_grad()) c.trainable += p.numel();
  }
  // A 4-bit weight counts its values, not its storage bytes (as PEFT counts a 4-bit model's).
  for (const auto& [name, layout] : model::quantized_weights(model)) {
    c.all += layout->numel() - layout->bytes();
  }
  return c;
}

std::string describe_method(const PeftConfig& c, const std::optional<QuantizationConfig>& base,
                            bool continued) {
  switch (c.type) {
    case FinetuningType::kFull:
      return "full fine-tuning";
    case FinetuningType::kFreeze:
      return fmt::format("Freeze: the {} {} layers train",
                         c.freeze.trainable_layers < 0 ? "first" : "last",
                         std::abs(c.freeze.trainable_layers));
    case FinetuningType::kPTuning:
      return fmt::format("P-Tuning: {} virtual tokens through an {} encoder",
                         c.prompt.num_virtual_tokens, c.prompt.reparameterization);
    case FinetuningType::kPrefix:
      return fmt::format("prefix tuning (P-Tuning v2): {} virtual tokens{}",
                         c.prompt.num_virtual_tokens,
                         c.prompt.prefix_projection ? " through a projection" : "");
    case FinetuningType::kLora:
      break;
  }
  const LoraOptions& o = c.lora;
  std::string out = fmt::format("{}{} r{} (alpha {:g})", o.use_dora ? "DoRA" : "LoRA",
                                o.use_rslora ? " with rsLoRA scaling" : "", o.r, o.alpha);
  if (const std::optional<int64_t> niter = peft::pissa_iterations(o.init_lora_weights)) {
    out += *niter < 0 ? ", started by PiSSA (a full SVD)"
                      : fmt::format(", started by PiSSA ({} subspace iterations)", *niter);
  }
  if (!o.target_parameters.empty())
    out += fmt::format(", also on the expert tensors {}", fmt::join(o.target_parameters, ", "));
  if (continued) out += ", continuing a saved adapter";
  if (base) {
    std::string type = base->quant_type;
    std::transform(type.begin(), type.end(), type.begin(), ::toupper);
    out += fmt::format(" over a 4-bit {} base{}", type,
                       base->double_quant ? " (double quantization)" : "");
  } else {
    out += " over a full-precision base";
  }
  return out;
}

bool adapter_starts_as_base(const PeftConfig& c, bool continued) {
  // Adapters off leave a trained bias or a module to save as trained: only a LoRA / DoRA
  // adapter of A and B alone (and DoRA's magnitude, the weight's own norms) falls back to the
  // base, and only a new one whose B starts at zero (not PiSSA's factors over the residual)
  // starts as the base computes.
  return c.type == FinetuningType::kLora && !continued &&
         !peft::pissa_iterations(c.lora.init_lora_weights) && c.lora.bias == "none" &&
         c.lora.modules_to_save.empty();
}

std::string adapter_start_description(const PeftConfig& c, bool continued) {
  if (c.type == FinetuningType::kPTuning || c.type == FinetuningType::kPrefix)
    return "the prompt encoder as it starts";
  if (continued) return "the adapter it continues";
  if (peft::pissa_iterations(c.lora.init_lora_weights))
    return "PiSSA's starting factors over the residual";
  if (c.lora.bias != "none" || !c.lora.modules_to_save.empty())
    return "the adapter, its trained biases and modules_to_save as they start";
  return "the adapter as it starts";
}

ParameterCount apply_peft(CausalLM& model, const PeftConfig& c, uint64_t seed) {
  switch (c.type) {
    case FinetuningType::kFull:
      for (auto& p : model.parameters(true)) p.set_requires_grad(true);
      break;
    case FinetuningType::kLora:
      apply_lora(model, c.lora, seed);
      break;
    case FinetuningType::kFreeze:
      apply_freeze(model, c.freeze);
      break;
    case FinetuningType::kPTuning:
    case FinetuningType::kPrefix: {
      if (c.prompt.num_virtual_tokens < 1) throw ConfigError("num_virtual_tokens: expected >= 1");
      if (c.type == FinetuningType::kPTuning && c.prompt.reparameterization != "MLP" &&
          c.prompt.reparameterization != "LSTM") {
        throw ConfigError(
            fmt::format("encoder_reparameterization_type: expected MLP or LSTM, found \"{}\"",
                        c.prompt.reparameterization));
      }
      check_prompt_fits(model.config(), c.prompt, c.type == FinetuningType::kPrefix);
      freeze_all(model);
      at::manual_seed(seed);  // PyTorch's default inits draw from the global generator
      std::shared_ptr<PromptAdapter> adapter;
      if (c.type == FinetuningType::kPTuning) {
        adapter = std::make_shared<peft::PTuningEncoder>(model.config(), c.prompt);
      } else {
        adapter = std::make_shared<peft::PrefixEncoder>(model.config(), c.prompt);
      }
      const at::Tensor w = model.named_parameters(true).begin()->value();
      adapter->to(w.device(), w.scalar_type());
      model.set_prompt_adapter(adapter);
      break;
    }
  }
  // What no method trains (a router's e_score_correction_bias), whatever it selected.
  for (auto& item : model.named_parameters(true)) {
    if (model::is_fixed_parameter(item.key())) item.value().set_requires_grad(false);
  }
  return count_parameters(model);
}

void merge_lora(CausalLM& model) {
  at::NoGradGuard no_grad;
  for (auto& [path, lin] : projections(model)) {
    if (!lin->adapter || lin->adapter_merged) continue;
    if (lin->quantized) {
      throw InvalidArgument(fmt::format(
          "merge_lora: '{}' has a 4-bit base, which an adapter cannot be folded into in place; "
          "`zerotrain merge` folds it into the full-precision base instead",
          path));
    }
    at::Tensor merged = lin->weight.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    lin->adapter->merge_into(merged);
    lin->weight.copy_(merged);
    lin->adapter_merged = true;
  }
  for (auto& [path, e] : experts_modules(model)) {
    for (size_t i = 0; i < model::MoeExperts::kTensors; ++i) {
      model::MoeExperts::Adapted& a = e->adapted[i];
      if (!a.adapter || a.merged) continue;
      if (e->quantized[i]) {
        throw InvalidArgument(fmt::format(
            "merge_lora: '{}.{}' is 4-bit, which an adapter cannot be folded into in place; "
            "`zerotrain merge` folds it into the full-precision base instead",
            path, model::MoeExperts::kNames[i]));
      }
      at::Tensor merged = e->tensor(i).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      at::Tensor as_out_in = e->transposed ? merged.transpose(1, 2) : merged;  // a view
      a.adapter->merge_into(as_out_in);
      e->tensor(i).copy_(merged);
      a.merged = true;
    }
  }
}

void unmerge_lora(CausalLM& model) {
  at::NoGradGuard no_grad;
  for (auto& [path, lin] : projections(model)) {
    if (!lin->adapter || !lin->adapter_merged) continue;
    at::Tensor weight = lin->weight.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    lin->adapter->unmerge_from(weight);
    lin->weight.copy_(weight);
    lin->adapter_merged = false;
  }
  for (auto& [path, e] : experts_modules(model)) {
    for (size_t i = 0; i < model::MoeExperts::kTensors; ++i) {
      model::MoeExperts::Adapted& a = e->adapted[i];
      if (!a.adapter || !a.merged) continue;
      at::Tensor weight = e->tensor(i).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      at::Tensor as_out_in = e->transposed ? weight.transpose(1, 2) : weight;  // a view
      a.adapter->unmerge_from(as_out_in);
      e->tensor(i).copy_(weight);
      a.merged = false;
    }
  }
}

namespace {

class AdapterOverlay final : public ParameterSource {
 public:
  AdapterOverlay(std::shared_ptr<ParameterSource> base, torch::nn::Module& model)
      : base_(std::move(base)) {
    for (const auto& item : model.named_parameters(true)) own_[item.key()] = item.value();
  }
  bool has(const std::string& name) const override {
    return base_->has(name) || own_.count(name) != 0;
  }
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    if (base_->has(name)) return base_->read(name, shape, offset, out);
    auto it = own_.find(name);
    if (it == own_.end() || !it->second.is_contiguous()) {
      throw IoError(
          fmt::format("no values for parameter '{}': neither the checkpoint nor the "
                      "model holds it",
                      name));
    }
    out.view({-1}).copy_(it->second.detach().reshape({-1}).narrow(0, offset, out.numel()));
  }

 private:
  std::shared_ptr<ParameterSource> base_;
  std::map<std::string, at::Tensor> own_;
};

}  // namespace

std::shared_ptr<ParameterSource> with_adapter_values(std::shared_ptr<ParameterSource> base,
                                                     torch::nn::Module& model) {
  return std::make_shared<AdapterOverlay>(std::move(base), model);
}

}  // namespace zt
