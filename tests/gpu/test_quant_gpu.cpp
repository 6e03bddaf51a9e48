// The 4-bit base on the GPU: the dequantization kernels give the CPU path's bits, and a QLoRA
// model's loss and adapter gradients on the GPU match the same model's on the CPU.
#include "support/catch.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "model/quantized_weights.hpp"
#include "quant/four_bit_weight.hpp"
#include "util/device_stats.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

namespace {

const at::Device kGpu(at::kCUDA, 0);

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// Model `family` with its fixture weights (quantized at load when `mc` says so) and the
// adapters of `pc`, lora_B moved off zero so that they matter; on the CPU.
std::shared_ptr<CausalLM> adapted_model(const std::string& family, const ModelConfig& mc,
                                        const PeftConfig& pc) {
  auto model =
      std::make_shared<CausalLM>(mc, at::TensorOptions().device(at::kCPU), /*allocate=*/true);
  load_weights(*model, *checkpoint_source(fixture("models/" + family)));
  apply_peft(*model, pc, 3);
  at::NoGradGuard no_grad;
  at::manual_seed(5);
  for (auto& item : model->named_parameters(true)) {
    if (item.key().find("lora_B") != std::string::npos)
      item.value().add_(at::randn_like(item.value()) * 0.05);
  }
  return model;
}

}  // namespace

TEST_CASE("4-bit dequantization on the GPU gives the CPU's values bit for bit", "[gpu][quant]") {
  at::manual_seed(11);
  // 300 × 77 = 23100: a partial last block and an odd count of bytes' halves; 361 blocks: two
  // nested blocks, the second partial (the kernel a value at a time). 256 × 96: whole groups of
  // eight (the kernel eight at a time).
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape& shape : {Shape{300, 77}, Shape{256, 96}}) {
    for (const char* type : {"nf4", "fp4"}) {
      for (bool dq : {false, true}) {
        for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
          INFO(shape.rows << "x" << shape.cols << " " << type << " double " << dq << " "
                          << c10::toString(dtype));
          quant::FourBitLayout layout;
          layout.type = *quant::parse_four_bit(type);
          layout.double_quant = dq;
          layout.rows = shape.rows;
          layout.cols = shape.cols;
          const at::Tensor w = at::randn({layout.rows, layout.cols}) * 0.02;
          const at::Tensor storage = quant::quantize_weight(layout, w);
          const at::Tensor cpu = quant::dequantize_weight(layout, storage, dtype);
          const at::Tensor gpu = quant::dequantize_weight(layout, storage.to(kGpu), dtype);
          CHECK(gpu.is_cuda());
          CHECK(at::equal(cpu.view(at::kByte), gpu.cpu().contiguous().view(at::kByte)));
        }
      }
    }
  }
}

TEST_CASE("QLoRA, DoRA and PiSSA models on the GPU compute the CPU's loss and adapter gradients",
          "[gpu][quant][dora][pissa]") {
  SafetensorsFile data(fixture("models/llama/expected.safetensors"));
  const at::Tensor ids = data.load("input_ids"), labels = data.load("labels");
  const at::Tensor mask = data.load("attention_mask");
  for (const char* variant : {"qlora", "qdora", "pissa+dora"}) {
    INFO(variant);
    const std::string v = variant;
    ModelConfig mc = load_model_config(fixture("models/llama"));
    if (v != "pissa+dora") mc.quantization = QuantizationConfig{};
    PeftConfig pc;
    pc.type = FinetuningType::kLora;
    pc.lora.r = 4;
    pc.lora.alpha = 8;
    pc.lora.use_dora = v != "qlora";
    if (v == "pissa+dora") pc.lora.init_lora_weights = "pissa";
    double losses[2];
    std::vector<at::Tensor> grads[2];
    for (int g = 0; g < 2; ++g) {
      const at::Device device = g == 0 ? at::Device(at::kCPU) : kGpu;
      auto model = adapted_model("llama", mc, pc);
      model->to(device);
      LossSum loss = model->loss(ids.to(device), labels.to(device), mask.to(device));
      loss.sum.backward();
      losses[g] = loss.sum.item<double>();
      for (const auto& item : model->named_parameters(true)) {
        if (item.value().requires_grad()) grads[g].push_back(item.value().grad().cpu());
      }
    }
    // fp32 on both; the GPU's GEMMs sum in another order (TF32 stays off by default).
    CHECK(losses[1] == Approx(losses[0]).epsilon(1e-5));
    REQUIRE(grads[0].size() == grads[1].size());
    REQUIRE(!grads[0].empty());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      CHECK(at::allclose(grads[1][i], grads[0][i], 1e-3, 1e-5));
    }
  }
}

