// The decoder under the engine: ZeRO-3 loading that reads only each rank's slice from the
// checkpoint (the model's parameters are placeholders), with the loss transformers computed.
#include "support/catch.hpp"

#include <cstdlib>

#include "support/ranks.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

namespace {
std::string fixture(const std::string& rel) { return std::string(ZT_FIXTURES) + "/" + rel; }
}  // namespace

TEST_CASE("rank: model zero3 from checkpoint", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string dir = fixture(std::string("models/") + std::getenv("ZT_MODEL"));
  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"zero_optimization": {"stage": 3,
      "stage3_param_persistence_threshold": 100}, "optimizer": {"type": "AdamW",
      "params": {"lr": 0.001}}})");
  TrainingArguments args;
  args.lr_scheduler_type = "constant";
  resolve_config(ds, args, ResolveContext{comm->world_size(), c.hidden_size, 4});
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.source = checkpoint_source(dir);
  Engine engine(model, ds, args, comm, eo);

  // Each rank holds about 1/world of the weights (persistent norms and tied weights aside).
  EngineMemory m = engine.memory();
  const double full_bytes = 4.0 * static_cast<double>(c.parameter_count());
  INFO("compute params " << m.compute_params << " of " << full_bytes);
  CHECK(m.compute_params < full_bytes / comm->world_size() * 1.2 + (c.tie_word_embeddings ? 4.0 * c.vocab_size * c.hidden_size : 0));
  // The gathered values are the checkpoint's.
  SafetensorsCheckpoint ckpt(dir);
  for (const auto& [name, value] : engine.gather_full_parameters()) {
    INFO(name);
    CHECK(at::equal(value, ckpt.load(name)));
  }
  // Forward through gathered units gives transformers' loss.
  SafetensorsFile expected(dir + "/expected.safetensors");
  LossSum loss = model->loss(expected.load("input_ids"), expected.load("labels"),
                             expected.load("attention_mask"));
  CHECK(loss.sum.item<double>() / loss.tokens == Approx(expected.load("loss").item<double>()).epsilon(1e-5));
  engine.backward(loss.sum, static_cast<double>(loss.tokens * comm->world_size()));
  CHECK(engine.step());
  CHECK(engine.last_grad_norm() > 0);
}

TEST_CASE("model: ZeRO-3 loads each rank's slice straight from the checkpoint", "[model][engine]") {
  for (const char* model : {"llama", "qwen2"}) {
    for (int world : {1, 2}) {
      if (test::skip_cpu_world(world)) continue;
      test::run_ranks(world, "rank: model zero3 from checkpoint", std::chrono::seconds(120),
                      {{"ZT_MODEL", model}});
    }
  }
}
