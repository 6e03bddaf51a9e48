// The Linear adapter methods' registration (linear_adapters.hpp): LoRA / rsLoRA today.
#include "peft/linear_adapters.hpp"

#include <fmt/format.h>

#include "peft/lora.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {

void attach_adapter(const std::string& path, model::Linear& lin, const LoraOptions& options,
                    uint64_t seed) {
  if (lin.adapter) throw InvalidArgument(fmt::format("'{}' already has a LoRA adapter", path));
  lin.adapter = std::make_shared<LoraAdapter>(path, lin, options, seed);
}

bool is_adapter_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

bool fold_trained_adapter(const LoraOptions& options, const std::string& module, at::Tensor& weight,
                          const std::function<bool(const std::string&)>& has,
                          const TensorReader& read) {
  const std::string a_name = module + ".lora_A.weight", b_name = module + ".lora_B.weight";
  if (!has(a_name)) return false;
  at::Tensor a = at::empty({options.r, weight.size(1)}, at::kFloat);
  at::Tensor b = at::empty({weight.size(0), options.r}, at::kFloat);
  read(a_name, a);
  read(b_name, b);
  add_lora_delta(weight, a, b, options.scaling());  // in place: merge holds one tensor at a time
  return true;
}

}  // namespace zt::peft
