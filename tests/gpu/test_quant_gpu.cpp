// The 4-bit base on the GPU: the dequantization kernels give the CPU path's bits, and a QLoRA
// model's loss and adapter gradients on the GPU match the same model's on the CPU.
#include "support/catch.hpp"

#include <ATen/ATen.h>

#include <string>

#include "model/quantized_weights.hpp"
#include "quant/four_bit_weight.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

namespace {

const at::Device kGpu(at::kCUDA, 0);

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
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
      auto model =
          std::make_shared<CausalLM>(mc, at::TensorOptions().device(at::kCPU), /*allocate=*/true);
      load_weights(*model, *checkpoint_source(fixture("models/llama")));
      apply_peft(*model, pc, 3);
      {
        at::NoGradGuard no_grad;
        at::manual_seed(5);
        for (auto& item : model->named_parameters(true)) {
          if (item.key().find("lora_B") != std::string::npos)
            item.value().add_(at::randn_like(item.value()) * 0.05);
        }
      }
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
