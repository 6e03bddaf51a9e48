// The Linear adapter methods' registration (linear_adapters.hpp): LoRA / rsLoRA and DoRA, each
// started as PEFT starts it (PiSSA included).
#include "peft/linear_adapters.hpp"

#include <fmt/format.h>

#include "peft/dora.hpp"
#include "peft/lora.hpp"
#include "peft/pissa.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {
namespace {

at::Tensor own(model::Linear& lin, const std::string& name) {
  return lin.named_parameters(/*recurse=*/true)[name];
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

void attach_adapter(const std::string& path, model::Linear& lin, const LoraOptions& given,
                    uint64_t seed) {
  const LoraOptions options = given.at(path);  // its own rank and alpha
  if (lin.adapter) throw InvalidArgument(fmt::format("'{}' already has a LoRA adapter", path));
  if (options.use_dora) {
    lin.adapter = std::make_shared<DoraAdapter>(path, lin, options, seed);
  } else {
    lin.adapter = std::make_shared<LoraAdapter>(path, lin, options, seed);
  }
  if (!lin.holds_values()) return;  // the engine's source gives the starts (init_sources.hpp)
  at::NoGradGuard no_grad;
  const at::ScalarType dtype = lin.value_options().dtype().toScalarType();
  if (const std::optional<int64_t> niter = pissa_iterations(options.init_lora_weights)) {
    if (lin.quantized) {
      throw ConfigError(fmt::format(
          "PiSSA: '{}' has a 4-bit base; PiSSA decomposes the full-precision weight (the "
          "trainer does so before quantizing the residual)",
          path));
    }
    const PissaFactors f =
        pissa_factors(lin.weight, options.r, options.scaling(), *niter, generator_for(seed, path));
    own(lin, "lora_A.weight").copy_(f.lora_A);
    own(lin, "lora_B.weight").copy_(f.lora_B);
    lin.weight.copy_(f.residual);
  }
  if (options.use_dora) {
    own(lin, "lora_magnitude_vector")
        .copy_(dora_weight_norm(lin.dense_weight(dtype), own(lin, "lora_A.weight"),
                                own(lin, "lora_B.weight"), options.scaling()));
  }
}

bool is_adapter_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos ||
         ends_with(name, ".lora_magnitude_vector");
}

bool fold_trained_adapter(const LoraOptions& given, const std::string& module, at::Tensor& weight,
                          const std::function<bool(const std::string&)>& has,
                          const TensorReader& read) {
  const std::string a_name = module + ".lora_A.weight", b_name = module + ".lora_B.weight";
  if (!has(a_name)) return false;
  const LoraOptions options = given.at(module);
  at::Tensor a = at::empty({options.r, weight.size(1)}, at::kFloat);
  at::Tensor b = at::empty({weight.size(0), options.r}, at::kFloat);
  read(a_name, a);
  read(b_name, b);
  if (options.use_dora) {
    at::Tensor m = at::empty({weight.size(0)}, at::kFloat);
    read(magnitude_name(module), m);
    dora_merge(weight, a, b, m, options.scaling());
  } else {
    add_lora_delta(weight, a, b, options.scaling());  // in place: merge holds one tensor at a time
  }
  return true;
}

}  // namespace zt::peft
