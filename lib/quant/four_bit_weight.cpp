// A weight's 4-bit storage: packing bitsandbytes' parts into one uint8 tensor and back.
#include "quant/four_bit_weight.hpp"

#include <fmt/format.h>

#include <vector>

#include "kernels/fused.hpp"
#include "zerotrain/error.hpp"

namespace zt::quant {
namespace {

void put(at::Tensor& storage, int64_t offset, const at::Tensor& part, int64_t bytes,
         const char* what) {
  const at::Tensor p = part.contiguous();
  if (p.nbytes() != static_cast<size_t>(bytes)) {
    throw InvalidArgument(fmt::format("4-bit weight: {} holds {} bytes where the layout needs {}",
                                      what, p.nbytes(), bytes));
  }
  storage.narrow(0, offset, bytes)
      .copy_(at::from_blob(p.data_ptr(), {bytes}, at::TensorOptions().dtype(at::kByte)));
}

}  // namespace

at::Tensor pack_weight(const FourBitLayout& layout, const FourBitBlocks& blocks,
                       const DoubleQuantized* nested) {
  at::Tensor storage = at::zeros({layout.bytes()}, at::kByte);
  put(storage, 0, blocks.packed.to(at::kByte), layout.codes_bytes(), "the packed codes");
  if (!layout.double_quant) {
    put(storage, layout.absmax_offset(), blocks.absmax.to(at::kFloat), 4 * layout.blocks(),
        "the absmax");
    return storage;
  }
  if (nested == nullptr)
    throw InvalidArgument("4-bit weight: double quantization without its parts");
  put(storage, layout.absmax_offset(), nested->codes.to(at::kByte), layout.blocks(),
      "the absmax's 8-bit codes");
  put(storage, layout.nested_absmax_offset(), nested->nested_absmax.to(at::kFloat),
      4 * layout.nested_blocks(), "the nested absmax");
  put(storage, layout.nested_code_offset(), nested->nested_code.to(at::kFloat), 4 * 256,
      "the nested code");
  put(storage, layout.offset_offset(), at::tensor({nested->offset}), 4, "the offset");
  return storage;
}

at::Tensor quantize_weight(const FourBitLayout& layout, const at::Tensor& weight) {
  if (weight.numel() != layout.numel()) {
    throw InvalidArgument(fmt::format("4-bit weight: {} values for a [{}, {}] weight",
                                      weight.numel(), layout.rows, layout.cols));
  }
  FourBitBlocks blocks = quantize_4bit(weight, layout.type, layout.blocksize);
  if (!layout.double_quant) return pack_weight(layout, blocks, nullptr);
  const DoubleQuantized nested = double_quantize(blocks.absmax);
  return pack_weight(layout, blocks, &nested);
}

FourBitParts parts_of(const FourBitLayout& layout, const at::Tensor& storage) {
  if (storage.scalar_type() != at::kByte || storage.numel() != layout.bytes()) {
    throw InvalidArgument(fmt::format(
        "4-bit weight: the storage of a [{}, {}] weight is {} uint8, not {} {}", layout.rows,
        layout.cols, layout.bytes(), storage.numel(), c10::toString(storage.scalar_type())));
  }
  const at::Tensor s = storage.reshape({-1});
  auto floats = [&](int64_t offset, int64_t count) {
    return s.narrow(0, offset, 4 * count).view(at::kFloat);
  };
  FourBitParts p;
  p.codes = s.narrow(0, 0, layout.codes_bytes());
  if (!layout.double_quant) {
    p.absmax = floats(layout.absmax_offset(), layout.blocks());
    return p;
  }
  p.absmax = s.narrow(0, layout.absmax_offset(), layout.blocks());
  p.nested_absmax = floats(layout.nested_absmax_offset(), layout.nested_blocks());
  p.nested_code = floats(layout.nested_code_offset(), 256);
  p.offset = floats(layout.offset_offset(), 1);
  return p;
}

std::vector<int64_t> layout_numbers(const FourBitLayout& layout) {
  return {static_cast<int64_t>(layout.type),
          layout.blocksize,
          layout.double_quant ? 1 : 0,
          layout.rows,
          layout.cols,
          static_cast<int64_t>(layout.dtype),
          layout.groups};
}

FourBitLayout layout_from_numbers(const std::vector<int64_t>& n) {
  FourBitLayout layout;
  layout.type = static_cast<FourBit>(n.at(0));
  layout.blocksize = n.at(1);
  layout.double_quant = n.at(2) != 0;
  layout.rows = n.at(3);
  layout.cols = n.at(4);
  layout.dtype = static_cast<at::ScalarType>(n.at(5));
  layout.groups = n.at(6);
  return layout;
}

at::Tensor dequantize_weight(const FourBitLayout& layout, const at::Tensor& storage,
                             at::ScalarType dtype) {
  const FourBitParts p = parts_of(layout, storage);
  const at::TensorOptions f32 = storage.options().dtype(at::kFloat);
  if (kernels::fused_dequantize_applies(p.codes, layout.blocksize)) {
    // One kernel per part on the GPU, the same products as the operations below.
    const at::Tensor absmax =
        layout.double_quant
            ? kernels::fused_dequantize_absmax(p.absmax, p.nested_absmax, p.nested_code, p.offset)
            : p.absmax;
    return kernels::fused_dequantize_4bit(p.codes, absmax, code_values(layout.type),
                                          layout.blocksize, layout.numel(), dtype)
        .view({layout.rows, layout.cols});
  }
  at::Tensor absmax = p.absmax;
  if (layout.double_quant) {
    // dequantize_8bit + offset: code[c] × nested absmax, then + offset, in fp32.
    const at::Tensor scale =
        p.nested_absmax.repeat_interleave(kNestedBlocksize).narrow(0, 0, layout.blocks());
    absmax = p.nested_code.index_select(0, p.absmax.to(at::kInt)).mul(scale).add(p.offset);
  }
  const std::array<float, 16>& v = code_values(layout.type);
  const at::Tensor table = at::tensor(std::vector<float>(v.begin(), v.end())).to(f32.device());
  // Element 2j is the high nibble of byte j, 2j + 1 the low one.
  const at::Tensor codes = at::stack({p.codes.__rshift__(4), p.codes.__and__(0x0F)}, 1)
                               .reshape({-1})
                               .narrow(0, 0, layout.numel())
                               .to(at::kInt);
  const at::Tensor scale = absmax.repeat_interleave(layout.blocksize).narrow(0, 0, layout.numel());
  return table.index_select(0, codes).mul_(scale).to(dtype).view({layout.rows, layout.cols});
}

}  // namespace zt::quant
