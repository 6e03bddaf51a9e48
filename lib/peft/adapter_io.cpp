// PEFT's adapter files: adapter_config.json + adapter_model.safetensors, and merged exports.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "model/layers.hpp"
#include "peft/adapter_io.hpp"
#include "peft/fused_experts.hpp"
#include "peft/linear_adapters.hpp"
#include "peft/lora_config.hpp"
#include "peft/lora_targets.hpp"
#include "peft/prompt_encoders.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {
namespace {

constexpr const char* kPrefix = peft::kAdapterKeyPrefix;
/// ChatGLM's P-Tuning v2 prefix encoder, beside PEFT's files (docs/peft.md).
constexpr const char* kChatGlmPrefixFile = "prefix_encoder.safetensors";

using Writer = peft::JsonWriter;

void key_string(Writer& w, const char* k, const std::string& v) {
  w.Key(k);
  if (v.empty()) {
    w.Null();
  } else {
    w.String(v.c_str());
  }
}

// PEFT's names for a module's own parameters once LoRA wraps it: "X.bias" becomes
// "X.base_layer.bias" (the wrapped layer), which is the key PEFT saves and loads.
std::string peft_key(const std::string& name, const std::set<std::string>& wrapped) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || peft::is_adapter_parameter(name) ||
      !wrapped.count(name.substr(0, dot)))
    return kPrefix + name;
  return kPrefix + name.substr(0, dot) + ".base_layer" + name.substr(dot);
}

// The model's name for a stored key: the prefix dropped, and "X.base_layer.bias" read as "X.bias".
std::string model_name(const std::string& key) {
  std::string name = key.substr(std::string(kPrefix).size());
  const size_t at = name.rfind(".base_layer.");
  if (at != std::string::npos && name.find('.', at + 12) == std::string::npos) name.erase(at, 11);
  return name;
}

std::string adapter_config_json(CausalLM& model, const PeftConfig& c) {
  const ModelConfig& m = model.config();
  rapidjson::StringBuffer buffer;
  Writer w(buffer);
  w.SetIndent(' ', 2);
  w.StartObject();
  key_string(w, "base_model_name_or_path", c.base_model_name_or_path);
  w.Key("task_type");
  w.String("CAUSAL_LM");
  w.Key("inference_mode");
  w.Bool(true);
  w.Key("revision");
  w.Null();
  if (c.type == FinetuningType::kLora) {
    peft::write_lora_config(w, model, c.lora);
  } else {
    const bool prefix = c.type == FinetuningType::kPrefix;
    w.Key("peft_type");
    w.String(prefix ? "PREFIX_TUNING" : "P_TUNING");
    w.Key("num_virtual_tokens");
    w.Int64(c.prompt.num_virtual_tokens);
    w.Key("token_dim");
    w.Int64(prefix ? m.kv_dim() : m.hidden_size);
    w.Key("num_transformer_submodules");
    w.Int64(1);
    w.Key("num_attention_heads");
    w.Int64(prefix ? m.num_key_value_heads : m.num_attention_heads);
    w.Key("num_layers");
    w.Int64(m.num_hidden_layers);
    w.Key("encoder_hidden_size");
    w.Int64(c.prompt.encoder_hidden_size > 0 ? c.prompt.encoder_hidden_size : m.hidden_size);
    if (prefix) {
      w.Key("prefix_projection");
      w.Bool(c.prompt.prefix_projection);
    } else {
      w.Key("encoder_reparameterization_type");
      w.String(c.prompt.reparameterization.c_str());
      w.Key("encoder_num_layers");
      w.Int64(c.prompt.encoder_num_layers);
      w.Key("encoder_dropout");
      w.Double(0.0);
    }
  }
  w.EndObject();
  return buffer.GetString();
}

