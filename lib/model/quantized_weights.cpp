// quantizing_source: a 4-bit model's weights from full-precision checkpoints.
#include "model/quantized_weights.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "model/family.hpp"
#include "model/layers.hpp"
#include "model/moe.hpp"
#include "util/dtype_names.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::model {
namespace {

// What the sources below share: a name in `quantized` reads from whole(), one weight at a time —
// made when its first range is read and kept for the rest (the engine reads a weight's ranges
// in order) — as storage bytes (uint8) or as fp32 values; every other name from other().
class OneWeightAtATime : public ParameterSource {
 public:
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) final {
    auto it = quantized_.find(name);
    if (it == quantized_.end()) {
      other().read(name, shape, offset, out);
      return;
    }
    const quant::FourBitLayout& layout = *it->second;
    const int64_t size = bytes_ ? layout.bytes() : layout.numel();
    if ((bytes_ && out.scalar_type() != at::kByte) || offset < 0 || offset + out.numel() > size) {
      throw InvalidArgument(fmt::format("4-bit weight '{}': {} [{}, {}) asked of {}, into {}", name,
                                        bytes_ ? "storage bytes" : "values", offset,
                                        offset + out.numel(), size,
                                        c10::toString(out.scalar_type())));
    }
    if (name != cached_name_) {
      cached_name_.clear();
      cached_ = whole(name, layout);
      cached_name_ = name;
    }
    out.view({-1}).copy_(cached_.narrow(0, offset, out.numel()));
  }

 protected:
  OneWeightAtATime(std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
                   bool bytes)
      : quantized_(std::move(quantized)), bytes_(bytes) {}
  /// Weight `name` whole and flat: its storage (uint8) or its values (fp32).
  virtual at::Tensor whole(const std::string& name, const quant::FourBitLayout& layout) = 0;
  virtual ParameterSource& other() = 0;

 private:
  std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized_;
  bool bytes_;
  std::string cached_name_;
  at::Tensor cached_;
};

class QuantizingSource final : public OneWeightAtATime {
 public:
  QuantizingSource(ParameterSource& dense,
                   std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
                   std::shared_ptr<ParameterSource> owner)
      : OneWeightAtATime(std::move(quantized), /*bytes=*/true),
        dense_(dense),
        owner_(std::move(owner)) {}

  bool has(const std::string& name) const override { return dense_.has(name); }

 private:
  at::Tensor whole(const std::string& name, const quant::FourBitLayout& layout) override {
    at::Tensor values = at::empty({layout.rows, layout.cols}, at::kFloat);
    dense_.read(name, layout.value_shape(), 0, values);
    return quant::quantize_weight(layout, values);
  }
  ParameterSource& other() override { return dense_; }

  ParameterSource& dense_;
  std::shared_ptr<ParameterSource> owner_;
};

// The suffixes of the tensors bitsandbytes saves beside a 4-bit weight.
constexpr const char* kParts[] = {".absmax",
                                  ".quant_map",
                                  ".nested_absmax",
                                  ".nested_quant_map",
                                  ".quant_state.bitsandbytes__nf4",
                                  ".quant_state.bitsandbytes__fp4"};

class PrequantizedSource final : public OneWeightAtATime {
 public:
  PrequantizedSource(const std::string& path,
                     std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
                     const SourceWrap& dense_wrap)
      : OneWeightAtATime(std::move(quantized), /*bytes=*/true),
        ckpt_(path),
        dense_(dense_wrap ? dense_wrap(checkpoint_source(path)) : checkpoint_source(path)) {}

  bool has(const std::string& name) const override { return ckpt_.contains(name); }

 private:
  [[noreturn]] void fail(const std::string& tensor, const std::string& what) const {
    throw IoError(fmt::format(
        "checkpoint '{}': tensor '{}' {}; the folder is not a bitsandbytes 4-bit model of this "
        "config (re-save it with transformers, or give the full-precision model)",
        ckpt_.path(), tensor, what));
  }

