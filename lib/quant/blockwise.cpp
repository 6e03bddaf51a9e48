// bitsandbytes' blockwise 4-bit and 8-bit quantization on the CPU (kernels.cu and functional.py
// at 95f9af3; docs/quantization.md). The code trees and tables are its fp32 literals.
#include "quant/blockwise.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "util/threads.hpp"
#include "zerotrain/error.hpp"

namespace zt::quant {
namespace {

constexpr std::array<float, 16> kNf4 = {-1.0f,
                                        -0.6961928009986877f,
                                        -0.5250730514526367f,
                                        -0.39491748809814453f,
                                        -0.28444138169288635f,
                                        -0.18477343022823334f,
                                        -0.09105003625154495f,
                                        0.0f,
                                        0.07958029955625534f,
                                        0.16093020141124725f,
                                        0.24611230194568634f,
                                        0.33791524171829224f,
                                        0.44070982933044434f,
                                        0.5626170039176941f,
                                        0.7229568362236023f,
                                        1.0f};

// fp4_dequantization_lut, indexed by the three magnitude bits.
constexpr std::array<float, 8> kFp4Magnitudes = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f};

std::array<float, 16> fp4_values() {
  std::array<float, 16> v{};
  for (int c = 0; c < 16; ++c) {
    const float sign = 1.0f - 2 * ((c & 0b1000) >> 3);  // dDequantizeFP4Tree
    v[static_cast<size_t>(c)] = kFp4Magnitudes[static_cast<size_t>(c & 0b111)] * sign;
  }
  return v;
}

// dQuantizeNF4: a tree of strict comparisons, so a value on a threshold takes the lower code
// (and NaN, false everywhere, code 0).
uint8_t quantize_nf4(float x) {
  if (x > 0.03979014977812767f) {
    if (x > 0.3893125355243683f) {
      if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 0b1111 : 0b1110;
      return x > 0.5016634166240692f ? 0b1101 : 0b1100;
    }
    if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 0b1011 : 0b1010;
    return x > 0.1202552504837513f ? 0b1001 : 0b1000;
  }
  if (x > -0.33967943489551544f) {
    if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 0b0111 : 0b0110;
    return x > -0.23460740596055984f ? 0b0101 : 0b0100;
  }
  if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 0b0011 : 0b0010;
  return x > -0.8480964004993439f ? 0b0001 : 0b0000;
}

// dQuantizeFP4: the sign from x < 0 (so −0 keeps sign 0), then a tree over |x|.
uint8_t quantize_fp4(float x) {
  const uint8_t sign = x < 0 ? 0b1000 : 0b0000;
  x = std::fabs(x);
  if (x > 0.29166667f) {
    if (x > 0.583333f) return (x > 0.8333333f ? 0b0011 : 0b0010) + sign;
    return (x > 0.4166667f ? 0b101 : 0b100) + sign;
  }
  if (x > 0.0859375f) return (x > 0.20833333f ? 0b0111 : 0b0110) + sign;
  return (x > 0.00260417f ? 0b0001 : 0b0000) + sign;
}

// dQuantize<0>: a binary search over the sorted code with pivots 127 ± 64 ± 32 …, then the
// nearer of the last pivot and the neighbour on x's side by their midpoint.
uint8_t quantize_dynamic(const float* code, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float val = code[pivot];
  for (int i = 64; i > 0; i >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += i;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= i;
    }
    val = code[pivot];
  }
  if (upper_pivot == 255) upper = code[upper_pivot];
  if (lower_pivot == 0) lower = code[lower_pivot];
  if (x > val) {
    const float midpoint = (upper + val) * 0.5f;
    return static_cast<uint8_t>(x > midpoint ? upper_pivot : pivot);
  }
  const float midpoint = (lower + val) * 0.5f;
  return static_cast<uint8_t>(x < midpoint ? lower_pivot : pivot);
}

int64_t blocks_of(int64_t n, int64_t blocksize) {
  return (n + blocksize - 1) / blocksize;
}

void check_cpu(const at::Tensor& t, const char* what) {
  if (!t.defined() || t.device().type() != at::kCPU) {
    throw InvalidArgument(fmt::format("quantization: {} must be a defined CPU tensor", what));
  }
}

// max |x| over each block of the fp32 values (fmaxf from −FLT_MAX, as the kernel: NaN skipped).
float block_absmax(const float* v, int64_t n) {
  float m = -FLT_MAX;
  for (int64_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(v[i]));
  return n > 0 ? m : 0.0f;
}

// kQuantizeBlockwise's loop, for either code: each block's absmax (a partial block's missing
// values load as 0, which can only matter when every value is NaN), then code(e, x·(1/absmax))
// for each element e of it — 1/0 = +inf, and 0 · inf = NaN takes the code of NaN.
template <typename Code>
void quantize_blocks(const float* src, int64_t n, int64_t blocksize, float* absmax, Code code) {
  parallel_ranges(blocks_of(n, blocksize), cpu_worker_threads(), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * blocksize, count = std::min(blocksize, n - first);
      float m = block_absmax(src + first, count);
      if (count < blocksize) m = std::fmax(m, 0.0f);
      absmax[b] = m;
      const float reciprocal = 1.0f / m;
      for (int64_t e = first; e < first + count; ++e) code(e, src[e] * reciprocal);
    }
  });
}

}  // namespace

