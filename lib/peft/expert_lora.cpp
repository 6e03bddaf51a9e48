// LoRA on the experts' fused tensors (expert_lora.hpp): the factors, the grouped low-rank
// product on the rows grouped by expert, and the merge.
#include "peft/expert_lora.hpp"

#include <fmt/format.h>

#include <cmath>
#include <memory>

#include "peft/lora.hpp"
#include "peft/lora_targets.hpp"
#include "zerotrain/error.hpp"

namespace zt::peft {
namespace {

// A factor's holder: one parameter "weight", as PEFT's nn.Linear factors are saved. Not a
// model::Linear, so that LoRA's all-linear never takes it for a projection.
struct Factor : torch::nn::Module {
  at::Tensor weight;
  explicit Factor(at::Tensor value) { weight = register_parameter("weight", std::move(value)); }
};

class ExpertLora final : public model::ExpertAdapter {
 public:
  ExpertLora(std::shared_ptr<Factor> a, std::shared_ptr<Factor> b, int64_t experts, int64_t r,
             double scaling)
      : a_(std::move(a)), b_(std::move(b)), experts_(experts), r_(r), scaling_(scaling) {}

  at::Tensor forward(const at::Tensor& rows, const model::ExpertGroups& groups) const override {
    const at::Tensor low = model::grouped_linear(rows, a_per_expert(), groups);
    return model::grouped_linear(scaling_ != 1.0 ? low * scaling_ : low, b_per_expert(), groups);
  }
  void merge_into(at::Tensor& weight) const override { add(weight, scaling_); }
  void unmerge_from(at::Tensor& weight) const override { add(weight, -scaling_); }

 private:
  // A as [E, r, in] and B as [E, out, r]: PEFT's reshapes of its [r·E, in] and [out, r·E].
  at::Tensor a_per_expert() const { return a_->weight.view({experts_, r_, a_->weight.size(1)}); }
  at::Tensor b_per_expert() const {
    return b_->weight.view({b_->weight.size(0), r_, experts_}).permute({2, 0, 1}).contiguous();
  }
  void add(at::Tensor& weight, double scale) const {
    weight.baddbmm_(b_per_expert().to(at::kFloat), a_per_expert().to(at::kFloat), 1.0, scale);
  }

  std::shared_ptr<Factor> a_, b_;
  int64_t experts_, r_;
  double scaling_;
};

}  // namespace

std::vector<size_t> targeted_expert_tensors(const std::string& path, const LoraOptions& o) {
  std::vector<size_t> out;
  for (size_t i = 0; i < model::MoeExperts::kTensors; ++i) {
    const std::string key = path + "." + model::MoeExperts::kNames[i];
    for (const std::string& t : o.target_parameters) {
      if (ends_with_component(key, t)) {
        out.push_back(i);
        break;
      }
    }
  }
  return out;
}

std::optional<std::string> expert_adapter_path(const std::string& path, size_t tensor,
                                               const LoraOptions& o) {
  const std::vector<size_t> targeted = targeted_expert_tensors(path, o);
  std::string out = path;
  for (auto it = targeted.rbegin(); it != targeted.rend(); ++it) {
    if (*it == tensor) return out;
    out += ".base_layer";  // each tensor targeted after it wraps it once more
  }
  return std::nullopt;
}

void check_expert_options(const LoraOptions& o) {
  if (o.target_parameters.empty()) return;
  const char* refused = o.dropout > 0                                ? "lora_dropout > 0"
                        : o.use_dora                                 ? "DoRA (use_dora)"
                        : o.init_lora_weights.rfind("pissa", 0) == 0 ? "PiSSA"
                                                                     : nullptr;
  if (refused != nullptr) {
    throw ConfigError(fmt::format(
        "lora_target_parameters: {} is not supported on the experts' fused tensors (PEFT's "
        "target_parameters refuses it too); drop it or target only modules",
        refused));
  }
}

size_t attach_expert_adapters(const std::string& path, model::MoeExperts& experts,
                              const LoraOptions& given, uint64_t seed) {
  const std::vector<size_t> targeted = targeted_expert_tensors(path, given);
  if (targeted.empty()) return 0;
  check_expert_options(given);
  for (size_t i : targeted) {
    model::MoeExperts::Adapted& slot = experts.adapted[i];
    const std::string name = path + "." + model::MoeExperts::kNames[i];
    if (slot.adapter) throw InvalidArgument(fmt::format("'{}' already has a LoRA adapter", name));
    // [E, out, in], as PEFT sees it (gpt-oss's [E, in, out] swapped).
    const std::vector<int64_t> shape = experts.shape(i);
    const int64_t e = shape[0], out = shape[experts.transposed ? 2 : 1],
                  in = shape[experts.transposed ? 1 : 2];
    const std::string module = *expert_adapter_path(path, i, given);
    const LoraOptions o = given.at(name);  // PEFT's key: the tensor's path
    torch::nn::Module* host = &experts;
    std::shared_ptr<torch::nn::Module> nested;
    if (module != path) {  // "<path>.base_layer": the inner wrapper's own module
      nested = experts.register_module("base_layer", std::make_shared<torch::nn::Module>());
      host = nested.get();
    }
    at::NoGradGuard no_grad;
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    const at::TensorOptions options = experts.value_options();
    auto a = host->register_module(
        "lora_A", std::make_shared<Factor>(at::empty({o.r * e, in})
                                               .uniform_(-bound, bound, generator_for(seed, module))
                                               .to(options)));
    auto b = host->register_module("lora_B",
                                   std::make_shared<Factor>(at::zeros({out, o.r * e}, options)));
    slot.adapter = std::make_shared<ExpertLora>(a, b, e, o.r, o.scaling());
  }
  return targeted.size();
}

bool fold_trained_expert_adapter(const LoraOptions& given, const std::string& name, bool transposed,
                                 at::Tensor& stored,
                                 const std::function<bool(const std::string&)>& has,
                                 const TensorReader& read) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || stored.dim() != 3) return false;
  at::Tensor weight = transposed ? stored.transpose(1, 2) : stored;  // [E, out, in], a view
  const std::string path = name.substr(0, dot), tensor = name.substr(dot + 1);
  for (size_t i = 0; i < model::MoeExperts::kTensors; ++i) {
    if (tensor != model::MoeExperts::kNames[i]) continue;
    const std::optional<std::string> module = expert_adapter_path(path, i, given);
    if (!module || !has(*module + ".lora_A.weight")) return false;
    const LoraOptions o = given.at(name);
    const int64_t e = weight.size(0), out = weight.size(1), in = weight.size(2);
    at::Tensor a = at::empty({o.r * e, in}, at::kFloat), b = at::empty({out, o.r * e}, at::kFloat);
    read(*module + ".lora_A.weight", a);
    read(*module + ".lora_B.weight", b);
    ExpertLora(std::make_shared<Factor>(a), std::make_shared<Factor>(b), e, o.r, o.scaling())
        .merge_into(weight);
    return true;
  }
  return false;
}

}  // namespace zt::peft
