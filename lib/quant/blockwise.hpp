// bitsandbytes' blockwise quantization, bit for bit on the CPU: 4-bit NF4 / FP4 codes with an
// fp32 absmax per block, and the 8-bit dynamic codes that double quantization stores the
// absmax in. The facts and their origin: docs/quantization.md.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace zt::quant {

/// The 4-bit data types (bnb_4bit_quant_type).
enum class FourBit { nf4, fp4 };

std::string_view to_string(FourBit type);
/// "nf4" / "fp4"; nullopt for anything else.
std::optional<FourBit> parse_four_bit(std::string_view name);

/// Whether bitsandbytes accepts `blocksize` for 4-bit quantization: 32, 64, …, 4096.
bool valid_blocksize(int64_t blocksize);

/// The value each of the 16 codes dequantizes to before the block's absmax scales it, as
/// bitsandbytes' kernels hold them (nf4_dequantization_lut; FP4: the sign bit times
/// fp4_dequantization_lut).
const std::array<float, 16>& code_values(FourBit type);

/// The code table bitsandbytes stores as `quant_map` (get_4bit_type): NF4's values; FP4's
/// [0, 0.0625, 8, 12, 4, 6, 2, 3, 0, −0.0625, …] / 12 in fp32. fp32 [16], CPU.
at::Tensor quant_map(FourBit type);

/// The code of one element already scaled into [−1, 1] (dQuantizeNF4 / dQuantizeFP4).
uint8_t quantize_scaled(FourBit type, float x);

/// Packed 4-bit codes and their scales.
struct FourBitBlocks {
  at::Tensor packed;  ///< uint8 [ceil(n / 2)]: element 2j in the high nibble, 2j + 1 in the low
  at::Tensor absmax;  ///< fp32 [ceil(n / blocksize)]: max |x| of each block
};

/// Quantizes `x` (fp32, bf16 or fp16, any shape; row-major order) in blocks of `blocksize`
/// (valid_blocksize) as bitsandbytes' kQuantizeBlockwise does: each element times the fp32
/// reciprocal of its block's absmax, then coded. The reciprocal here is IEEE's; bitsandbytes'
/// CUDA build takes an approximate one, which can differ in the last bit (docs/quantization.md).
/// CPU tensors in and out; throws InvalidArgument on a bad dtype, device or block size.
FourBitBlocks quantize_4bit(const at::Tensor& x, FourBit type, int64_t blocksize);

/// The `numel` values (flat, `dtype`) of packed codes: value[code] × absmax in fp32, then cast
/// (kDequantizeBlockwise). CPU; throws InvalidArgument when the sizes do not fit each other.
at::Tensor dequantize_4bit(const at::Tensor& packed, const at::Tensor& absmax, FourBit type,
                           int64_t blocksize, int64_t numel, at::ScalarType dtype);

/// bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(), the default code of
/// quantize_blockwise and of double quantization): 256 sorted fp32 values, computed with the
/// same fp32 tensor operations as the Python original. CPU.
at::Tensor dynamic_map();

/// 8-bit codes against a sorted 256-entry `code` and their scales.
struct EightBitBlocks {
  at::Tensor codes;   ///< uint8 [n]
  at::Tensor absmax;  ///< fp32 [ceil(n / blocksize)]
};

/// quantize_blockwise on fp32 `x`: each block scaled by its absmax's reciprocal, then the
/// nearest of `code` by bitsandbytes' binary search (dQuantize: ties between neighbours go to
/// the lower one's side as it decides them). CPU.
EightBitBlocks quantize_8bit(const at::Tensor& x, const at::Tensor& code, int64_t blocksize);

/// code[c] × absmax of the block, fp32 [codes.numel()]. CPU.
at::Tensor dequantize_8bit(const at::Tensor& codes, const at::Tensor& absmax,
                           const at::Tensor& code, int64_t blocksize);

/// The block size of double quantization's nested blocks (bitsandbytes' quantize_4bit).
inline constexpr int64_t kNestedBlocksize = 256;

/// The absmax of 4-bit blocks, quantized again (compress_statistics / bnb_4bit_use_double_quant):
/// `offset` = their mean, and (absmax − offset) in 8-bit dynamic codes of blocks of 256.
struct DoubleQuantized {
  at::Tensor codes;          ///< uint8 [blocks]
  at::Tensor nested_absmax;  ///< fp32 [ceil(blocks / 256)]
  at::Tensor nested_code;    ///< fp32 [256]: dynamic_map()
  float offset = 0;
};

DoubleQuantized double_quantize(const at::Tensor& absmax);

/// The fp32 absmax back: dequantize_8bit(...) + offset, as dequantize_4bit does.
at::Tensor double_dequantize(const DoubleQuantized& q);

}  // namespace zt::quant
