// Generation on the GPU: batched decoding on CUDA gives transformers' greedy completions (the
// fixtures the CPU tests read), and a sampled batch the CPU's tokens — with LoRA active and over
// a 4-bit base — since a sequence's draws come from its stream, not from the device's generator.
// Decoding steps recorded as CUDA graphs (StepGraph) give the tokens of steps run one by one.
#include "support/catch.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "model/step_graph.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

namespace {

const at::Device kGpu(at::kCUDA, 0);

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::vector<int64_t> ints(const rapidjson::Value& a) {
  std::vector<int64_t> out;
  for (const auto& v : a.GetArray()) out.push_back(v.GetInt64());
  return out;
}

// The fixture llama in fp32 on the CPU (quantized at load with `four_bit`), with LoRA adapters
// whose B factors are moved off zero when `adapted`.
std::shared_ptr<CausalLM> llama(bool four_bit, bool adapted) {
  ModelConfig mc = load_model_config(fixture("models/llama"));
  if (four_bit) mc.quantization = QuantizationConfig{};
  auto model = std::make_shared<CausalLM>(mc, at::TensorOptions().dtype(at::kFloat), true);
  load_weights(*model, *checkpoint_source(fixture("models/llama")));
  if (adapted) {
    PeftConfig pc;
    pc.type = FinetuningType::kLora;
    pc.lora.r = 4;
    pc.lora.alpha = 8;
    apply_peft(*model, pc, 3);
    at::NoGradGuard no_grad;
    at::manual_seed(5);
    for (auto& item : model->named_parameters(true)) {
      if (item.key().find("lora_B") != std::string::npos)
        item.value().add_(at::randn_like(item.value()) * 0.2);
    }
  }
  return model;
}

}  // namespace

TEST_CASE("greedy generation on CUDA gives transformers' completions", "[gpu][generate]") {
  auto model = llama(false, false);
  model->to(kGpu);
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("generation/greedy.json")), "greedy.json");
  int cases = 0;
  for (const auto& c : doc["cases"].GetArray()) {
    INFO(c["name"].GetString());
    GenerationOptions o;
    o.max_new_tokens = c["max_new_tokens"].GetInt64();
    o.eos_token_ids = ints(c["eos_token_ids"]);
    o.repetition_penalty = c["repetition_penalty"].GetDouble();
    std::vector<std::vector<int64_t>> prompts;
    for (const auto& p : c["prompts"].GetArray()) prompts.push_back(ints(p));
    const std::vector<Generated> got = model->generate_batch(prompts, o);
    REQUIRE(got.size() == prompts.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("prompt " << i);
      CHECK(got[i].tokens == ints(c["completions"][static_cast<rapidjson::SizeType>(i)]));
    }
    ++cases;
  }
  CHECK(cases >= 2);
}

TEST_CASE("a sampled batch on CUDA draws the CPU's tokens, with LoRA and over a 4-bit base",
          "[gpu][generate]") {
  const std::vector<std::vector<int64_t>> prompts = {
      {1, 17, 33, 90, 5}, {1, 44}, {1, 3, 99, 120, 7, 8, 9, 10}, {1, 70, 71}, {1, 2}};
  GenerationOptions o;
  o.max_new_tokens = 12;
  o.do_sample = true;
  o.temperature = 0.9;
  o.top_p = 0.95;
  o.top_k = 40;
  o.repetition_penalty = 1.1;
  o.seed = 21;
  const std::vector<uint64_t> streams = {3, 4, 5, 6, 7};
  for (bool four_bit : {false, true}) {
    INFO("4-bit base " << four_bit);
    std::vector<Generated> got[2];
    for (int g = 0; g < 2; ++g) {
      auto model = llama(four_bit, true);
      if (g == 1) model->to(kGpu);
      got[g] = model->generate_batch(prompts, o, streams);
    }
    REQUIRE(got[0].size() == prompts.size());
    REQUIRE(got[1].size() == prompts.size());
    size_t produced = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      INFO("prompt " << i);
      CHECK(got[1][i].tokens == got[0][i].tokens);
      CHECK(got[1][i].stopped == got[0][i].stopped);
      produced += got[0][i].tokens.size();
    }
    CHECK(produced > prompts.size());
  }
}

