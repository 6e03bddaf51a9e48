// A [rows, cols] weight kept as bitsandbytes' 4-bit blocks in one uint8 tensor: the storage a
// quantized Linear registers as its "weight" (model/layers.hpp), which the engine keeps,
// shards and gathers as bytes (zero/layout.hpp: raw buckets).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "quant/blockwise.hpp"

namespace zt::quant {

/// Where each part lies in the storage bytes, in this order: the packed codes, then (4-byte
/// aligned) the fp32 absmax per block — or, under double quantization, the absmax's 8-bit codes,
/// their fp32 nested absmax, the 256-entry fp32 nested code and the fp32 offset.
struct FourBitLayout {
  FourBit type = FourBit::nf4;
  int64_t blocksize = 64;
  bool double_quant = false;
  int64_t rows = 0, cols = 0;
  /// The values are [groups, rows / groups, cols] where groups > 1 (a mixture's experts, each
  /// quantized in the same blocks as the whole), else [rows, cols].
  int64_t groups = 1;
  /// The dtype the weight's values have when dequantized (the model's).
  at::ScalarType dtype = at::kFloat;

  int64_t numel() const { return rows * cols; }
  std::vector<int64_t> value_shape() const {
    if (groups > 1) return {groups, rows / groups, cols};
    return {rows, cols};
  }
  int64_t blocks() const { return (numel() + blocksize - 1) / blocksize; }
  int64_t nested_blocks() const { return (blocks() + kNestedBlocksize - 1) / kNestedBlocksize; }
  int64_t codes_bytes() const { return (numel() + 1) / 2; }
  /// The absmax (fp32) or, under double quantization, its uint8 codes.
  int64_t absmax_offset() const { return align4(codes_bytes()); }
  int64_t nested_absmax_offset() const { return align4(absmax_offset() + blocks()); }
  int64_t nested_code_offset() const { return nested_absmax_offset() + 4 * nested_blocks(); }
  int64_t offset_offset() const { return nested_code_offset() + 4 * 256; }
  int64_t bytes() const {
    return double_quant ? offset_offset() + 4 : absmax_offset() + 4 * blocks();
  }

 private:
  static int64_t align4(int64_t n) { return (n + 3) / 4 * 4; }
};

/// The layout as integers and back (an autograd context keeps it so: its saved_data holds
/// IValues): type, blocksize, double_quant, rows, cols, dtype, groups.
std::vector<int64_t> layout_numbers(const FourBitLayout& layout);
FourBitLayout layout_from_numbers(const std::vector<int64_t>& numbers);

/// The storage of `weight` ([rows, cols], any float dtype, CPU): quantize_4bit, and
/// double_quantize of its absmax when the layout says so. uint8 [layout.bytes()], CPU.
at::Tensor quantize_weight(const FourBitLayout& layout, const at::Tensor& weight);

/// The storage of weights quantized already (a bitsandbytes folder's tensors; `double_quant`
/// parts undefined when it is off). CPU; throws InvalidArgument when a size does not fit.
at::Tensor pack_weight(const FourBitLayout& layout, const FourBitBlocks& blocks,
                       const DoubleQuantized* nested);

/// The parts of a storage tensor, as views (any device).
struct FourBitParts {
  at::Tensor codes;   ///< uint8 [codes_bytes]
  at::Tensor absmax;  ///< fp32 [blocks], or uint8 [blocks] under double quantization
  at::Tensor nested_absmax, nested_code, offset;  ///< fp32; double quantization only
};
FourBitParts parts_of(const FourBitLayout& layout, const at::Tensor& storage);

/// The weight's values, [rows, cols] in `dtype`, on the storage's device, by ATen operations (so
/// any device): value[code] × absmax in fp32, then cast — the same products as dequantize_4bit,
/// bit for bit.
at::Tensor dequantize_weight(const FourBitLayout& layout, const at::Tensor& storage,
                             at::ScalarType dtype);

}  // namespace zt::quant