// ChatGLM's own P-Tuning v2 files: the prefix encoder's parameters under the names its
// modeling code gives them, which ChatGLM's scripts load into model.transformer.prefix_encoder.
std::vector<std::pair<std::string, at::Tensor>> chatglm_prefix_tensors(peft::PrefixEncoder& p) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : p.named_parameters(true)) {
    out.emplace_back("transformer.prefix_encoder." + item.key(),
                     item.value().detach().to(at::kCPU, at::kFloat).contiguous());
  }
  return out;
}

}  // namespace

void save_adapter(CausalLM& model, const PeftConfig& c, const std::string& dir,
                  const std::vector<std::pair<std::string, at::Tensor>>& values) {
  if (c.type == FinetuningType::kFull || c.type == FinetuningType::kFreeze) {
    throw InvalidArgument(
        "save_adapter: full and freeze fine-tuning have no adapter; export the "
        "model instead");
  }
  std::map<std::string, at::Tensor> given(values.begin(), values.end());
  auto value_of = [&](const std::string& name, const at::Tensor& own) {
    auto it = given.find(name);
    at::Tensor v = it != given.end() ? it->second : own;
    if (!v.defined() || v.numel() == 0 || !v.is_contiguous()) {
      throw InvalidArgument(fmt::format(
          "save_adapter: no values for '{}' (under ZeRO-3 pass Engine::gather_full_parameters())",
          name));
    }
    return v.detach().to(at::kCPU).contiguous();
  };
  std::vector<std::pair<std::string, at::Tensor>> tensors, chatglm_prefix;
  if (c.type == FinetuningType::kLora) {
    std::set<std::string> wrapped;  // the modules LoRA adapts
    for (const auto& item : model.named_parameters(true)) {
      const size_t at = item.key().find(".lora_A.");
      if (at != std::string::npos) wrapped.insert(item.key().substr(0, at));
    }
    const std::vector<std::string> wrapped_list(wrapped.begin(), wrapped.end());
    for (const auto& item : model.named_parameters(true)) {
      const std::string& name = item.key();
      // By the config, not requires_grad: an adapter loaded for inference saves the same files.
      if (!peft::in_adapter(name, c.lora, wrapped_list)) continue;
      tensors.emplace_back(peft_key(name, wrapped), value_of(name, item.value()));
    }
  } else {
    PromptAdapter* prompt = model.prompt_adapter();
    if (prompt == nullptr) throw InvalidArgument("save_adapter: the model has no prompt adapter");
    at::NoGradGuard no_grad;
    at::Tensor table;
    if (auto* p = dynamic_cast<peft::PrefixEncoder*>(prompt)) {
      table = p->encode();
    } else if (auto* f = dynamic_cast<peft::FixedPrompt*>(prompt)) {
      table = f->named_parameters(false)["prompt_embeddings"];
    } else {
      table = prompt->virtual_embeddings();
    }
    tensors.emplace_back("prompt_embeddings", table.to(at::kCPU, at::kFloat).contiguous());
    if (auto* p = dynamic_cast<peft::PrefixEncoder*>(prompt); p && p->chatglm()) {
      chatglm_prefix = chatglm_prefix_tensors(*p);
    }
  }
  std::filesystem::create_directories(dir);
  if (!chatglm_prefix.empty()) save_safetensors(dir + "/" + kChatGlmPrefixFile, chatglm_prefix);
  save_safetensors(dir + "/adapter_model.safetensors", tensors);
  files::write_atomic(dir + "/adapter_config.json", adapter_config_json(model, c) + "\n");
}