  // The tensor `name` of the file, checked to be `dtype` with `numel` elements.
  at::Tensor part(const std::string& name, at::ScalarType dtype, int64_t numel) const {
    if (!ckpt_.contains(name)) fail(name, "is missing");
    const TensorInfo& info = ckpt_.info(name);
    if (info.dtype != dtype || info.numel != numel) {
      fail(name, fmt::format("is {} with {} elements where {} with {} are needed", info.dtype_name,
                             info.numel, c10::toString(dtype), numel));
    }
    return ckpt_.load(name, dtype).reshape({-1});
  }

  // The packed codes of weight `name` (holds_packed_codes), as uint8 bytes.
  at::Tensor packed_codes(const std::string& name, const quant::FourBitLayout& layout) const {
    if (!ckpt_.contains(name)) fail(name, "is missing");
    const TensorInfo& info = ckpt_.info(name);
    const int64_t bytes = info.numel * static_cast<int64_t>(c10::elementSize(info.dtype));
    if (!holds_packed_codes(info, layout) || bytes != layout.codes_bytes()) {
      fail(name, fmt::format("is {} with {} elements where {} bytes of packed codes (uint8, or "
                             "bfloat16 / float16 / float32 storage) are needed",
                             info.dtype_name, info.numel, layout.codes_bytes()));
    }
    const at::Tensor stored = ckpt_.load(name, info.dtype).reshape({-1}).contiguous();
    at::Tensor out = at::empty({bytes}, at::kByte);
    std::memcpy(out.data_ptr(), stored.data_ptr(), static_cast<size_t>(bytes));
    return out;
  }

  // Scales: finite and not negative (a corrupt file's NaN or −1 would dequantize silently).
  void check_scales(const std::string& name, const at::Tensor& t) const {
    if (t.numel() > 0 && (!at::isfinite(t).all().item<bool>() || t.lt(0).any().item<bool>())) {
      fail(name, "holds a negative or non-finite scale");
    }
  }

  ParameterSource& other() override { return *dense_; }

  // The storage of weight `name` from the file's parts, each checked.
  at::Tensor whole(const std::string& name, const quant::FourBitLayout& layout) override {
    // A mixture's fused experts: bitsandbytes quantizes nn.Linear modules only, so the folder
    // holds their values (whole, or one tensor per expert), quantized here as a full-precision
    // folder's are.
    if (layout.groups > 1) {
      at::Tensor values = at::empty({layout.rows, layout.cols}, at::kFloat);
      dense_->read(name, layout.value_shape(), 0, values);
      return quant::quantize_weight(layout, values);
    }
    const std::string type(quant::to_string(layout.type));
    const std::string other = layout.type == quant::FourBit::nf4 ? "fp4" : "nf4";
    if (ckpt_.contains(name + ".quant_state.bitsandbytes__" + other)) {
      fail(name + ".quant_state.bitsandbytes__" + other,
           fmt::format("says the weight is {}, but the model is {} (config.json's "
                       "quantization_config or the run's options)",
                       other, type));
    }
    const std::string state_name = name + ".quant_state.bitsandbytes__" + type;
    if (!ckpt_.contains(state_name)) fail(state_name, "is missing");
    const TensorInfo& state_info = ckpt_.info(state_name);
    if (state_info.dtype != at::kByte || state_info.numel > 4096) {
      fail(state_name, "is not the JSON bytes of a quant_state");
    }
    const at::Tensor bytes = ckpt_.load(state_name, at::kByte).reshape({-1}).contiguous();
    const std::string text(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                           static_cast<size_t>(bytes.numel()));
    const std::string source =
        fmt::format("checkpoint '{}': tensor '{}'", ckpt_.path(), state_name);
    rapidjson::Document doc = json::parse(text, source);
    json::ObjectReader state(doc, "quant_state", source);
    if (state.required_string("quant_type") != type) fail(state_name, "names another quant_type");
    if (state.integer("blocksize", 1, 1 << 20).value_or(-1) != layout.blocksize) {
      fail(state_name, fmt::format("does not give blocksize {}", layout.blocksize));
    }
    const std::string dtype = state.required_string("dtype");
    if (!torch_float_dtype(dtype)) {
      fail(state_name, fmt::format("gives dtype '{}'", dtype));
    }
    const rapidjson::Value* shape = state.find("shape");
    if (shape == nullptr || !shape->IsArray() || shape->Size() != 2 ||
        json::as_integer((*shape)[0]).value_or(-1) != layout.rows ||
        json::as_integer((*shape)[1]).value_or(-1) != layout.cols) {
      fail(state_name,
           fmt::format("does not give the weight's shape [{}, {}]", layout.rows, layout.cols));
    }
    const bool nested = state.has("nested_offset");
    if (nested != layout.double_quant) {
      fail(state_name, fmt::format("says double quantization is {}, config.json {}",
                                   nested ? "on" : "off", layout.double_quant ? "on" : "off"));
    }
    state.known({"nested_blocksize", "nested_dtype", "nested_offset"});

    quant::FourBitBlocks blocks;
    blocks.packed = packed_codes(name, layout);
    if (!at::equal(part(name + ".quant_map", at::kFloat, 16), quant::quant_map(layout.type))) {
      fail(name + ".quant_map", fmt::format("is not {}'s code table", type));
    }
    if (!nested) {
      blocks.absmax = part(name + ".absmax", at::kFloat, layout.blocks());
      check_scales(name + ".absmax", blocks.absmax);
      return quant::pack_weight(layout, blocks, nullptr);
    }
    if (state.integer("nested_blocksize", 1, 1 << 20).value_or(-1) != quant::kNestedBlocksize) {
      fail(state_name, "does not give nested_blocksize 256");
    }
    // Finite as the fp32 it becomes: 1e300 is a finite double but an infinite offset.
    const float offset =
        static_cast<float>(state.number("nested_offset", -3e38, 3e38).value_or(NAN));
    if (!std::isfinite(offset)) fail(state_name, "gives no finite nested_offset");
    quant::DoubleQuantized dq;
    dq.codes = part(name + ".absmax", at::kByte, layout.blocks());
    dq.nested_absmax = part(name + ".nested_absmax", at::kFloat, layout.nested_blocks());
    check_scales(name + ".nested_absmax", dq.nested_absmax);
    dq.nested_code = part(name + ".nested_quant_map", at::kFloat, 256);
    if (!at::isfinite(dq.nested_code).all().item<bool>()) {
      fail(name + ".nested_quant_map", "holds a non-finite value");
    }
    dq.offset = offset;
    blocks.absmax = at::Tensor();
    return quant::pack_weight(layout, blocks, &dq);
  }

