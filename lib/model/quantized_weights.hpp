// Where a 4-bit model's weights come from: the checkpoint's full-precision values of each
// quantized projection, quantized one weight at a time while they load.
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>

#include "quant/four_bit_weight.hpp"
#include "zerotrain/units.hpp"

namespace zt::model {

/// The 4-bit weights of `model` by parameter name ("model.layers.0.self_attn.q_proj.weight"):
/// the storage each Linear with a quantized base registers as its weight, and its layout.
std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized_weights(
    const torch::nn::Module& model);

/// A source for a model with 4-bit weights (`quantized`, from quantized_weights): for those names
/// the storage bytes of `dense`'s [rows, cols] values, quantized on the CPU when their first slice
/// is read (one weight's values at a time, so the full-precision model is never whole in
/// memory; the last one is kept for its further slices); every other name read from `dense`
/// as it is. `dense` must outlive the source unless `owner` holds it. Not thread-safe: called
/// from the thread that builds the engine, as every source.
std::shared_ptr<ParameterSource> quantizing_source(
    ParameterSource& dense,
    std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
    std::shared_ptr<ParameterSource> owner = nullptr);

}  // namespace zt::model