std::string_view to_string(FourBit type) {
  return type == FourBit::nf4 ? "nf4" : "fp4";
}

std::optional<FourBit> parse_four_bit(std::string_view name) {
  if (name == "nf4") return FourBit::nf4;
  if (name == "fp4") return FourBit::fp4;
  return std::nullopt;
}

bool valid_blocksize(int64_t blocksize) {
  for (int64_t b = 32; b <= 4096; b *= 2) {
    if (blocksize == b) return true;
  }
  return false;
}

const std::array<float, 16>& code_values(FourBit type) {
  static const std::array<float, 16> fp4 = fp4_values();
  return type == FourBit::nf4 ? kNf4 : fp4;
}

at::Tensor quant_map(FourBit type) {
  if (type == FourBit::nf4) return at::tensor(std::vector<float>(kNf4.begin(), kNf4.end()));
  // get_4bit_type("fp4"): the list's "-0" is Python's integer 0, so entry 8 is +0.
  const std::vector<float> fp4 = {0, 0.0625f,  8,  12,  4,  6,  2,  3,
                                  0, -0.0625f, -8, -12, -4, -6, -2, -3};
  at::Tensor t = at::tensor(fp4);
  return t.div_(12.0f);  // data.div_(data.abs().max())
}

uint8_t quantize_scaled(FourBit type, float x) {
  return type == FourBit::nf4 ? quantize_nf4(x) : quantize_fp4(x);
}

FourBitBlocks quantize_4bit(const at::Tensor& x, FourBit type, int64_t blocksize) {
  check_cpu(x, "the tensor to quantize");
  const at::ScalarType dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) {
    throw InvalidArgument(fmt::format(
        "quantization: 4-bit blocks take fp32, bf16 or fp16 values, not {}", c10::toString(dt)));
  }
  if (!valid_blocksize(blocksize)) {
    throw InvalidArgument(fmt::format(
        "quantization: block size {} is not one of 32, 64, 128, …, 4096 (bitsandbytes' sizes)",
        blocksize));
  }
  // fp16 / bf16 → fp32 is exact, as the kernel's (float) cast.
  const at::Tensor v = x.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t n = v.numel(), blocks = blocks_of(n, blocksize);
  FourBitBlocks out{at::zeros({(n + 1) / 2}, at::kByte), at::empty({blocks}, at::kFloat)};
  const float* src = v.data_ptr<float>();
  uint8_t* packed = out.packed.data_ptr<uint8_t>();
  float* absmax = out.absmax.data_ptr<float>();
  // Blocks are even-sized, so a block's elements fill whole bytes (the last may be half).
  quantize_blocks(src, n, blocksize, absmax, [&](int64_t e, float scaled) {
    const uint8_t c = quantize_scaled(type, scaled);
    packed[e / 2] |= static_cast<uint8_t>((e % 2 == 0) ? c << 4 : c);
  });
  return out;
}