  SafetensorsCheckpoint ckpt_;
  std::shared_ptr<ParameterSource> dense_;
};

// The 4-bit weights of `storage` as fp32 values (any dtype out); every other name as it is.
class DequantizingSource final : public OneWeightAtATime {
 public:
  DequantizingSource(std::shared_ptr<ParameterSource> storage,
                     std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized)
      : OneWeightAtATime(std::move(quantized), /*bytes=*/false), storage_(std::move(storage)) {}

  bool has(const std::string& name) const override { return storage_->has(name); }

 private:
  at::Tensor whole(const std::string& name, const quant::FourBitLayout& layout) override {
    at::Tensor bytes = at::empty({layout.bytes()}, at::kByte);
    storage_->read(name, {layout.bytes()}, 0, bytes);
    return quant::dequantize_weight(layout, bytes, at::kFloat).reshape({-1});
  }
  ParameterSource& other() override { return *storage_; }

  std::shared_ptr<ParameterSource> storage_;
};

}  // namespace

std::shared_ptr<ParameterSource> merge_base_source(
    const std::string& base_dir, const ModelConfig& config,
    const std::optional<QuantizationConfig>& run_quantization, const SourceWrap& dense_wrap) {
  const std::optional<QuantizationConfig> saved = saved_quantization(config);
  const std::optional<QuantizationConfig> q = saved ? saved : run_quantization;
  auto full_precision = [&] {
    std::shared_ptr<ParameterSource> dense = checkpoint_source(base_dir);
    return dense_wrap ? dense_wrap(std::move(dense)) : dense;
  };
  if (!q) return full_precision();
  ModelConfig four_bit = config;
  four_bit.quantization = q;
  const CausalLM placeholder(four_bit, at::TensorOptions(), /*allocate=*/false);
  auto layouts = quantized_weights(placeholder);
  std::shared_ptr<ParameterSource> storage;
  if (saved) {
    if (dense_wrap) {
      throw ConfigError(fmt::format(
          "'{}' holds 4-bit weights, but the adapter's base is computed from full-precision "
          "ones (PiSSA's residual); give the full-precision model as --base_model",
          base_dir));
    }
    storage = prequantized_source(base_dir, layouts, nullptr);
  } else {
    std::shared_ptr<ParameterSource> dense = full_precision();
    storage = quantizing_source(*dense, layouts, dense);
  }
  return std::make_shared<DequantizingSource>(std::move(storage), std::move(layouts));
}

