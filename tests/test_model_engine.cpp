// The decoder under the engine: ZeRO-3 loading that reads only each rank's slice from the
// checkpoint (the model's parameters are placeholders), with the loss transformers computed;
// recomputed layers (activation checkpointing, ZeRO-3) train as the plain model does.
#include "support/catch.hpp"

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "model/quantized_weights.hpp"
#include "support/ranks.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;

namespace {
std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// Matrix products run while a CountProducts lives (aten::mm, aten::addmm, aten::addmm_; any
// thread): how much a recomputation recomputes.
std::atomic<int64_t> products{0};

struct CountProducts {
  CountProducts() {
    products = 0;
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                       -> std::unique_ptr<at::ObserverContext> {
          const char* name = fn.name();
          if (std::strcmp(name, "aten::mm") == 0 || std::strcmp(name, "aten::addmm") == 0 ||
              std::strcmp(name, "aten::addmm_") == 0) {
            ++products;
          }
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~CountProducts() { at::removeCallback(handle); }
  at::CallbackHandle handle;
};
// A ZeRO-3 engine over `model` (placeholders) that reads each rank's slices of the checkpoint
// at `dir`, sharding all but the smallest parameters (persistence threshold 100 elements).
Engine zero3_engine(const std::shared_ptr<Communicator>& comm,
                    const std::shared_ptr<CausalLM>& model, const ModelConfig& c,
                    const std::string& dir) {
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
  return Engine(model, ds, comm, eo);
}

}  // namespace

TEST_CASE("rank: model zero3 from checkpoint", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const std::string dir = fixture(std::string("models/") + std::getenv("ZT_MODEL"));
  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
  Engine engine = zero3_engine(comm, model, c, dir);

  // Each rank holds about 1/world of the weights (persistent norms and tied weights aside).
  EngineMemory m = engine.memory();
  const double full_bytes = 4.0 * static_cast<double>(c.parameter_count());
  INFO("compute params " << m.compute_params << " of " << full_bytes);
  CHECK(m.compute_params < full_bytes / comm->world_size() * 1.2 +
                               (c.tie_word_embeddings ? 4.0 * c.vocab_size * c.hidden_size : 0));
  // The gathered values are the checkpoint's (read whole, under the names the file gives them:
  // a multimodal folder's original layout).
  std::shared_ptr<ParameterSource> whole = checkpoint_source(dir);
  for (const auto& [name, value] : engine.gather_full_parameters()) {
    INFO(name);
    at::Tensor want = at::empty(value.sizes(), value.options());
    whole->read(name, value.sizes().vec(), 0, want);
    CHECK(at::equal(value, want));
  }
  // Forward through gathered units gives transformers' loss.
  SafetensorsFile expected(dir + "/expected.safetensors");
  LossSum loss = model->loss(expected.load("input_ids"), expected.load("labels"),
                             expected.load("attention_mask"));
  CHECK(loss.sum.item<double>() / loss.tokens ==
        Approx(expected.load("loss").item<double>()).epsilon(1e-5));
  engine.backward(loss.sum, static_cast<double>(loss.tokens * comm->world_size()));
  CHECK(engine.step());
  CHECK(engine.last_grad_norm() > 0);
}

TEST_CASE("rank: model zero3 held generation", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const int rank = comm->rank();
  const std::string dir = fixture("models/llama");
  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
  Engine engine = zero3_engine(comm, model, c, dir);
  // The same model whole, outside any engine: the generation it gives.
  auto whole = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
  load_weights(*whole, *checkpoint_source(dir));
  GenerationOptions g;
  g.max_new_tokens = 3 + 4 * rank;  // the ranks decode different numbers of tokens
  const std::vector<std::vector<int64_t>> prompts = {{5, 9, 13}, {7, 2}};
  const std::vector<Generated> want = whole->generate_batch(prompts, g, {0, 1});

  engine.hold_units();
  const int64_t held = engine.memory().gathered_now;
  CHECK(held > 0);
  model->eval();
  // The decode loop calls the layers directly, not through their gates: without the hold their
  // parameters would be released placeholders. Nothing is gathered per token, so the ranks'
  // different token counts need no agreement.
  const std::vector<Generated> got = model->generate_batch(prompts, g, {0, 1});
  CHECK(engine.memory().gathered_now == held);
  SafetensorsFile expected(dir + "/expected.safetensors");
  {
    // A gated forward without gradients while held (a reference's) releases nothing either.
    at::NoGradGuard no_grad;
    LossSum held_loss = model->loss(expected.load("input_ids"), expected.load("labels"),
                                    expected.load("attention_mask"));
    CHECK(held_loss.sum.item<double>() / held_loss.tokens ==
          Approx(expected.load("loss").item<double>()).epsilon(1e-5));
    CHECK(engine.memory().gathered_now == held);
  }
  engine.release_units();
  CHECK(engine.memory().gathered_now == 0);
  engine.release_units();  // a second release is a no-op
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("row " << i << " on rank " << rank);
    CHECK(got[i].tokens == want[i].tokens);
    CHECK(got[i].tokens.size() == static_cast<size_t>(g.max_new_tokens));
  }
  // Training forwards gather unit by unit again afterwards.
  model->train();
  LossSum loss = model->loss(expected.load("input_ids"), expected.load("labels"),
                             expected.load("attention_mask"));
  CHECK(loss.sum.item<double>() / loss.tokens ==
        Approx(expected.load("loss").item<double>()).epsilon(1e-5));
  engine.backward(loss.sum, static_cast<double>(loss.tokens * comm->world_size()));
  CHECK_THROWS_WITH(engine.hold_units(), Catch::Contains("between backward() and step()"));
  CHECK(engine.step());
}

TEST_CASE("model: ZeRO-3 generation holds the gathered units, so ranks decode apart",
          "[model][engine]") {
  for (int world : {2, 4}) {
    if (test::skip_cpu_world(world)) continue;
    test::run_ranks(world, "rank: model zero3 held generation", std::chrono::seconds(120));
  }
}

TEST_CASE("model: ZeRO-3 loads each rank's slice straight from the checkpoint", "[model][engine]") {
  // chatglm: ChatGLM's own module tree (query_key_value, dense_h_to_4h, output_layer); gemma3
  // and mistral3: multimodal folders in their original layout, each rank's slices of the text
  // decoder read by their stored names.
  for (const char* model : {"llama", "qwen2", "chatglm", "gemma3", "mistral3"}) {
    for (int world : {1, 2}) {
      if (test::skip_cpu_world(world)) continue;
      test::run_ranks(world, "rank: model zero3 from checkpoint", std::chrono::seconds(120),
                      {{"ZT_MODEL", model}});
    }
  }
}

// Steps of the fixture model, on this rank's half of the fixture batch: the grad norms and
// the weights after them. Recomputation in backward (checkpointing, stage 3) skips the layers'
// output projections (a layer keeps its sum after attention for it, zt::keep_for_recompute) and
// must not change either. ZT_LORA=1: with LoRA on every projection (the adapters' own
// functions, whose recomputation computes only the [tokens, r] activations), three steps, as
// lora_B starts at zero. What a checkpointed layer recomputes is counted in matrix products:
// q, k, v, gate and up (5), and with LoRA also every adapter's A product (7) and the B
// products accumulating into the five computed outputs (5) — not o_proj or down_proj. Where
// the engine has room for them (EngineOptions::recompute_keep_bytes), a layer also keeps its
// MLP's gate and up outputs, and its recomputation skips their products (2, with LoRA 4): every
// layer with room for all, one layer a step with room for one. ZT_MODEL=chatglm: ChatGLM's
// layout, one product for q/k/v and one for gate and up (dense_h_to_4h), so a layer recomputes
// 2 products, 1 while it keeps. ZT_QLORA=1: LoRA over a 4-bit base (NF4, double quantization),
// whose recomputation counts the same products and skips the same ones when it keeps (the
// dequantizations are no products). With EngineOptions::offload_activations the layers' inputs
// and kept sums wait in host memory (as much as all layers' at once, on the CPU too) and nothing
// else changes.
TEST_CASE("rank: model recomputation", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const bool glm =
      std::getenv("ZT_MODEL") != nullptr && std::string(std::getenv("ZT_MODEL")) == "chatglm";
  const std::string dir = fixture(glm ? "models/chatglm" : "models/qwen2");
  const bool qlora =
      std::getenv("ZT_QLORA") != nullptr && std::string(std::getenv("ZT_QLORA")) == "1";
  const bool lora =
      qlora || (std::getenv("ZT_LORA") != nullptr && std::string(std::getenv("ZT_LORA")) == "1");
  REQUIRE(!(glm && lora));  // the product counts below are for ChatGLM without adapters
  SafetensorsFile expected(dir + "/expected.safetensors");
  at::Tensor ids = expected.load("input_ids"), labels = expected.load("labels"),
             mask = expected.load("attention_mask");
  const int64_t rows = ids.size(0) / comm->world_size(), first = rows * comm->rank();
  const int steps = lora ? 3 : 2;
  struct Run {
    std::vector<double> norms;  ///< per step
    std::vector<std::pair<std::string, at::Tensor>> params;
    double products = 0;  ///< matrix products over all steps
    int64_t host_activations_peak = 0;
    double layer_forward = 0;  ///< products of one layer's forward (the plain run only)
    double head_forward = 0;   ///< of the head's forward without gradients (the plain run only)
  };
  const auto layers_of = [](const std::string& d) {
    return load_model_config(d).num_hidden_layers;
  };
  auto train = [&](int stage, bool checkpointing, int64_t keep_bytes, bool offload,
                   int64_t span = 1, int64_t host_limit = 0) {
    ModelConfig mc = load_model_config(dir);
    if (qlora) mc.quantization = QuantizationConfig{};  // NF4 with double quantization
    auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), /*allocate=*/false);
    EngineOptions eo;
    eo.source = checkpoint_source(dir);
    if (qlora) {
      eo.source = model::quantizing_source(*eo.source, model::quantized_weights(*model), eo.source);
    }
    if (lora) {
      PeftConfig pc;
      pc.type = FinetuningType::kLora;
      pc.lora.r = 4;
      pc.lora.alpha = 8;
      apply_peft(*model, pc, 3);
      eo.source = with_adapter_values(eo.source, *model);
    }
    DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
        R"({{"zero_optimization": {{"stage": {}, "stage3_param_persistence_threshold": 10}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}})",
        stage));
    TrainingArguments args;
    args.lr_scheduler_type = "constant";
    resolve_config(ds, args, ResolveContext{comm->world_size(), 64, 4});
    eo.units = model->units();
    eo.gate = &model->gate();
    eo.activation_checkpointing = checkpointing;
    eo.recompute_keep_bytes = keep_bytes;
    eo.offload_activations = offload;
    eo.units_per_checkpoint = span;
    eo.offload_activations_host_bytes = host_limit;
    Engine engine(model, ds, comm, eo);
    Run run;
    if (stage == 0 && !checkpointing) {  // the products of one layer's and the head's forwards
      at::NoGradGuard no_grad;
      double layers_forward = 0;
      {
        CountProducts count;
        model->hidden_states(ids.narrow(0, first, rows), mask.narrow(0, first, rows));
        layers_forward = static_cast<double>(products.load());
      }
      CountProducts count;
      model->loss(ids.narrow(0, first, rows), labels.narrow(0, first, rows),
                  mask.narrow(0, first, rows));
      run.layer_forward = layers_forward / static_cast<double>(layers_of(dir));
      run.head_forward = static_cast<double>(products.load()) - layers_forward;
    }
    CountProducts count;
    for (int step = 0; step < steps; ++step) {
      LossSum loss = model->loss(ids.narrow(0, first, rows), labels.narrow(0, first, rows),
                                 mask.narrow(0, first, rows));
      engine.backward(loss.sum, 1.0);
      REQUIRE(engine.step());
      run.norms.push_back(engine.last_grad_norm());
    }
    run.products = static_cast<double>(products.load());
    run.params = engine.gather_full_parameters();
    run.host_activations_peak = engine.memory().host_activations_peak;
    return run;
  };
  // The default (EngineOptions::kAutoKeep) keeps nothing beyond need on the CPU.
  const Run plain_run = train(0, false, EngineOptions::kAutoKeep, false);
  const auto& plain_norms = plain_run.norms;
  const auto& plain = plain_run.params;
  const double plain_products = plain_run.products;
  const ModelConfig config = load_model_config(dir);
  const int64_t layers = config.num_hidden_layers;
  // One layer's gate and up outputs (fp32), and a budget with room for one but not two.
  const int64_t layer_bytes = 2 * rows * ids.size(1) * config.intermediate_size * 4;
  const int64_t all = std::numeric_limits<int64_t>::max() / 2, one = layer_bytes * 3 / 2;
  struct Case {
    int stage;
    bool checkpointing;
    int64_t keep;
    int64_t kept_layers;  ///< per step, when checkpointing
    bool offload = false;
    int64_t span = 1;         ///< EngineOptions::units_per_checkpoint
    int64_t host_layers = 0;  ///< the host budget in layer inputs (0: the default)
  };
  // Layer inputs fill the host budget exactly (a CPU rank counts them unrounded).
  const int64_t layer_input = rows * ids.size(1) * config.hidden_size * 4;
  for (const Case& c :
       {Case{0, true, EngineOptions::kAutoKeep, 0}, Case{2, true, 0, 0},
        Case{3, false, EngineOptions::kAutoKeep, 0}, Case{0, true, all, layers},
        Case{2, true, one, 1}, Case{3, false, all, 0}, Case{0, true, all, layers, true},
        Case{2, true, one, 1, true}, Case{3, false, EngineOptions::kAutoKeep, 0, true},
        Case{0, true, 0, 0, false, 2}, Case{2, true, one, 0, true, 2},
        Case{3, false, 0, 0, false, layers}, Case{3, false, 0, 0, true, 2},
        Case{0, true, 0, 0, true, 1, 3}, Case{2, true, 0, 0, true, 2, 1}}) {
    INFO("stage " << c.stage << (c.checkpointing ? ", checkpointing" : "")
                  << (c.offload ? ", offloaded" : "") << ", units per checkpoint " << c.span
                  << ", host budget " << c.host_layers << " layer inputs"
                  << (qlora  ? ", QLoRA"
                      : lora ? ", LoRA"
                             : "")
                  << ", keep budget " << c.keep);
    const Run run =
        train(c.stage, c.checkpointing, c.keep, c.offload, c.span, c.host_layers * layer_input);
    // The recomputed units in order — with stage 3 at several ranks the embeddings and the head
    // too — and their places in their spans: a unit whose activation input is the unit before's
    // output continues its span while the span has room; one without an activation input (the
    // embeddings' ids; with adapters the first layer, whose input from the frozen embeddings
    // needs no gradient — unless the embeddings are a unit call too, whose outputs always do)
    // starts one. What waits on the host, [rows, seq, hidden] fp32 each, all
    // at once: the activation input of each span's first unit, and with spans of one each
    // layer's sum after attention (with longer spans nothing is kept). Within a host budget: as
    // many as it holds, the rest stay on the device.
    const bool recomputed = c.checkpointing || comm->world_size() > 1;
    // With spans of several units every unit is recomputed: the embeddings and the head too.
    const bool all_units = recomputed && ((c.stage == 3 && comm->world_size() > 1) || c.span > 1);
    std::vector<char> units;  // 'e'mbeddings, 'l'ayer, 'h'ead
    if (all_units) units.push_back('e');
    units.insert(units.end(), static_cast<size_t>(layers), 'l');
    if (all_units) units.push_back('h');
    int64_t on_host = c.span > 1 ? 0 : layers, rebuilt = 0, place = 0;
    for (size_t k = 0; k < units.size(); ++k) {
      const bool takes_activation =
          units[k] == 'h' ||
          (units[k] == 'l' && (!lora || all_units || (k > 0 && units[k - 1] == 'l')));
      place = takes_activation && k > 0 && place + 1 < c.span ? place + 1 : 0;
      if (place == 0 && takes_activation) ++on_host;
      // A unit at place p runs the p before it again: a layer's forward each.
      for (size_t j = k - static_cast<size_t>(place); j < k; ++j) rebuilt += units[j] == 'l';
    }
    if (c.offload && recomputed) {
      CHECK(run.host_activations_peak ==
            std::min(on_host, c.host_layers > 0 ? c.host_layers : on_host) * layer_input);
    } else {
      CHECK(run.host_activations_peak == 0);
    }
    const auto& norms = run.norms;
    const auto& params = run.params;
    const double products_run = run.products;
    if (c.checkpointing) {
      const int64_t per_layer = glm ? 2 : lora ? 17 : 5, kept_products = glm ? 1 : lora ? 4 : 2;
      double recomputed_products =
          static_cast<double>(layers * per_layer - c.kept_layers * kept_products);
      if (c.span > 1) {
        // Nothing kept: a layer recomputes its whole forward but the down projection's products
        // (the base's, and with LoRA its B's), and runs the layers before it in its span again,
        // whole, to rebuild its input. The head's first pass computes its logits' products
        // once more (its recomputation forms the gradients as the plain forward does); with
        // adapters the first layer's input, now a recomputed unit's output, gets a gradient:
        // the base and A products of q, k and v back to it (past them the layer's sums needed
        // gradients already).
        REQUIRE(plain_run.layer_forward > 0);
        recomputed_products =
            static_cast<double>(layers) * (plain_run.layer_forward - (lora ? 2 : 1)) +
            static_cast<double>(rebuilt) * plain_run.layer_forward + plain_run.head_forward +
            (lora ? 2 * 3 : 0);
      }
      CHECK(products_run - plain_products == static_cast<double>(steps) * recomputed_products);
    }
    // fp32 noise: the engine equivalence tests' tolerance (stage 3 sums its norm in another order).
    for (size_t i = 0; i < norms.size(); ++i)
      CHECK(norms[i] == Approx(plain_norms[i]).epsilon(2e-5));
    REQUIRE(params.size() == plain.size());
    for (size_t i = 0; i < params.size(); ++i) {
      INFO(params[i].first);
      CHECK((params[i].second - plain[i].second).abs().max().item<double>() < 1e-6);
    }
  }
}

TEST_CASE("model: layers recomputed in backward train as the plain model does", "[model][engine]") {
  for (int world : {1, 2}) {
    if (test::skip_cpu_world(world)) continue;
    for (const char* lora : {"0", "1"}) {
      test::run_ranks(world, "rank: model recomputation", std::chrono::seconds(180),
                      {{"ZT_LORA", lora}});
    }
    test::run_ranks(world, "rank: model recomputation", std::chrono::seconds(180),
                    {{"ZT_QLORA", "1"}});
    test::run_ranks(world, "rank: model recomputation", std::chrono::seconds(180),
                    {{"ZT_MODEL", "chatglm"}});
  }
}
