// A run's trained model rebuilt from its folder as the run trained it, and the model it started
// from (checkpoint.hpp: load_trained_model).
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/run_settings.hpp"
#include "model/quantized_weights.hpp"
#include "peft/adapter_io.hpp"
#include "peft/init_sources.hpp"
#include "peft/pissa.hpp"
#include "peft/prompt_encoders.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/peft.hpp"

namespace zt {
namespace fs = std::filesystem;

namespace {

bool is_factor(const std::string& name) {
  for (const char* part : {".lora_A.", ".lora_B.", ".lora_magnitude_vector"}) {
    if (name.find(part) != std::string::npos) return true;
  }
  return false;
}

// The trainable values of `model` (those its adapter folder `dir` holds) as `source` gives
// them, where `take(name)` says which; the rest of what the adapter trains is left out.
std::vector<std::pair<std::string, at::Tensor>> values_from(
    CausalLM& model, ParameterSource& source, ParameterSource& adapter,
    const std::function<bool(const std::string&)>& take) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    if (!adapter.has(name) || !take(name)) continue;
    if (!source.has(name)) {
      throw IoError(fmt::format("the start of '{}' is not known: its source has no value", name));
    }
    at::Tensor value = at::empty(item.value().sizes(), item.value().options());
    source.read(name, item.value().sizes().vec(), 0, value);
    out.emplace_back(name, value);
  }
  return out;
}

// A prompt adapter's first virtual tokens: its encoder as the run built it (the recorded seed),
// as save_adapter writes the table.
at::Tensor first_prompt_table(const ModelConfig& config, const PeftConfig& peft, int64_t seed) {
  CausalLM scratch(config, at::TensorOptions().dtype(at::kFloat), /*allocate=*/false);
  apply_peft(scratch, peft, static_cast<uint64_t>(seed));
  at::NoGradGuard no_grad;
  PromptAdapter* prompt = scratch.prompt_adapter();
  if (auto* p = dynamic_cast<peft::PrefixEncoder*>(prompt)) return p->encode().to(at::kFloat);
  return prompt->virtual_embeddings().to(at::kFloat);
}

}  // namespace

void swap_parameter_values(torch::nn::Module& model,
                           std::vector<std::pair<std::string, at::Tensor>>& values) {
  at::NoGradGuard no_grad;
  auto params = model.named_parameters(true);
  for (auto& [name, value] : values) {
    at::Tensor* p = params.find(name);
    if (p == nullptr || p->sizes() != value.sizes()) {
      throw InvalidArgument(
          fmt::format("swap_parameter_values: the model has no parameter '{}' of shape [{}]", name,
                      fmt::join(value.sizes(), ", ")));
    }
    const at::Tensor held = p->detach().clone();
    p->copy_(value);
    value = held.to(value.options());
  }
}

TrainedModel load_trained_model(const std::string& dir, const std::string& base_model) {
  TrainedModel out;
  std::error_code ec;
  out.adapter = fs::is_regular_file(dir + "/adapter_config.json", ec);
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat);
  if (!out.adapter) {
    out.base_dir = dir;
    out.model = std::make_shared<CausalLM>(load_model_config(dir), fp32, /*allocate=*/false);
    load_weights(*out.model, *checkpoint_source(dir));
    out.model->eval();
    out.start_description = "a whole model: its start is not in the folder";
    return out;
  }
  out.base_dir = adapter_base_model(dir, base_model);
  const ModelConfig config = load_model_config(out.base_dir);
  const PeftConfig peft = load_adapter_config(dir);
  const checkpoint::RunSettings run = checkpoint::run_settings(dir);
  const bool lora = peft.type == FinetuningType::kLora;
  const bool pissa = lora && peft::pissa_iterations(peft.lora.init_lora_weights).has_value();
  const std::string pissa_dir = pissa ? checkpoint::pissa_start_dir(dir) : "";
  if (lora) out.quantization = run.quantization;
  out.model = std::make_shared<CausalLM>(config, fp32, /*allocate=*/false);
  CausalLM& model = *out.model;
  // PiSSA's base is the residual its saved factors leave (else decomposed again as the run did:
  // its seed, the CPU), quantized when the run's base was.
  std::shared_ptr<ParameterSource> start_factors;
  model::SourceWrap residual;
  if (pissa) {
    residual = [&](std::shared_ptr<ParameterSource> dense) {
      start_factors = pissa_dir.empty()
                          ? peft::pissa_source(std::move(dense), model, peft.lora,
                                               static_cast<uint64_t>(run.seed), at::kCPU,
                                               /*factors=*/true)
                          : peft::pissa_start_source(std::move(dense), model, peft.lora, pissa_dir);
      return start_factors;
    };
  }
  const std::shared_ptr<ParameterSource> base =
      model::merge_base_source(out.base_dir, config, out.quantization, residual);
  if (pissa && !start_factors) {
    throw InvalidArgument(fmt::format("load_trained_model: '{}': PiSSA's base was not built", dir));
  }
  load_weights(model, *base);
  PeftConfig applied = peft;
  if (pissa) applied.lora.init_lora_weights = "true";  // the base holds the residual already
  peft::load_adapter_as(model, dir, applied, /*trainable=*/false);
  model.eval();

  // The start.
  if (!lora) {
    for (const auto& item : model.named_parameters(true)) {
      if (item.key().find("prompt_embeddings") == std::string::npos) continue;
      out.start.emplace_back(item.key(), first_prompt_table(config, peft, run.seed));
    }
    out.start_description =
        fmt::format("its first virtual tokens (the encoder as seed {} builds it)", run.seed);
    return out;
  }
  const std::shared_ptr<ParameterSource> adapter = adapter_source(dir);
  const std::string& continued = run.adapter_name_or_path;
  if (!continued.empty() && fs::is_regular_file(continued + "/adapter_model.safetensors", ec)) {
    const std::shared_ptr<ParameterSource> from = adapter_source(continued);
    out.start = values_from(model, *from, *adapter, [](const std::string&) { return true; });
    out.start_description = fmt::format("the adapter it continued ('{}')", continued);
    return out;
  }
  // Trained biases and modules to save start as the base has them.
  out.start =
      values_from(model, *base, *adapter, [](const std::string& name) { return !is_factor(name); });
  if (pissa) {
    auto factors = values_from(model, *start_factors, *adapter, is_factor);
    out.start.insert(out.start.end(), factors.begin(), factors.end());
    out.start_description =
        pissa_dir.empty()
            ? fmt::format(
                  "PiSSA's starting factors, decomposed again with the run's seed {} "
                  "(no pissa_init/ folder beside it)",
                  run.seed)
            : fmt::format("PiSSA's starting factors, as the run saved them in '{}'", pissa_dir);
    return out;
  }
  out.start_adapters_off = true;
  out.start_description =
      !continued.empty()
          ? fmt::format(
                "the base with its adapters off: the adapter the run continued, '{}', "
                "is not there",
                continued)
          : "the base (adapters off)";
  return out;
}

}  // namespace zt