std::optional<QuantizationConfig> saved_quantization(const ModelConfig& config) {
  if (config.source_json.empty()) return std::nullopt;
  const std::string source = config.source;
  rapidjson::Document doc = json::parse(config.source_json, source);
  if (!doc.IsObject() || !doc.HasMember("quantization_config") ||
      doc["quantization_config"].IsNull()) {
    return std::nullopt;
  }
  json::ObjectReader q(doc["quantization_config"], "quantization_config", source);
  const std::string method = q.string("quant_method").value_or("bitsandbytes");
  // A format the family's folders are read dequantized from (gpt-oss's MXFP4 experts).
  if (const std::string_view own = family_of(config).read_dequantized;
      !own.empty() && method == own) {
    return std::nullopt;
  }
  if (method != "bitsandbytes" || !q.boolean("load_in_4bit").value_or(false)) {
    throw ConfigError(fmt::format(
        "{}: quantization_config is {}{}; zerotrain reads bitsandbytes' 4-bit models only — give "
        "the full-precision model (with quantization_bit 4 to train QLoRA on it)",
        source, method, method == "bitsandbytes" ? " without load_in_4bit" : ""));
  }
  QuantizationConfig out;
  out.quant_type = q.choice("bnb_4bit_quant_type", {"nf4", "fp4"}).value_or("fp4");
  out.double_quant = q.boolean("bnb_4bit_use_double_quant").value_or(false);
  // The dtype the packed codes are stored in (FSDP's QLoRA recipe stores them as bfloat16): the
  // same bytes whichever it is (PrequantizedSource::packed_codes).
  q.choice("bnb_4bit_quant_storage", {"uint8", "bfloat16", "float16", "float32"});
  return out;
}

bool holds_packed_codes(const TensorInfo& info, const quant::FourBitLayout& layout) {
  if (info.dtype == at::kByte) return true;
  const bool storage =
      info.dtype == at::kBFloat16 || info.dtype == at::kHalf || info.dtype == at::kFloat;
  return storage && info.shape.size() == 2 && info.shape[1] == 1 && layout.cols != 1 &&
         info.numel * static_cast<int64_t>(c10::elementSize(info.dtype)) == layout.codes_bytes();
}

bool gives_quantized_storage(const ParameterSource& source) {
  return dynamic_cast<const QuantizingSource*>(&source) != nullptr ||
         dynamic_cast<const PrequantizedSource*>(&source) != nullptr;
}

bool is_quantization_part(
    const std::string& name,
    const std::map<std::string, std::shared_ptr<const quant::FourBitLayout>>& quantized) {
  for (const char* suffix : kParts) {
    const size_t n = std::char_traits<char>::length(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0 &&
        quantized.count(name.substr(0, name.size() - n)) != 0) {
      return true;
    }
  }
  return false;
}

std::shared_ptr<ParameterSource> prequantized_source(
    const std::string& path,
    std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized,
    const SourceWrap& dense_wrap) {
  return std::make_shared<PrequantizedSource>(path, std::move(quantized), dense_wrap);
}

std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> quantized_weights(
    const torch::nn::Module& model) {
  std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> out;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const Linear*>(item.value().get());
    if (linear != nullptr && linear->quantized) {
      out.emplace(item.key() + ".weight", linear->quantized);
    }
    if (const auto* experts = dynamic_cast<const MoeExperts*>(item.value().get())) {
      for (size_t i = 0; i < MoeExperts::kTensors; ++i) {
        if (experts->quantized[i]) {
          out.emplace(item.key() + "." + MoeExperts::kNames[i], experts->quantized[i]);
        }
      }
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