TEST_CASE(
    "DoRA with dropout on the GPU: the one-function path's loss and gradients, no dense "
    "weight kept for backward",
    "[gpu][quant][dora]") {
  // A dropout that drops nothing (p = 1e-12) takes the path of dropout in training (autograd of
  // PEFT's expression, the base's products through base_forward), p = 0 DoraLinearFunction:
  // the same loss and gradients over qwen2 (biases), dense and 4-bit, on the GPU. Over the 4-bit
  // base the dropout path's graph holds no dequantized weight until backward: what a short
  // forward keeps beyond the one-function path's is far below one dense copy of the weights.
  SafetensorsFile data(fixture("models/qwen2/expected.safetensors"));
  const at::Tensor ids = data.load("input_ids").to(kGpu), labels = data.load("labels").to(kGpu);
  const at::Tensor mask = data.load("attention_mask").to(kGpu);
  const ModelConfig base = load_model_config(fixture("models/qwen2"));
  const int64_t head_dim = base.hidden_size / base.num_attention_heads;
  const int64_t dense_bytes = 4 * base.num_hidden_layers *
                              (2 * base.hidden_size * base.num_attention_heads * head_dim +
                               2 * base.hidden_size * base.num_key_value_heads * head_dim +
                               3 * base.hidden_size * base.intermediate_size);
  for (bool four_bit : {false, true}) {
    INFO((four_bit ? "4-bit" : "dense"));
    double losses[3];
    std::vector<at::Tensor> grads[3];
    int64_t kept[2] = {0, 0};
    const double dropouts[3] = {0.0, 1e-12, 0.3};
    for (int k = 0; k < 3; ++k) {
      ModelConfig mc = base;
      if (four_bit) mc.quantization = QuantizationConfig{};
      PeftConfig pc;
      pc.type = FinetuningType::kLora;
      pc.lora.r = 4;
      pc.lora.alpha = 8;
      pc.lora.use_dora = true;
      pc.lora.dropout = dropouts[k];
      auto model = adapted_model("qwen2", mc, pc);
      model->to(kGpu);
      model->train();
      if (k < 2) {  // what a 4-token forward's graph holds
        const int64_t before = device_stats::allocated(0);
        LossSum small =
            model->loss(ids.narrow(0, 0, 1).narrow(1, 0, 4), labels.narrow(0, 0, 1).narrow(1, 0, 4),
                        mask.narrow(0, 0, 1).narrow(1, 0, 4));
        kept[k] = device_stats::allocated(0) - before;
      }
      at::manual_seed(11);
      LossSum loss = model->loss(ids, labels, mask);
      loss.sum.backward();
      losses[k] = loss.sum.item<double>();
      for (const auto& item : model->named_parameters(true)) {
        if (item.value().requires_grad()) grads[k].push_back(item.value().grad().cpu());
      }
    }
    CHECK(losses[1] == Approx(losses[0]).epsilon(1e-5));
    REQUIRE(grads[0].size() == grads[1].size());
    REQUIRE(!grads[0].empty());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      CHECK(at::allclose(grads[1][i], grads[0][i], 1e-3, 1e-5));
    }
    // A real dropout changes the loss, and trains (finite gradients).
    CHECK(std::isfinite(losses[2]));
    CHECK(losses[2] != Approx(losses[0]).epsilon(1e-4));
    for (const at::Tensor& g : grads[2]) CHECK(at::isfinite(g).all().item<bool>());
    if (four_bit) {
      INFO("kept by the dropout path " << kept[1] << " B, by the one-function path " << kept[0]
                                       << " B; one dense copy " << dense_bytes << " B");
      CHECK(kept[1] - kept[0] < dense_bytes / 2);
    }
  }
}
