// PiSSA (PEFT's init_lora_weights "pissa" / "pissa_niter_<n>"): LoRA's A and B start as the
// weight's top-r singular triplets and the base keeps the rest, so the model starts unchanged.
// The decomposition (pissa.cpp), its spellings, and PEFT's conversion of a trained PiSSA adapter
// into a plain LoRA one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// `value` as LoraOptions::init_lora_weights keeps it: "true" (PEFT's True, False and
/// "gaussian": where A and B start does not matter once an adapter is loaded), "pissa" or
/// "pissa_niter_<n>"; nullopt for what zerotrain lacks (olora, corda, loftq, ... which change the
/// base too).
std::optional<std::string> canonical_init(const std::string& value);
/// What a message about an unsupported init_lora_weights value says to do.
extern const char* const kInitChoices;

/// -1 for "pissa" (a full SVD), n for "pissa_niter_<n>", nullopt when `init` is not PiSSA.
std::optional<int64_t> pissa_iterations(const std::string& init);

struct PissaFactors {
  at::Tensor lora_A;    ///< [r, in] fp32: √S_r · Vᵀ_r, S_r divided by the scaling first
  at::Tensor lora_B;    ///< [out, r] fp32: U_r · √S_r
  at::Tensor residual;  ///< [out, in] fp32: weight − scaling · lora_B · lora_A
};

/// PEFT's pissa_init of one weight ([out, in], any float dtype; computed in fp32 on its device):
/// torch.linalg.svd for `niter` -1, else the randomized SVD of Halko et al. (torch.svd_lowrank's
/// algorithm, q = r) with `niter` subspace iterations from a Gaussian start drawn on the CPU from
/// `generator` (so every rank and every device draws the same one). InvalidArgument when r
/// exceeds min(out, in).
PissaFactors pissa_factors(const at::Tensor& weight, int64_t r, double scaling, int64_t niter,
                           at::Generator generator);

/// The folders a PiSSA run writes beside its adapter (LLaMA-Factory's names): the adapter as it
/// started, with init_lora_weights true (what the conversion subtracts), and the converted one.
constexpr const char* kPissaInitDir = "pissa_init";
constexpr const char* kPissaConvertedDir = "pissa_converted";

/// Writes a trained PiSSA adapter of `model` (`values`: its trained tensors by parameter name,
/// as save_adapter takes them) as a plain LoRA adapter over the original base into `dir`, as
/// PEFT's save_pretrained(path_initial_model_for_weight_conversion=`init_dir`) does: ΔW =
/// B·A − B0·A0 written as lora_A' = [A; A0], lora_B' = [B, −B0], r and lora_alpha doubled
/// (lora_alpha × √2 under rsLoRA, so the scaling stays), init_lora_weights true. The other
/// trained tensors (biases, modules_to_save) are written as they are, where PEFT drops them.
/// IoError naming the file when `init_dir`'s adapter lacks a factor or has another shape.
void save_pissa_converted(CausalLM& model, const PeftConfig& config, const std::string& init_dir,
                          const std::string& dir,
                          const std::vector<std::pair<std::string, at::Tensor>>& values);

}  // namespace zt::peft