PeftConfig load_adapter_config(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  rapidjson::Document doc = json::parse(files::read_text(path, "adapter config"), path);
  json::ObjectReader r(doc, "", path);
  PeftConfig c;
  std::optional<std::string> type = r.string("peft_type");
  if (!type) r.fail("peft_type", "LORA, P_TUNING or PREFIX_TUNING");
  if (*type == "LORA") {
    c.type = FinetuningType::kLora;
  } else if (*type == "P_TUNING") {
    c.type = FinetuningType::kPTuning;
  } else if (*type == "PREFIX_TUNING") {
    c.type = FinetuningType::kPrefix;
  } else {
    r.fail_value("peft_type", fmt::format("\"{}\" adapters are not supported; supported: LORA, "
                                          "P_TUNING, PREFIX_TUNING",
                                          *type));
  }
  if (auto t = r.string("task_type"); t && *t != "CAUSAL_LM") {
    r.fail_value("task_type", fmt::format("\"{}\" is not a causal LM adapter", *t));
  }
  if (auto b = r.string("base_model_name_or_path")) c.base_model_name_or_path = *b;
  if (c.type == FinetuningType::kLora) {
    peft::read_lora_config(r, c.lora);
  } else {
    if (auto v = r.integer("num_virtual_tokens", 1)) c.prompt.num_virtual_tokens = *v;
    if (auto v = r.integer("encoder_hidden_size", 0)) c.prompt.encoder_hidden_size = *v;
    if (auto v = r.string("encoder_reparameterization_type")) c.prompt.reparameterization = *v;
    if (auto v = r.integer("encoder_num_layers", 1)) c.prompt.encoder_num_layers = *v;
    if (auto v = r.boolean("prefix_projection")) c.prompt.prefix_projection = *v;
  }
  return c;
}

std::string adapter_base_model(const std::string& adapter_dir, const std::string& override) {
  std::string base = override;
  if (base.empty()) {
    base = load_adapter_config(adapter_dir).base_model_name_or_path;
    if (base.empty()) {
      throw ConfigError(
          fmt::format("the adapter in '{}' names no base model (base_model_name_or_path); pass "
                      "--base_model DIR",
                      adapter_dir));
    }
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(base, ec)) {
    throw ConfigError(fmt::format(
        "the base model of the adapter in '{}' is '{}', which is not a folder{}; pass --base_model "
        "DIR",
        adapter_dir, base,
        override.empty()
            ? " (as PEFT does, a relative base_model_name_or_path is taken from the current "
              "directory; a hub id needs a local download)"
            : ""));
  }
  return base;
}

namespace {

// The stored keys of an adapter file by the model's parameter names (both of PEFT's spellings
// of a wrapped layer's bias read).
std::map<std::string, std::string> keys_by_name(const SafetensorsFile& file) {
  std::map<std::string, std::string> out;
  for (const std::string& key : file.names()) {
    if (key.rfind(kPrefix, 0) != 0 || !out.emplace(model_name(key), key).second) {
      throw IoError(fmt::format(
          "'{}' holds tensor '{}', which has no place in this model{}", file.path(), key,
          key.rfind(kPrefix, 0) != 0 ? " (PEFT's keys start with base_model.model.)"
                                     : " (its parameter is stored twice)"));
    }
  }
  return out;
}

// Adapter weights are floating point; integers or booleans mean another kind of file.
void check_floating(const SafetensorsFile& file, const std::string& key) {
  if (!at::isFloatingType(file.info(key).dtype)) {
    throw IoError(fmt::format("'{}': tensor '{}' is {}, but adapter weights are floating point",
                              file.path(), key, file.info(key).dtype_name));
  }
}

// What load_adapter and merge refuse alike: a stored tensor that `has` (the model's parameters,
// adapters applied) does not name would otherwise be passed over without a word.
void check_places(const std::string& file, const std::map<std::string, std::string>& keys,
                  const std::function<bool(const std::string&)>& has) {
  for (const auto& [name, key] : keys) {
    if (!has(name)) {
      throw IoError(
          fmt::format("'{}' holds tensor '{}', which has no place in this model "
                      "(a different base model?)",
                      file, key));
    }
  }
}

class AdapterSource final : public ParameterSource {
 public:
  explicit AdapterSource(const std::string& dir)
      : file_(dir + "/adapter_model.safetensors"), keys_(keys_by_name(file_)) {}
  bool has(const std::string& name) const override { return keys_.count(name) != 0; }
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    auto it = keys_.find(name);
    if (it == keys_.end() || file_.info(it->second).shape != shape) {
      throw IoError(fmt::format("'{}' has no tensor '{}' of shape [{}]", file_.path(),
                                it == keys_.end() ? kPrefix + name : it->second,
                                fmt::join(shape, ", ")));
    }
    check_floating(file_, it->second);
    file_.read_range(it->second, offset, out);
  }