at::Tensor dequantize_4bit(const at::Tensor& packed, const at::Tensor& absmax, FourBit type,
                           int64_t blocksize, int64_t numel, at::ScalarType dtype) {
  check_cpu(packed, "the packed codes");
  check_cpu(absmax, "the absmax");
  if (!valid_blocksize(blocksize)) {
    throw InvalidArgument(
        fmt::format("quantization: block size {} is not one of 32 … 4096", blocksize));
  }
  if (packed.scalar_type() != at::kByte || packed.numel() != (numel + 1) / 2) {
    throw InvalidArgument(fmt::format(
        "quantization: {} values need {} bytes of packed uint8 codes, the tensor holds {} {}",
        numel, (numel + 1) / 2, packed.numel(), c10::toString(packed.scalar_type())));
  }
  if (absmax.scalar_type() != at::kFloat || absmax.numel() != blocks_of(numel, blocksize)) {
    throw InvalidArgument(fmt::format(
        "quantization: {} values in blocks of {} need {} fp32 absmax values, the tensor holds {} "
        "{}",
        numel, blocksize, blocks_of(numel, blocksize), absmax.numel(),
        c10::toString(absmax.scalar_type())));
  }
  const at::Tensor p = packed.contiguous(), a = absmax.contiguous();
  at::Tensor out = at::empty({numel}, at::kFloat);
  const uint8_t* codes = p.data_ptr<uint8_t>();
  const float* scale = a.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const std::array<float, 16>& values = code_values(type);
  parallel_ranges(numel, cpu_worker_threads(), [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const uint8_t byte = codes[e / 2];
      const uint8_t c = (e % 2 == 0) ? byte >> 4 : byte & 0x0F;
      dst[e] = values[c] * scale[e / blocksize];
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for i in 0..6, the
  // midpoints of torch.linspace(0.1, 1, 2^i + 1) (fp32) times ±10^(i − 6); then 0 and 1; sorted.
  // linspace's values as its CPU kernel computes them one by one: start + step·k below the
  // halfway point, end − step·(steps − 1 − k) from it, step = (end − start) / (steps − 1), fp32,
  // each a fused multiply-add (torch's CPU kernels are built with FMA contraction: one rounding;
  // tests/fixtures/quant/torch_dynamic_map.json holds what torch 2.11 computed).
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t steps = (int64_t{1} << i) + 1, halfway = steps / 2;
    const float start = 0.1f, end = 1.0f;
    const float step = (end - start) / static_cast<float>(steps - 1);
    std::vector<float> bounds(static_cast<size_t>(steps));
    for (int64_t k = 0; k < steps; ++k) {
      bounds[static_cast<size_t>(k)] =
          k < halfway ? std::fma(step, static_cast<float>(k), start)
                      : std::fma(-step, static_cast<float>(steps - 1 - k), end);
    }
    // (b[:-1] + b[1:]) / 2.0, then a Python float times the fp32 tensor: the scalar is made
    // fp32 first (ATen's wrapped number), so the product is one fp32 rounding.
    const float scale = static_cast<float>(std::pow(10.0, -6 + i));
    for (int64_t k = 0; k + 1 < steps; ++k) {
      const float mean =
          (bounds[static_cast<size_t>(k)] + bounds[static_cast<size_t>(k + 1)]) / 2.0f;
      data.push_back(scale * mean);
      data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return at::tensor(data);
}

EightBitBlocks quantize_8bit(const at::Tensor& x, const at::Tensor& code, int64_t blocksize) {
  check_cpu(x, "the tensor to quantize");
  check_cpu(code, "the code");
  if (x.scalar_type() != at::kFloat || code.scalar_type() != at::kFloat || code.numel() != 256) {
    throw InvalidArgument("quantization: 8-bit blocks take fp32 values and a 256-entry fp32 code");
  }
  if (blocksize <= 0) throw InvalidArgument("quantization: the block size must be positive");
  const at::Tensor v = x.reshape({-1}).contiguous(), c = code.contiguous();
  const int64_t n = v.numel(), blocks = blocks_of(n, blocksize);
  EightBitBlocks out{at::empty({n}, at::kByte), at::empty({blocks}, at::kFloat)};
  const float* src = v.data_ptr<float>();
  const float* table = c.data_ptr<float>();
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  float* absmax = out.absmax.data_ptr<float>();
  quantize_blocks(src, n, blocksize, absmax,
                  [&](int64_t e, float scaled) { codes[e] = quantize_dynamic(table, scaled); });
  return out;
}

at::Tensor dequantize_8bit(const at::Tensor& codes, const at::Tensor& absmax,
                           const at::Tensor& code, int64_t blocksize) {
  check_cpu(codes, "the 8-bit codes");
  check_cpu(absmax, "the absmax");
  check_cpu(code, "the code");
  const int64_t n = codes.numel();
  if (codes.scalar_type() != at::kByte || code.scalar_type() != at::kFloat || code.numel() != 256 ||
      blocksize <= 0 || absmax.scalar_type() != at::kFloat ||
      absmax.numel() != blocks_of(n, blocksize)) {
    throw InvalidArgument(fmt::format(
        "quantization: {} 8-bit codes in blocks of {} need {} fp32 absmax values and a 256-entry "
        "fp32 code (got {} {} and {} {})",
        n, blocksize, blocksize > 0 ? blocks_of(n, blocksize) : 0, absmax.numel(),
        c10::toString(absmax.scalar_type()), code.numel(), c10::toString(code.scalar_type())));
  }
  const at::Tensor q = codes.contiguous(), a = absmax.contiguous(), c = code.contiguous();
  at::Tensor out = at::empty({n}, at::kFloat);
  const uint8_t* src = q.data_ptr<uint8_t>();
  const float* scale = a.data_ptr<float>();
  const float* table = c.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t e = 0; e < n; ++e) dst[e] = table[src[e]] * scale[e / blocksize];
  return out;
}

DoubleQuantized double_quantize(const at::Tensor& absmax) {
  check_cpu(absmax, "the absmax");
  if (absmax.scalar_type() != at::kFloat) {
    throw InvalidArgument("quantization: double quantization takes the fp32 absmax");
  }
  DoubleQuantized q;
  const at::Tensor a = absmax.reshape({-1});
  q.offset = a.numel() > 0 ? a.mean().item<float>() : 0.0f;
  q.nested_code = dynamic_map();
  EightBitBlocks nested = quantize_8bit(a - q.offset, q.nested_code, kNestedBlocksize);
  q.codes = nested.codes;
  q.nested_absmax = nested.absmax;
  return q;
}

at::Tensor double_dequantize(const DoubleQuantized& q) {
  return dequantize_8bit(q.codes, q.nested_absmax, q.nested_code, kNestedBlocksize).add_(q.offset);
}

}  // namespace zt::quant
