// quantizing_source: a 4-bit model's weights from full-precision checkpoints.
#include "model/quantized_weights.hpp"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "model/layers.hpp"
#include "zerotrain/error.hpp"

namespace zt::model {
namespace {

class QuantizingSource final : public ParameterSource {
 public:
  QuantizingSource(ParameterSource& dense,
                   std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
                   std::shared_ptr<ParameterSource> owner)
      : dense_(dense), quantized_(std::move(quantized)), owner_(std::move(owner)) {}

  bool has(const std::string& name) const override { return dense_.has(name); }

  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    auto it = quantized_.find(name);
    if (it == quantized_.end()) {
      dense_.read(name, shape, offset, out);
      return;
    }
    const quant::FourBitLayout& layout = *it->second;
    if (out.scalar_type() != at::kByte || offset < 0 || offset + out.numel() > layout.bytes()) {
      throw InvalidArgument(
          fmt::format("4-bit weight '{}': bytes [{}, {}) asked of {} uint8, into {}", name, offset,
                      offset + out.numel(), layout.bytes(), c10::toString(out.scalar_type())));
    }
    if (name != cached_name_) {
      cached_name_.clear();
      at::Tensor values = at::empty({layout.rows, layout.cols}, at::kFloat);
      dense_.read(name, {layout.rows, layout.cols}, 0, values);
      cached_ = quant::quantize_weight(layout, values);
      cached_name_ = name;
    }
    out.view({-1}).copy_(cached_.narrow(0, offset, out.numel()));
  }

 private:
  ParameterSource& dense_;
  std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized_;
  std::shared_ptr<ParameterSource> owner_;
  std::string cached_name_;
  at::Tensor cached_;
};

}  // namespace

std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized_weights(
    const torch::nn::Module& model) {
  std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> out;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const Linear*>(item.value().get());
    if (linear != nullptr && linear->quantized) {
      out.emplace(item.key() + ".weight", linear->quantized);
    }
  }
  return out;
}

std::shared_ptr<ParameterSource> quantizing_source(
    ParameterSource& dense,
    std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
    std::shared_ptr<ParameterSource> owner) {
  return std::make_shared<QuantizingSource>(dense, std::move(quantized), std::move(owner));
}

}  // namespace zt::model
