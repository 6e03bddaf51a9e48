// PiSSA's and DoRA's starts for a model the engine loads from a source (init_sources.hpp).
#include "peft/init_sources.hpp"

#include <map>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/layers.hpp"
#include "peft/dora.hpp"
#include "peft/fused_experts.hpp"
#include "peft/linear_adapters.hpp"
#include "peft/lora.hpp"
#include "peft/lora_targets.hpp"
#include "peft/pissa.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::peft {
namespace {

using Targets = std::map<std::string, std::shared_ptr<model::Linear>>;

Targets targets_of(CausalLM& model, const LoraOptions& o) {
  Targets out;
  auto modules = model.named_modules("", /*include_self=*/false);
  for (const std::string& path : lora_targets(model, converted_for_fused_experts(model, o))) {
    out[path] = std::dynamic_pointer_cast<model::Linear>(modules[path]);
  }
  return out;
}

// The target module `name` is parameter `leaf` of ("" when none).
std::string module_of(const Targets& targets, const std::string& name, const std::string& leaf) {
  const std::string tail = "." + leaf;
  if (name.size() <= tail.size() || name.compare(name.size() - tail.size(), tail.size(), tail))
    return "";
  std::string module = name.substr(0, name.size() - tail.size());
  return targets.count(module) ? module : "";
}

// Elements [offset, offset + out.numel()) of `whole` into `out`.
void copy_range(const std::string& name, const at::Tensor& whole, int64_t offset,
                const at::Tensor& out) {
  if (offset < 0 || offset + out.numel() > whole.numel()) {
    throw InvalidArgument(fmt::format("'{}': values [{}, {}) asked of {}", name, offset,
                                      offset + out.numel(), whole.numel()));
  }
  out.view({-1}).copy_(whole.reshape({-1}).narrow(0, offset, out.numel()));
}

at::Tensor read_whole(ParameterSource& source, const std::string& name,
                      const std::vector<int64_t>& shape, at::ScalarType dtype) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  source.read(name, shape, 0, t);
  return t;
}

class PissaSource final : public ParameterSource {
 public:
  PissaSource(std::shared_ptr<ParameterSource> base, Targets targets, const LoraOptions& o,
              int64_t niter, uint64_t seed, c10::Device device, bool factors,
              std::unique_ptr<SafetensorsFile> start = nullptr)
      : base_(std::move(base)),
        targets_(std::move(targets)),
        r_(o.r),
        scaling_(o.scaling()),
        niter_(niter),
        seed_(seed),
        device_(device),
        factors_(factors),
        start_(std::move(start)) {}

  bool has(const std::string& name) const override {
    if (factors_ && (!module_of(targets_, name, "lora_A.weight").empty() ||
                     !module_of(targets_, name, "lora_B.weight").empty())) {
      return true;
    }
    return base_->has(name);
  }

  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    for (const char* leaf : {"weight", "lora_A.weight", "lora_B.weight"}) {
      const std::string module = module_of(targets_, name, leaf);
      if (module.empty() || (!factors_ && leaf != std::string("weight"))) continue;
      const PissaFactors& f = factors_of(module);
      const at::Tensor& whole = leaf == std::string("weight")          ? f.residual
                                : leaf == std::string("lora_A.weight") ? f.lora_A
                                                                       : f.lora_B;
      copy_range(name, whole, offset, out);
      return;
    }
    base_->read(name, shape, offset, out);
  }

 private:
  const PissaFactors& factors_of(const std::string& module) {
    if (module != cached_module_) {
      cached_module_.clear();
      const model::Linear& lin = *targets_.at(module);
      const at::Tensor w =
          read_whole(*base_, module + ".weight", {lin.out_features, lin.in_features}, at::kFloat);
      PissaFactors f;
      if (start_) {
        // The factors the run started from, as it saved them: the residual is what they leave
        // of the weight, computed as pissa_factors computes it.
        f.lora_A = saved_factor(module + ".lora_A.weight", {r_, lin.in_features});
        f.lora_B = saved_factor(module + ".lora_B.weight", {lin.out_features, r_});
        f.residual = w.to(device_) - at::mm(f.lora_B.to(device_) * scaling_, f.lora_A.to(device_));
      } else {
        f = pissa_factors(w.to(device_), r_, scaling_, niter_, generator_for(seed_, module));
      }
      cached_ = {f.lora_A.cpu(), f.lora_B.cpu(), f.residual.cpu()};
      cached_module_ = module;
    }
    return cached_;
  }

  at::Tensor saved_factor(const std::string& name, const std::vector<int64_t>& shape) const {
    const std::string key = kAdapterKeyPrefix + name;
    if (!start_->contains(key) || start_->info(key).shape != shape ||
        !at::isFloatingType(start_->info(key).dtype)) {
      throw IoError(fmt::format(
          "'{}' {} '{}' of shape [{}]: it is not the starting adapter of the run that trained "
          "this PiSSA adapter",
          start_->path(), start_->contains(key) ? "has no floating-point" : "lacks", key,
          fmt::join(shape, ", ")));
    }
    return start_->load(key).to(at::kFloat);
  }

  std::shared_ptr<ParameterSource> base_;
  Targets targets_;
  int64_t r_;
  double scaling_;
  int64_t niter_;
  uint64_t seed_;
  c10::Device device_;
  bool factors_;
  std::unique_ptr<SafetensorsFile> start_;  ///< the run's saved start (pissa_init), or null
  std::string cached_module_;
  PissaFactors cached_;
};

