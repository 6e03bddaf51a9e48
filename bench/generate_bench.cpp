// Generation throughput of CausalLM::generate_batch on a real model shape (random bf16
// weights on the GPU), printed as `RESULT {json}` to set beside bench/tools/hf_generate.py
// (transformers' `generate`, the same shape, batch and lengths) in the same run.
//
//   zt_bench_generate SHAPE BATCH PROMPT_TOKENS NEW_TOKENS [LORA_R]
//
// Sampling at temperature 1 with no stop token, so every sequence produces NEW_TOKENS tokens;
// prompts are random ids of PROMPT_TOKENS tokens. LORA_R > 0 adds LoRA adapters of that rank on
// all linear layers (with non-zero B), active and unmerged, as GRPO generates. tokens_per_s
// counts the new tokens of the whole batch over the timed run (after one warm-up generation).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "shapes.hpp"
#include "util/device_stats.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: zt_bench_generate SHAPE BATCH PROMPT_TOKENS NEW_TOKENS [LORA_R]\n");
    return 2;
  }
  const std::string shape = argv[1];
  const int64_t batch = std::atoll(argv[2]), prompt = std::atoll(argv[3]),
                fresh = std::atoll(argv[4]);
  const int64_t lora_r = argc > 5 ? std::atoll(argv[5]) : 0;
  const bool cuda = torch::cuda::is_available();
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  ModelConfig c = bench::shape_config(shape);
  auto model = std::make_shared<CausalLM>(
      c, at::TensorOptions().dtype(cuda ? at::kBFloat16 : at::kFloat).device(device), false);
  load_weights(*model, *random_source(c, 0));
  if (lora_r > 0) {
    PeftConfig peft;
    peft.type = FinetuningType::kLora;
    peft.lora.r = lora_r;
    peft.lora.alpha = 2.0 * static_cast<double>(lora_r);
    peft.lora.target_modules = {"all-linear"};
    apply_peft(*model, peft, 1);
    at::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.01);
    }
  }
  model->eval();
  at::Tensor ids = at::randint(3, c.vocab_size - 1, {batch, prompt}, at::kLong);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t* row = ids[r].data_ptr<int64_t>();
    prompts.emplace_back(row, row + prompt);
  }
  GenerationOptions o;
  o.do_sample = true;
  o.max_new_tokens = fresh;
  o.seed = 1;
  const auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  {  // warm-up: a short run of the same batch
    GenerationOptions w = o;
    w.max_new_tokens = std::min<int64_t>(fresh, 8);
    model->generate_batch(prompts, w);
  }
  sync();
  if (cuda) device_stats::reset_peak(0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<Generated> out = model->generate_batch(prompts, o);
  sync();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t produced = 0;
  for (const Generated& g : out) produced += static_cast<int64_t>(g.tokens.size());
  std::printf(
      "RESULT {\"impl\": \"zerotrain\", \"shape\": \"%s\", \"batch\": %lld, \"prompt\": %lld, "
      "\"new\": %lld, \"lora_r\": %lld, \"tokens\": %lld, \"seconds\": %.4f, \"tokens_per_s\": "
      "%.1f, \"peak_gib\": %.2f}\n",
      shape.c_str(), static_cast<long long>(batch), static_cast<long long>(prompt),
      static_cast<long long>(fresh), static_cast<long long>(lora_r),
      static_cast<long long>(produced), s, static_cast<double>(produced) / s,
      static_cast<double>(cuda ? device_stats::peak_allocated(0) : 0) / (1024.0 * 1024.0 * 1024.0));
  return 0;
}
