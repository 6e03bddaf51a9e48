// Where a 4-bit model's weights come from: the checkpoint's full-precision values of each
// quantized projection, quantized one weight at a time while they load.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "quant/four_bit_weight.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/units.hpp"

namespace zt::model {

/// gpt-oss's MXFP4: `blocks` uint8 [..., G, 16] (32 FP4 E2M1 codes per group, the low nibble
/// first) and `scales` uint8 [..., G] (E8M0 exponents biased by 127) as fp32 [..., 32 G]:
/// code × 2^(scale − 127), as transformers' convert_moe_packed_tensors computes it (exact in
/// bf16 too). The checkpoint reader dequantizes the released experts with it. Thread-safe.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales);

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

/// Whether `source` already gives a 4-bit model's storage (quantizing_source, prequantized_source):
/// load_weights reads such a source as it is.
bool gives_quantized_storage(const ParameterSource& source);

/// The 4-bit base a model folder's config.json declares (`quantization_config` with
/// `quant_method` bitsandbytes and `load_in_4bit`, as transformers saves a bnb-4bit model), or
/// nullopt when it declares none. Reads `config.source_json`; a quantization_config that is not
/// a 4-bit bitsandbytes one (8-bit, GPTQ, AWQ, ...) is a ConfigError naming config.json.
std::optional<QuantizationConfig> saved_quantization(const ModelConfig& config);

/// Whether checkpoint tensor `info` holds a 4-bit weight's packed codes as bitsandbytes saves
/// them: uint8 (its size checked with the other parts, prequantized_source), or the same bytes
/// in a bnb_4bit_quant_storage dtype — bfloat16, float16, float32 — as ((n + 1) / (2 ×
/// itemsize), 1) elements, bitsandbytes' quantize_4bit allocation.
bool holds_packed_codes(const TensorInfo& info, const quant::FourBitLayout& layout);

/// Whether `name` is one of the tensors bitsandbytes saves beside a 4-bit weight ("….weight.
/// absmax", "….weight.quant_state.bitsandbytes__nf4", …) of a weight in `quantized`.
bool is_quantization_part(
    const std::string& name,
    const std::map<std::string, std::shared_ptr<const quant::FourBitLayout>>& quantized);

/// A source for the 4-bit weights of a folder saved by transformers with bitsandbytes (`path`:
/// the folder or a safetensors file): each weight in `quantized` is packed from the file's
/// parts after checking every one of them against its layout — the packed codes' size, the
/// quant_state JSON (type, block size, shape, dtype, double quantization), the quant_map, and
/// finite, non-negative scales — so a folder that lies is an IoError naming the tensor and
/// never a wrong weight. Every other name is read as checkpoint_source reads it, through
/// `dense_wrap` when given (an expert-parallel model's share of the experts, which the folder
/// holds unquantized: bitsandbytes quantizes nn.Linear modules only).
std::shared_ptr<ParameterSource> prequantized_source(
    const std::string& path,
    std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
    const std::function<std::shared_ptr<ParameterSource>(std::shared_ptr<ParameterSource>)>&
        dense_wrap = nullptr);

/// The full-precision values a LoRA adapter over a 4-bit base was trained with, for merging it:
/// `base_dir`'s bitsandbytes 4-bit weights dequantized; or, when the run quantized a
/// full-precision folder (`run_quantization`), its projections quantized and dequantized again
/// (PEFT's merge_and_unload onto the dequantized base); otherwise checkpoint_source(base_dir).
/// `config` is base_dir's. `dense`, when given, wraps the full-precision folder's source before
/// any quantization (the adapter's own view of its base: PiSSA's residual); a folder of 4-bit
/// weights is then a ConfigError, having no full-precision values to wrap.
using SourceWrap =
    std::function<std::shared_ptr<ParameterSource>(std::shared_ptr<ParameterSource>)>;
std::shared_ptr<ParameterSource> merge_base_source(
    const std::string& base_dir, const ModelConfig& config,
    const std::optional<QuantizationConfig>& run_quantization, const SourceWrap& dense = nullptr);

}  // namespace zt::model