 private:
  SafetensorsFile file_;
  std::map<std::string, std::string> keys_;
};

}  // namespace

std::shared_ptr<ParameterSource> adapter_source(const std::string& adapter_dir) {
  return std::make_shared<AdapterSource>(adapter_dir);
}

void peft::check_adapter_places(const ModelConfig& config, const std::string& dir,
                                const PeftConfig& c) {
  CausalLM placeholder(config, at::TensorOptions().dtype(at::kFloat), /*allocate=*/false);
  apply_peft(placeholder, c, 0);
  std::set<std::string> names;
  for (const auto& item : placeholder.named_parameters(true)) names.insert(item.key());
  const std::string file = dir + "/adapter_model.safetensors";
  const SafetensorsFile st(file);
  check_places(file, keys_by_name(st),
               [&](const std::string& name) { return names.count(name) != 0; });
}

ParameterCount load_adapter(CausalLM& model, const std::string& dir, bool trainable) {
  return peft::load_adapter_as(model, dir, load_adapter_config(dir), trainable);
}

ParameterCount peft::load_adapter_as(CausalLM& model, const std::string& dir, const PeftConfig& c,
                                     bool trainable) {
  const std::string file = dir + "/adapter_model.safetensors";
  SafetensorsFile st(file);
  const ModelConfig& m = model.config();
  if (c.type == FinetuningType::kLora) {
    apply_peft(model, c, 0);
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> params;
    for (const auto& item : model.named_parameters(true)) params[item.key()] = item.value();
    const std::map<std::string, std::string> keys = keys_by_name(st);
    check_places(file, keys, [&](const std::string& name) { return params.count(name) != 0; });
    for (auto& [name, p] : params) {
      const bool lora = peft::is_adapter_parameter(name);
      if (!lora && !p.requires_grad()) continue;  // a frozen base weight
      // LoRA weights, and the biases and modules_to_save the config makes trainable.
      p.set_requires_grad(trainable);
      auto found = keys.find(name);
      if (found == keys.end()) {
        if (!lora) continue;  // a trainable bias or saved module the adapter did not store
        throw IoError(fmt::format("'{}' lacks '{}', which its adapter_config.json implies", file,
                                  kPrefix + name));
      }
      const std::string& key = found->second;
      if (st.info(key).shape != p.sizes().vec()) {
        throw IoError(fmt::format(
            "'{}': '{}' has shape [{}] but this model needs [{}] (a different "
            "base model or rank?)",
            file, key, fmt::join(st.info(key).shape, ", "), fmt::join(p.sizes(), ", ")));
      }
      check_floating(st, key);
      if (!p.is_contiguous()) p.set_data(at::empty(p.sizes(), p.options()));
      p.copy_(st.load(key));
    }
  } else {
    const bool prefix = c.type == FinetuningType::kPrefix;
    at::Tensor table = st.load("prompt_embeddings");
    const int64_t width = prefix ? m.num_hidden_layers * 2 * m.kv_dim() : m.hidden_size;
    if (table.dim() != 2 || table.size(0) != c.prompt.num_virtual_tokens ||
        table.size(1) != width) {
      throw IoError(
          fmt::format("'{}': prompt_embeddings has shape [{}] but this model needs [{}, {}]", file,
                      fmt::join(table.sizes(), ", "), c.prompt.num_virtual_tokens, width));
    }
    for (auto& p : model.parameters(true)) p.set_requires_grad(false);
    const at::Tensor w = model.named_parameters(true).begin()->value();
    auto adapter =
        std::make_shared<peft::FixedPrompt>(m, table.to(w.device(), w.scalar_type()), prefix);
    for (auto& p : adapter->parameters()) p.set_requires_grad(trainable);
    model.set_prompt_adapter(adapter);
  }
  return count_parameters(model);
}