TEST_CASE("a recorded step replays its kernels on the buffers it was recorded with",
          "[gpu][generate]") {
  REQUIRE(model::StepGraph::records(kGpu));
  at::Tensor counter = at::zeros({4}, at::TensorOptions(at::kFloat).device(kGpu));
  at::Tensor input = at::ones({4}, counter.options());
  int host_runs = 0;
  model::StepGraph graph(kGpu, [&] {
    ++host_runs;
    counter.add_(input * 2);
  });
  graph.run();  // executed, then recorded
  CHECK(graph.recorded());
  CHECK(host_runs == 2);  // once executed, once recorded
  input.fill_(3);         // a new input in the same buffer
  graph.run();            // replayed: the host function is not called again
  graph.run();
  CHECK(host_runs == 2);
  CHECK(at::allclose(counter.cpu(), at::full({4}, 2.0 + 6 + 6)));
}

TEST_CASE("decoding recorded as CUDA graphs gives the tokens of decoding step by step",
          "[gpu][generate]") {
  // bf16, a batch whose rows finish at different steps (the batch shrinks and is recorded
  // anew), sampled: the same kernels either way, so the same tokens.
  auto model = llama(false, true);
  model->to(kGpu, at::kBFloat16);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    std::vector<int64_t> p = {1};
    for (int j = 0; j < 2 + i % 5; ++j) p.push_back(3 + (i * 7 + j * 13) % 120);
    prompts.push_back(p);
  }
  GenerationOptions o;
  o.max_new_tokens = 24;
  o.do_sample = true;
  o.temperature = 1.2;
  o.seed = 5;
  o.repetition_penalty = 1.05;
  const std::vector<Generated> free_run = model->generate_batch(prompts, o);
  // Stop tokens that end at least 7 of the 12 rows early, at different steps: the batch
  // shrinks to half and is recorded anew.
  for (size_t i = 0; i < 7; ++i) o.eos_token_ids.push_back(free_run[i].tokens[2 + i]);
  const std::vector<Generated> recorded = model->generate_batch(prompts, o);
  ::setenv("ZT_CUDA_GRAPHS", "0", 1);
  const std::vector<Generated> stepwise = model->generate_batch(prompts, o);
  ::unsetenv("ZT_CUDA_GRAPHS");
  int stopped = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt " << i);
    CHECK(recorded[i].tokens == stepwise[i].tokens);
    CHECK(recorded[i].stopped == stepwise[i].stopped);
    stopped += recorded[i].stopped ? 1 : 0;
  }
  CHECK(stopped >= 7);
}

TEST_CASE("decoding past 1,024 positions re-records each reach and gives the stepwise tokens",
          "[gpu][generate]") {
  // A step attends over the reached part of the buffer, a recording per 1,024 positions:
  // 1,100 sampled tokens a row cross a reach, recorded and step by step alike (the 8-token
  // sliding windows and sinks of gpt-oss too).
  for (const char* name : {"llama", "gpt_oss"}) {
    INFO(name);
    ModelConfig mc = load_model_config(fixture(std::string("models/") + name));
    mc.max_position_embeddings = 4096;
    auto model = std::make_shared<CausalLM>(mc, at::TensorOptions().dtype(at::kFloat), true);
    load_weights(*model, *checkpoint_source(fixture(std::string("models/") + name)));
    model->to(kGpu, at::kBFloat16);
    const std::vector<std::vector<int64_t>> prompts{{1, 5, 9, 14}, {1, 11}, {1, 3, 7}};
    GenerationOptions o;
    o.max_new_tokens = 1100;
    o.do_sample = true;
    o.seed = 11;
    const std::vector<Generated> recorded = model->generate_batch(prompts, o);
    ::setenv("ZT_CUDA_GRAPHS", "0", 1);
    const std::vector<Generated> stepwise = model->generate_batch(prompts, o);
    ::unsetenv("ZT_CUDA_GRAPHS");
    for (size_t i = 0; i < prompts.size(); ++i) {
      INFO("prompt " << i);
      CHECK(recorded[i].tokens.size() == 1100);
      CHECK(recorded[i].tokens == stepwise[i].tokens);
    }
  }
}