class DoraSource final : public ParameterSource {
 public:
  DoraSource(std::shared_ptr<ParameterSource> base, Targets targets, const LoraOptions& o)
      : base_(std::move(base)),
        targets_(std::move(targets)),
        r_(o.r),
        scaling_(o.scaling()),
        pissa_(pissa_iterations(o.init_lora_weights).has_value()) {}

  bool has(const std::string& name) const override {
    return !module_of(targets_, name, "lora_magnitude_vector").empty() || base_->has(name);
  }

  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    const std::string module = module_of(targets_, name, "lora_magnitude_vector");
    if (module.empty()) return base_->read(name, shape, offset, out);
    if (module != cached_module_) {
      cached_module_.clear();
      cached_ = magnitude(module);
      cached_module_ = module;
    }
    copy_range(name, cached_, offset, out);
  }

 private:
  at::Tensor magnitude(const std::string& module) {
    model::Linear& lin = *targets_.at(module);
    at::Tensor w;
    if (lin.quantized) {
      const at::Tensor storage =
          read_whole(*base_, module + ".weight", {lin.quantized->bytes()}, at::kByte);
      w = quant::dequantize_weight(*lin.quantized, storage, at::kFloat);
    } else {
      w = read_whole(*base_, module + ".weight", {lin.out_features, lin.in_features}, at::kFloat);
    }
    auto factor = [&](const char* leaf, std::vector<int64_t> shape) {
      const std::string name = module + "." + leaf;
      if (pissa_) return read_whole(*base_, name, shape, at::kFloat);  // pissa_source's
      return lin.named_parameters(/*recurse=*/true)[leaf].detach().to(at::kCPU, at::kFloat);
    };
    const at::Tensor a = factor("lora_A.weight", {r_, lin.in_features});
    const at::Tensor b = factor("lora_B.weight", {lin.out_features, r_});
    return dora_weight_norm(w, a, b, scaling_);
  }

  std::shared_ptr<ParameterSource> base_;
  Targets targets_;
  int64_t r_;
  double scaling_;
  bool pissa_;  ///< the factors are PiSSA's, from `base_`; else the model's own
  std::string cached_module_;
  at::Tensor cached_;
};

}  // namespace

std::shared_ptr<ParameterSource> pissa_source(std::shared_ptr<ParameterSource> base,
                                              CausalLM& model, const LoraOptions& options,
                                              uint64_t seed, c10::Device device, bool factors) {
  const std::optional<int64_t> niter = pissa_iterations(options.init_lora_weights);
  if (!niter) return base;
  return std::make_shared<PissaSource>(std::move(base), targets_of(model, options), options, *niter,
                                       seed, device, factors);
}

std::shared_ptr<ParameterSource> pissa_start_source(std::shared_ptr<ParameterSource> base,
                                                    CausalLM& model, const LoraOptions& options,
                                                    const std::string& init_dir) {
  const std::optional<int64_t> niter = pissa_iterations(options.init_lora_weights);
  if (!niter) return base;
  return std::make_shared<PissaSource>(
      std::move(base), targets_of(model, options), options, *niter, 0, at::kCPU, true,
      std::make_unique<SafetensorsFile>(init_dir + "/adapter_model.safetensors"));
}

std::shared_ptr<ParameterSource> dora_source(std::shared_ptr<ParameterSource> base, CausalLM& model,
                                             const LoraOptions& options) {
  if (!options.use_dora) return base;
  return std::make_shared<DoraSource>(std::move(base), targets_of(model, options), options);
}

}  // namespace zt::peft