ParameterCount apply_peft_from_args(CausalLM& model, const TrainingArguments& args, uint64_t seed) {
  const std::string& dir = args.adapter_name_or_path;
  if (dir.empty()) return apply_peft(model, peft_config_for(args), seed);
  if (args.finetuning_type != "lora") {
    throw ConfigError(fmt::format(
        "adapter_name_or_path '{}' continues a LoRA adapter, but finetuning_type is {}; use "
        "--finetuning_type lora (P-Tuning and prefix adapters resume from zerotrain checkpoints, "
        "which keep the prompt encoder)",
        dir, args.finetuning_type));
  }
  PeftConfig saved = load_adapter_config(dir);
  if (saved.type != FinetuningType::kLora) {
    throw ConfigError(
        fmt::format("adapter_name_or_path '{}' holds a prompt adapter, not LoRA; "
                    "resume P-Tuning / prefix tuning from a zerotrain checkpoint",
                    dir));
  }
  auto agree = [&](const char* option, bool same, const std::string& ours,
                   const std::string& theirs) {
    if (args.is_given(option) && !same) {
      throw ConfigError(
          fmt::format("{} {} contradicts the adapter in '{}' ({}); drop the option "
                      "or start a new adapter",
                      option, ours, dir, theirs));
    }
  };
  // What the arguments ask for, through the one conversion of the flat options; both sides as
  // PEFT reads them for this model (its fused experts' names converted).
  const LoraOptions ours = peft::converted_for_fused_experts(model, peft_config_for(args).lora);
  saved.lora = peft::converted_for_fused_experts(model, saved.lora);
  agree("lora_r", ours.r == saved.lora.r, std::to_string(ours.r),
        fmt::format("r {}", saved.lora.r));
  agree("lora_alpha", ours.alpha == saved.lora.alpha, fmt::format("{}", ours.alpha),
        fmt::format("lora_alpha {}", saved.lora.alpha));
  agree("use_rslora", ours.use_rslora == saved.lora.use_rslora, ours.use_rslora ? "true" : "false",
        fmt::format("use_rslora {}", saved.lora.use_rslora));
  agree("lora_dropout", ours.dropout == saved.lora.dropout, fmt::format("{}", ours.dropout),
        fmt::format("lora_dropout {}", saved.lora.dropout));
  auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  agree("lora_target_parameters",
        sorted(ours.target_parameters) == sorted(saved.lora.target_parameters),
        args.lora_target_parameters,
        fmt::format("target_parameters [{}]", fmt::join(saved.lora.target_parameters, ", ")));
  if (args.is_given("lora_target_modules")) {
    // Compared by the projections they pick: PEFT writes all-linear out as module paths.
    const std::vector<std::string> asked = peft::lora_targets(model, ours);
    const std::vector<std::string> theirs = peft::lora_targets(model, saved.lora);
    agree("lora_target_modules", asked == theirs, args.lora_target_modules,
          fmt::format("it adapts {} projections: {}", theirs.size(), fmt::join(theirs, ", ")));
  }
  return load_adapter(model, dir, /*trainable=*/true);
}

void export_merged(CausalLM& model, const std::string& dir, at::ScalarType dtype) {
  merge_lora(model);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  try {
    for (const auto& item : model.named_parameters(true)) {
      const std::string& name = item.key();
      if (peft::is_adapter_parameter(name) || name.rfind("prompt_encoder.", 0) == 0) continue;
      // A copy: unmerging below changes the parameters in place.
      tensors.emplace_back(
          name, item.value().detach().to(at::kCPU, dtype, false, /*copy=*/true).contiguous());
    }
  } catch (...) {
    unmerge_lora(model);
    throw;
  }
  unmerge_lora(model);
  std::filesystem::create_directories(dir);
  save_sharded_safetensors(dir, tensors);
  ModelConfig c = model.config();
  c.dtype = dtype;
  files::write_atomic(dir + "/config.json", model_config_json(c) + "\n");
}

}  // namespace zt
