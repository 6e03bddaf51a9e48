// Adapter starts that depend on the base's weights, for a model the engine loads from a source
// (its parameters hold no values until then; peft::attach_adapter sets them on a model that
// does): PiSSA's factors and residual, read beneath any 4-bit quantization so that the residual
// is what gets quantized, and DoRA's magnitudes, read above it so that they are the norms of
// the weights trained over.
#pragma once

#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/units.hpp"

namespace zt::peft {

/// `base` with each PiSSA target of `model` (options.init_lora_weights pissa / pissa_niter_<n>)
/// read as PEFT's pissa_init leaves it: "<module>.weight" the residual and, with `factors`,
/// "<module>.lora_A.weight" / "<module>.lora_B.weight" the starting factors — decomposed from
/// `base`'s values on `device` one module at a time (pissa_factors, the random start drawn from
/// `seed` and the module's path, so every rank gets the same). `factors` false: the residual
/// only, for an adapter whose trained factors come from elsewhere (merge). Returns `base` when
/// the options are not PiSSA. Not thread-safe (as every source).
std::shared_ptr<ParameterSource> pissa_source(std::shared_ptr<ParameterSource> base,
                                              CausalLM& model, const LoraOptions& options,
                                              uint64_t seed, c10::Device device, bool factors);

/// pissa_source from the start a PiSSA run saved (`init_dir`: its pissa_init/ folder, the
/// factors with PEFT's keys) rather than a decomposition: "<module>.lora_A.weight" /
/// "<module>.lora_B.weight" those factors and "<module>.weight" the residual they leave of
/// `base`'s weight — exactly the base and start the run trained from, whatever device and seed
/// its decomposition had. IoError naming the file when it lacks a factor of this adapter's shape.
std::shared_ptr<ParameterSource> pissa_start_source(std::shared_ptr<ParameterSource> base,
                                                    CausalLM& model, const LoraOptions& options,
                                                    const std::string& init_dir);

/// `base` with "<module>.lora_magnitude_vector" of each DoRA target of `model`: the row norms of
/// its weight as `base` gives it (a 4-bit storage dequantized) plus scaling · B · A (B and A as
/// `base` gives them when the options are PiSSA — `base` is then a pissa_source —, else the
/// model's own). Returns `base` when the options are not
/// DoRA. `model` must outlive the source.
std::shared_ptr<ParameterSource> dora_source(std::shared_ptr<ParameterSource> base, CausalLM& model,
                                             const LoraOptions& options);

}  // namespace zt::peft
