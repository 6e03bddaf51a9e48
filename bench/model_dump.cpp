// zt_model_dump SHAPE DIR [SEQ]: a seeded random model of a real shape, saved as an HF folder
// (config.json + 5 GB safetensors shards, bf16), and zerotrain's hidden states after the
// embeddings and every layer (plus the final norm) for fixed inputs in DIR/zt_hidden.safetensors.
// Also times one forward + backward in bf16. The comparison with transformers is
// tests/tools/compare_hidden_states.py.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "shapes.hpp"
#include "util/device_stats.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: zt_model_dump SHAPE DIR [SEQ]\n");
    return 2;
  }
  const std::string shape = argv[1], dir = argv[2];
  const int64_t seq = argc > 3 ? std::atol(argv[3]) : 256;
  const at::Device device = at::getNumGPUs() > 0 ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  ModelConfig c = bench::shape_config(shape);
  c.dtype = at::kBFloat16;
  CausalLM model(c, at::TensorOptions().dtype(at::kBFloat16).device(device), /*allocate=*/false);
  load_weights(model, *random_source(c, 0));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << model_config_json(c);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : model.named_parameters()) tensors.emplace_back(p.key(), p.value());
  auto t0 = std::chrono::steady_clock::now();
  save_sharded_safetensors(dir, tensors);
  const double save_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  at::manual_seed(1);
  at::Tensor ids = at::randint(0, c.vocab_size, {2, seq}, at::kLong);
  std::vector<std::pair<std::string, at::Tensor>> out{{"input_ids", ids}};
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> states = model.hidden_states(ids);
    for (size_t i = 0; i < states.size(); ++i) {
      out.emplace_back(fmt::format("hidden_states.{}", i), states[i].to(at::kCPU));
    }
  }
  save_safetensors(dir + "/zt_hidden.safetensors", out);

  // One bf16 forward + backward with the chunked loss.
  device_stats::reset_peak(0);
  if (device.is_cuda()) torch::cuda::synchronize();
  t0 = std::chrono::steady_clock::now();
  LossSum loss = model.loss(ids, ids);
  (loss.sum / static_cast<double>(loss.tokens)).backward();
  if (device.is_cuda()) torch::cuda::synchronize();
  const double fb_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double grad_sq = 0;
  for (const auto& p : model.parameters())
    grad_sq += p.grad().to(at::kFloat).pow(2).sum().item<double>();
  std::printf(
      "RESULT %s\n",
      fmt::format(
          R"J({{"tool": "zt_model_dump", "shape": "{}", "params": {}, "save_s": {:.1f}, "forward_backward_s": {:.3f}, "loss": {:.4f}, "grad_norm": {:.4f}, "peak_gib": {:.1f}}})J",
          shape, c.parameter_count(), save_s, fb_s,
          loss.sum.item<double>() / static_cast<double>(loss.tokens), std::sqrt(grad_sq),
          device_stats::peak_allocated(0) / 1073741824.0)
          .c_str());
  return 0;
}
