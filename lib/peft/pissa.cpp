// PiSSA's decomposition of one weight (pissa.hpp), as PEFT's LoraLayer.pissa_init computes it.
#include "peft/pissa.hpp"

#include <cmath>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "peft/linear_adapters.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::peft {

namespace {

constexpr const char* kNiter = "pissa_niter_";

// An orthonormal basis Q [m, q] of A's range (Halko et al. 2009, Algorithm 4.4, as
// torch.svd_lowrank's get_approximate_basis): A · Ω for a Gaussian Ω [n, q], then `niter`
// rounds of Aᵀ and A, each re-orthonormalized.
at::Tensor approximate_basis(const at::Tensor& a, int64_t q, int64_t niter, at::Generator gen) {
  const at::Tensor omega = at::randn({a.size(1), q}, gen, at::kFloat).to(a.device());
  at::Tensor basis = std::get<0>(at::linalg_qr(at::mm(a, omega)));
  for (int64_t i = 0; i < niter; ++i) {
    basis = std::get<0>(at::linalg_qr(at::mm(a.t(), basis)));
    basis = std::get<0>(at::linalg_qr(at::mm(a, basis)));
  }
  return basis;
}

}  // namespace

const char* const kInitChoices = "use true, pissa or pissa_niter_<n> (n from 0 to 999999)";

std::optional<std::string> canonical_init(const std::string& value) {
  if (value == "true" || value == "True" || value == "false" || value == "False" ||
      value == "gaussian") {
    return "true";
  }
  if (value == "pissa") return value;
  if (value.rfind(kNiter, 0) == 0) {
    const std::string digits = value.substr(std::string(kNiter).size());
    if (!digits.empty() && digits.size() <= 6 &&
        digits.find_first_not_of("0123456789") == std::string::npos) {
      return value;
    }
  }
  return std::nullopt;
}

std::optional<int64_t> pissa_iterations(const std::string& init) {
  if (init == "pissa") return -1;
  if (init.rfind(kNiter, 0) == 0) return std::stoll(init.substr(std::string(kNiter).size()));
  return std::nullopt;
}

PissaFactors pissa_factors(const at::Tensor& weight, int64_t r, double scaling, int64_t niter,
                           at::Generator generator) {
  const at::Tensor w = weight.to(at::kFloat);
  if (r > std::min(w.size(0), w.size(1))) {
    throw InvalidArgument(
        fmt::format("PiSSA: lora_r {} exceeds the rank a [{}, {}] weight can have; lower lora_r", r,
                    w.size(0), w.size(1)));
  }
  at::Tensor u, s, vh;  // w ≈ u · diag(s) · vh, the top r triplets
  if (niter < 0) {
    std::tie(u, s, vh) = at::linalg_svd(w, /*full_matrices=*/false);
    u = u.narrow(1, 0, r);
    s = s.narrow(0, 0, r);
    vh = vh.narrow(0, 0, r);
  } else {
    // Halko et al. 2009, Algorithm 5.1: the SVD of the small Qᵀ · w, lifted back by Q.
    const at::Tensor basis = approximate_basis(w, r, niter, generator);
    at::Tensor small_u;
    std::tie(small_u, s, vh) = at::linalg_svd(at::mm(basis.t(), w), /*full_matrices=*/false);
    u = at::mm(basis, small_u);
  }
  const at::Tensor root = (s / scaling).sqrt();
  PissaFactors f;
  f.lora_A = (root.unsqueeze(1) * vh).contiguous();
  f.lora_B = (u * root.unsqueeze(0)).contiguous();
  f.residual = w - at::mm(f.lora_B * scaling, f.lora_A);  // PEFT's (scaling · B) @ A
  return f;
}

void save_pissa_converted(CausalLM& model, const PeftConfig& config, const std::string& init_dir,
                          const std::string& dir,
                          const std::vector<std::pair<std::string, at::Tensor>>& values) {
  const std::string file = init_dir + "/adapter_model.safetensors";
  SafetensorsFile start(file);
  auto started = [&](const std::string& name, const at::Tensor& trained) {
    const std::string key = kAdapterKeyPrefix + name;
    if (!start.contains(key) || start.info(key).shape != trained.sizes().vec()) {
      throw IoError(fmt::format(
          "'{}' {} '{}' as this run trains it ([{}]); it is not this run's starting adapter — "
          "convert with the pissa_init/ folder the run wrote",
          file, start.contains(key) ? "has another shape for" : "lacks", key,
          fmt::join(trained.sizes(), ", ")));
    }
    return start.load(key).to(at::kFloat);
  };
  std::vector<std::pair<std::string, at::Tensor>> converted;
  for (const auto& [name, value] : values) {
    const at::Tensor trained = value.detach().to(at::kCPU, at::kFloat);
    if (name.find(".lora_A.") != std::string::npos) {
      converted.emplace_back(name, at::cat({trained, started(name, trained)}, 0));
    } else if (name.find(".lora_B.") != std::string::npos) {
      converted.emplace_back(name, at::cat({trained, -started(name, trained)}, 1));
    } else {
      converted.emplace_back(name, trained);
    }
  }
  PeftConfig plain = config;
  plain.lora.init_lora_weights = "true";
  plain.lora.r *= 2;
  plain.lora.alpha *= plain.lora.use_rslora ? std::sqrt(2.0) : 2.0;
  save_adapter(model, plain, dir, converted);
}

}  // namespace zt::peft
