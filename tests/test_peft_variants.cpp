// DoRA and PiSSA: adapters PEFT 0.21 made (tests/tools/make_fixtures.py variants) give PEFT's
// starts, logits, loss and gradients in zerotrain; PiSSA converts to PEFT's plain LoRA; both
// work over a 4-bit base as over its dequantized values; and the engine's sources start them
// where attach_adapter does, at world 1, 2 and 4 under ZeRO stages 0 and 3 (with offload).
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <torch/optim/adamw.h>

#include "model/layers.hpp"
#include "model/quantized_weights.hpp"
#include "peft/init_sources.hpp"
#include "peft/pissa.hpp"
#include "quant/four_bit_weight.hpp"
#include "support/catch.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;
using Catch::Contains;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::shared_ptr<CausalLM> base_model(const std::string& family,
                                     std::optional<QuantizationConfig> q = std::nullopt) {
  ModelConfig c = load_model_config(fixture("models/" + family));
  c.quantization = q;
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions(), true);
  load_weights(*m, *checkpoint_source(fixture("models/" + family)));
  return m;
}

// Every parameter of `model` read from `source` as the engine reads them (load_weights would
// quantize a 4-bit model's projections again: this source gives their storage already).
void load_from(CausalLM& model, ParameterSource& source) {
  at::NoGradGuard no_grad;
  for (auto& item : model.named_parameters(true)) {
    at::Tensor p = item.value();
    if (!p.is_contiguous()) p.set_data(at::empty(p.sizes(), p.options()));
    source.read(item.key(), p.sizes().vec(), 0, p);
  }
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

double max_abs_real(const at::Tensor& got, const at::Tensor& want, const at::Tensor& mask) {
  const at::Tensor keep = mask.to(at::kBool).unsqueeze(-1);
  return (got - want).abs().masked_fill(keep.logical_not(), 0).max().item<double>();
}

// Row i of PiSSA's A (column i of B) is a singular pair up to its sign, which LAPACKs choose
// differently: `got` with each row's sign turned to agree with `want`'s.
at::Tensor rows_signed_as(const at::Tensor& got, const at::Tensor& want) {
  return got * (got * want).sum(1, true).sign();
}

// The loss over the fixture's inputs in train mode, backward run; the model's trainable
// gradients compared with PEFT's "grad.<name>", relative to each gradient's size.
void check_gradients(CausalLM& model, SafetensorsFile& expected, double tolerance) {
  model.train();
  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
  const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
  LossSum loss = model.loss(ids, expected.load("labels"), mask);
  (loss.sum / static_cast<double>(loss.tokens)).backward();
  int compared = 0;
  for (const auto& item : model.named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    INFO(item.key());
    const std::string key = "grad." + item.key();
    REQUIRE(expected.contains(key));
    const at::Tensor want = expected.load(key);
    REQUIRE(item.value().grad().defined());
    const double scale = std::max(want.abs().max().item<double>(), 1e-6);
    CHECK(max_abs(item.value().grad(), want) / scale < tolerance);
    ++compared;
  }
  CHECK(compared > 0);
  model.eval();
}

// The DoRA adapter these tests train: r 4, alpha 8, every projection.
PeftConfig dora_config() {
  PeftConfig config;
  config.type = FinetuningType::kLora;
  config.lora.r = 4;
  config.lora.alpha = 8;
  config.lora.use_dora = true;
  return config;
}

}  // namespace

TEST_CASE("DoRA adapters PEFT made give PEFT's start, logits, loss and gradients",
          "[peft][dora][parity]") {
  for (const auto& [name, family] : {std::pair<std::string, std::string>{"dora_llama", "llama"},
                                     {"dora_qwen2_all_linear", "qwen2"}}) {
    INFO(name);
    const std::string dir = fixture("peft/" + name);
    const PeftConfig config = load_adapter_config(dir);
    REQUIRE(config.lora.use_dora);
    // The start: each magnitude is its weight's row norms.
    {
      auto fresh = base_model(family);
      apply_peft(*fresh, config, 1);
      SafetensorsFile start(dir + "/start.safetensors");
      int magnitudes = 0;
      for (const auto& item : fresh->named_parameters(true)) {
        if (item.key().find("lora_magnitude_vector") == std::string::npos) continue;
        INFO(item.key());
        REQUIRE(start.contains(item.key()));
        CHECK(max_abs(item.value(), start.load(item.key())) < 1e-5);
        ++magnitudes;
      }
      CHECK(magnitudes == static_cast<int>(start.names().size()));
    }
    auto model = base_model(family);
    load_adapter(*model, dir, /*trainable=*/true);
    SafetensorsFile expected(dir + "/expected.safetensors");
    const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    {
      at::NoGradGuard no_grad;
      model->eval();
      CHECK(max_abs_real(model->logits(ids, mask), expected.load("logits"), mask) < 2e-5);
      LossSum loss = model->loss(ids, expected.load("labels"), mask);
      CHECK(loss.sum.item<double>() / loss.tokens ==
            Approx(expected.load("loss").item<double>()).epsilon(1e-5));
    }
    check_gradients(*model, expected, 1e-4);
    // Merged, the model computes the same; unmerged, the base is back.
    const at::Tensor before = model->logits(ids, mask).detach();
    const at::Tensor q =
        model->named_parameters()["model.layers.0.self_attn.q_proj.weight"].clone();
    merge_lora(*model);
    CHECK(max_abs_real(model->logits(ids, mask).detach(), before, mask) < 2e-5);
    unmerge_lora(*model);
    CHECK(max_abs(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"], q) < 1e-5);
  }
}

TEST_CASE("PiSSA adapters PEFT made: the same factors and residual, logits and gradients",
          "[peft][pissa][parity]") {
  const std::string dir = fixture("peft/pissa_llama");
  const PeftConfig config = load_adapter_config(dir);
  REQUIRE(config.lora.init_lora_weights == "pissa");
  SafetensorsFile start(dir + "/start.safetensors");
  {
    auto fresh = base_model("llama");
    apply_peft(*fresh, config, 1);
    int compared = 0;
    for (const auto& item : fresh->named_parameters(true)) {
      if (!start.contains(item.key())) continue;
      INFO(item.key());
      at::Tensor got = item.value().detach(), want = start.load(item.key());
      if (item.key().find("lora_A") != std::string::npos) got = rows_signed_as(got, want);
      if (item.key().find("lora_B") != std::string::npos)
        got = rows_signed_as(got.t(), want.t()).t();
      CHECK(max_abs(got, want) < 2e-5);
      ++compared;
    }
    CHECK(compared == static_cast<int>(start.names().size()));
  }
  // PEFT's file says init_lora_weights "pissa": loading it over the original base decomposes the
  // base again (the residual) and takes the trained factors from the file, as PEFT does.
  auto model = base_model("llama");
  load_adapter(*model, dir, /*trainable=*/true);
  SafetensorsFile expected(dir + "/expected.safetensors");
  const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
  {
    at::NoGradGuard no_grad;
    model->eval();
    CHECK(max_abs_real(model->logits(ids, mask), expected.load("logits"), mask) < 1e-4);
  }
  check_gradients(*model, expected, 1e-3);

  // PEFT's conversion to plain LoRA (rank 2r over the original base): the same tensors and
  // config from the same trained factors and pissa_init folder.
  const std::string out = test::temp_dir("pissa_converted");
  std::vector<std::pair<std::string, at::Tensor>> trained;
  for (const auto& item : model->named_parameters(true)) {
    if (item.value().requires_grad()) trained.emplace_back(item.key(), item.value().detach());
  }
  peft::save_pissa_converted(*model, config, dir + "/pissa_init", out, trained);
  SafetensorsFile ours(out + "/adapter_model.safetensors"),
      theirs(dir + "/pissa_converted/adapter_model.safetensors");
  const std::vector<std::string> our_names = ours.names(), their_names = theirs.names();
  CHECK(std::set<std::string>(our_names.begin(), our_names.end()) ==
        std::set<std::string>(their_names.begin(), their_names.end()));
  for (const std::string& key : theirs.names()) {
    INFO(key);
    CHECK(max_abs(ours.load(key), theirs.load(key)) < 1e-6);
  }
  const PeftConfig plain = load_adapter_config(out);
  const PeftConfig peft_plain = load_adapter_config(dir + "/pissa_converted");
  CHECK(plain.lora.r == peft_plain.lora.r);
  CHECK(plain.lora.alpha == peft_plain.lora.alpha);
  CHECK(plain.lora.init_lora_weights == "true");
  // Over the original base the converted adapter gives the PiSSA model's logits.
  auto converted = base_model("llama");
  load_adapter(*converted, out, false);
  at::NoGradGuard no_grad;
  CHECK(max_abs_real(converted->logits(ids, mask), expected.load("logits"), mask) < 1e-4);
  // A pissa_init folder of another run is refused, naming the file.
  const std::string other = test::temp_dir("other_init");
  std::filesystem::copy(dir + "/pissa_init/adapter_config.json", other + "/adapter_config.json");
  save_safetensors(other + "/adapter_model.safetensors", {{"x", at::zeros({1})}});
  CHECK_THROWS_WITH(peft::save_pissa_converted(*model, config, other, out + "2", trained),
                    Contains("adapter_model.safetensors") && Contains("lacks"));
}

TEST_CASE("PiSSA's randomized SVD: a residual that adds back to the weight, near the full SVD",
          "[peft][pissa]") {
  // A weight of rank 4 plus noise: 2 subspace iterations find its top 4 directions.
  at::manual_seed(3);
  const at::Tensor w = at::mm(at::randn({40, 4}), at::randn({4, 24})) + 0.01 * at::randn({40, 24});
  const double scaling = 2.0;
  const peft::PissaFactors full =
      peft::pissa_factors(w, 4, scaling, -1, at::detail::createCPUGenerator(1));
  const peft::PissaFactors fast =
      peft::pissa_factors(w, 4, scaling, 2, at::detail::createCPUGenerator(1));
  for (const peft::PissaFactors* f : {&full, &fast}) {
    CHECK(max_abs(f->residual + at::mm(f->lora_B * scaling, f->lora_A), w) < 1e-4);
  }
  CHECK(max_abs(at::mm(fast.lora_B, fast.lora_A), at::mm(full.lora_B, full.lora_A)) < 1e-3);
  // The same generator seed draws the same start: every rank decomposes alike.
  const peft::PissaFactors again =
      peft::pissa_factors(w, 4, scaling, 2, at::detail::createCPUGenerator(1));
  CHECK(at::equal(again.lora_A, fast.lora_A));
  CHECK_THROWS_WITH(peft::pissa_factors(w, 25, scaling, -1, at::detail::createCPUGenerator(1)),
                    Contains("lora_r 25"));
  // PEFT's spellings: accepted, refused.
  CHECK(peft::canonical_init("pissa_niter_16") == std::optional<std::string>("pissa_niter_16"));
  CHECK(peft::canonical_init("gaussian") == std::optional<std::string>("true"));
  CHECK_FALSE(peft::canonical_init("olora"));
  CHECK(peft::pissa_iterations("pissa") == -1);
  CHECK(peft::pissa_iterations("pissa_niter_7") == 7);
  CHECK_FALSE(peft::pissa_iterations("true"));
}

TEST_CASE("DoRA and PiSSA over a 4-bit base compute what they do over its dequantized values",
          "[peft][dora][pissa][quant]") {
  QuantizationConfig q;  // nf4, double quantization
  for (const char* init : {"true", "pissa_niter_2"}) {
    INFO(init);
    PeftConfig config = dora_config();
    config.lora.init_lora_weights = init;
    // The 4-bit model built as the trainer builds it: sources start the adapters (PiSSA's
    // residual quantized), then the dense model holding exactly those dequantized values.
    ModelConfig mc = load_model_config(fixture("models/llama"));
    mc.quantization = q;
    auto four = std::make_shared<CausalLM>(mc, at::TensorOptions(), /*allocate=*/false);
    apply_peft(*four, config, 3);
    std::shared_ptr<ParameterSource> source = checkpoint_source(fixture("models/llama"));
    source = peft::pissa_source(source, *four, config.lora, 3, at::kCPU, true);
    source = model::quantizing_source(*source, model::quantized_weights(*four), source);
    source = peft::dora_source(source, *four, config.lora);
    load_from(*four, *with_adapter_values(source, *four));
    auto dense = std::make_shared<CausalLM>(load_model_config(fixture("models/llama")),
                                            at::TensorOptions(), true);
    PeftConfig plain_start = config;
    plain_start.lora.init_lora_weights = "true";
    load_weights(*dense, *checkpoint_source(fixture("models/llama")));
    apply_peft(*dense, plain_start, 3);
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, layout] : model::quantized_weights(*four)) {
        dense->named_parameters(true)[name].copy_(
            quant::dequantize_weight(*layout, four->named_parameters(true)[name], at::kFloat));
      }
      at::manual_seed(5);
      for (auto& item : four->named_parameters(true)) {
        if (item.key().find("lora_B") != std::string::npos)
          item.value().add_(at::randn_like(item.value()) * 0.05);
        if (item.value().requires_grad())
          dense->named_parameters(true)[item.key()].copy_(item.value());
      }
    }
    // DoRA's magnitude started at the norms of the weights it trains over (the 4-bit ones).
    for (const auto& item : four->named_parameters(true)) {
      if (item.key().find("lora_magnitude_vector") == std::string::npos) continue;
      const std::string module = item.key().substr(0, item.key().rfind('.'));
      INFO(item.key());
      const at::Tensor w = dense->named_parameters(true)[module + ".weight"];
      if (std::string(init) == "true") CHECK(max_abs(item.value(), w.norm(2, {1})) < 1e-5);
    }
    SafetensorsFile data(fixture("models/llama/expected.safetensors"));
    const at::Tensor ids = data.load("input_ids"), labels = data.load("labels");
    const at::Tensor mask = data.load("attention_mask");
    LossSum lq = four->loss(ids, labels, mask), ld = dense->loss(ids, labels, mask);
    CHECK(lq.sum.item<double>() == Approx(ld.sum.item<double>()).epsilon(1e-5));
    lq.sum.backward();
    ld.sum.backward();
    int adapters = 0;
    for (const auto& item : four->named_parameters(true)) {
      if (!item.value().requires_grad()) continue;
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      CHECK(at::allclose(item.value().grad(), dense->named_parameters(true)[item.key()].grad(),
                         1e-4, 1e-6));
      ++adapters;
    }
    CHECK(adapters == 3 * 7 * mc.num_hidden_layers);
    // The 4-bit storages hold the residual when PiSSA decomposed, not the checkpoint's weights.
    const at::Tensor q_storage =
        four->named_parameters(true)["model.layers.0.self_attn.q_proj.weight"];
    ModelConfig mq = mc;
    CausalLM plain_four(mq, at::TensorOptions(), true);
    load_weights(plain_four, *checkpoint_source(fixture("models/llama")));
    CHECK(at::equal(q_storage,
                    plain_four.named_parameters(true)["model.layers.0.self_attn.q_proj.weight"]) ==
          (std::string(init) == "true"));
  }
}

TEST_CASE("DoRA with dropout computes what its one-function path computes, dense and 4-bit",
          "[peft][dora][quant]") {
  // A dropout that drops nothing (p = 1e-12) takes the path of dropout in training — autograd of
  // PEFT's expression, the base's products through base_forward — where p = 0 takes
  // DoraLinearFunction: the same loss and gradients, over qwen2 (biases) dense and 4-bit.
  SafetensorsFile data(fixture("models/qwen2/expected.safetensors"));
  const at::Tensor ids = data.load("input_ids"), labels = data.load("labels");
  const at::Tensor mask = data.load("attention_mask");
  for (bool four_bit : {false, true}) {
    INFO((four_bit ? "4-bit" : "dense"));
    std::vector<double> losses;
    std::vector<std::vector<at::Tensor>> grads;
    for (double dropout : {0.0, 1e-12}) {
      PeftConfig config = dora_config();
      config.lora.dropout = dropout;
      auto model =
          base_model("qwen2", four_bit ? std::optional<QuantizationConfig>(QuantizationConfig{})
                                       : std::nullopt);
      apply_peft(*model, config, 3);
      {
        at::NoGradGuard no_grad;
        at::manual_seed(5);
        for (auto& item : model->named_parameters(true)) {
          if (item.key().find("lora_B") != std::string::npos) {
            item.value().add_(at::randn_like(item.value()) * 0.05);
          }
        }
      }
      model->train();
      LossSum loss = model->loss(ids, labels, mask);
      loss.sum.backward();
      losses.push_back(loss.sum.item<double>());
      grads.emplace_back();
      for (const auto& item : model->named_parameters(true)) {
        if (item.value().requires_grad()) grads.back().push_back(item.value().grad().clone());
      }
    }
    CHECK(losses[1] == Approx(losses[0]).epsilon(1e-6));
    REQUIRE(grads[0].size() == grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      CHECK(at::allclose(grads[1][i], grads[0][i], 1e-4, 1e-6));
    }
  }
}

TEST_CASE("rank: dora and pissa train under stages 0 and 3", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  SafetensorsFile data(fixture("models/llama/expected.safetensors"));
  auto four = [](const at::Tensor& t) { return at::cat({t, t.roll(5, 1)}); };
  std::vector<std::vector<double>> curves;
  for (const char* method : {"dora 4-bit", "pissa+dora"}) {
    const bool four_bit = std::string(method) == "dora 4-bit";
    PeftConfig config = dora_config();
    config.lora.init_lora_weights = four_bit ? "true" : "pissa_niter_2";
    ModelConfig mc = load_model_config(fixture("models/llama"));
    if (four_bit) mc.quantization = QuantizationConfig{};
    // The plain single-process reference of the first loss: adapters started on a loaded model,
    // over the whole batch of 4 rows.
    double attached = 0;
    {
      CausalLM loaded(mc, at::TensorOptions(), true);
      load_weights(loaded, *checkpoint_source(fixture("models/llama")));
      apply_peft(loaded, config, 3);
      at::NoGradGuard no_grad;
      LossSum l = loaded.loss(four(data.load("input_ids")), four(data.load("labels")),
                              four(data.load("attention_mask")));
      attached = l.sum.item<double>() / static_cast<double>(l.tokens);
    }
    for (const char* setting : {"0", "3", "3 offload"}) {
      INFO(method << ", stage " << setting);
      auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), /*allocate=*/false);
      apply_peft(*model, config, 3);
      std::shared_ptr<ParameterSource> base = checkpoint_source(fixture("models/llama"));
      base = peft::pissa_source(base, *model, config.lora, 3, at::kCPU, true);
      if (four_bit) base = model::quantizing_source(*base, model::quantized_weights(*model), base);
      base = peft::dora_source(base, *model, config.lora);
      const std::vector<double> losses = test::fixture_batch_losses(comm, model, base, setting, 5);
      CHECK(losses.front() == Approx(attached).epsilon(1e-5));
      CHECK(losses.back() < 0.95 * losses.front());
      curves.push_back(losses);
    }
  }
  const int rank = comm->rank();
  test::write_curves(rank, curves);
  comm->barrier();
}

TEST_CASE("DoRA and PiSSA train the same at world 1, 2 and 4 under ZeRO stages 0 and 3",
          "[peft][dora][pissa][engine]") {
  std::vector<std::vector<std::vector<double>>> by_world;
  for (int world : {1, 2, 4}) {
    if (test::skip_cpu_world(world)) return;
    const std::vector<std::vector<double>> curves = test::curves_at_world(
        world, "rank: dora and pissa train under stages 0 and 3", std::chrono::seconds(300));
    REQUIRE(curves.size() == 6);
    by_world.push_back(curves);
  }
  // Each method's runs follow its world-1 stage-0 run, to fp32 reduction-order noise.
  for (size_t method = 0; method < 2; ++method) {
    const std::vector<double>& reference = by_world[0][method * 3];
    for (size_t w = 0; w < by_world.size(); ++w) {
      for (size_t s = 0; s < 3; ++s) {
        INFO("method " << method << ", world index " << w << ", setting " << s);
        const std::vector<double>& curve = by_world[w][method * 3 + s];
        REQUIRE(curve.size() == reference.size());
        for (size_t k = 0; k < reference.size(); ++k) {
          CHECK(curve[k] == Approx(reference[k]).epsilon(2e-4));
        }
      }
    }
  }
}

TEST_CASE("a new LoRA adapter over a randomly initialized model starts as PEFT starts it",
          "[peft][engine]") {
  // The random source gives the model's own parameters only: B stays zero (the adapter a no-op)
  // and A keeps its kaiming start, instead of both drawn like weights.
  auto comm = std::shared_ptr<Communicator>(test::join());
  const ModelConfig mc = load_model_config(fixture("models/llama"));
  auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), /*allocate=*/false);
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.r = 4;
  c.lora.alpha = 8;
  apply_peft(*model, c, 3);
  const std::string q = "model.layers.0.self_attn.q_proj";
  const at::Tensor a = model->named_parameters()[q + ".lora_A.weight"].detach().clone();
  DeepSpeedConfig ds = parse_deepspeed_config(R"({"zero_optimization": {"stage": 0}})");
  TrainingArguments args;
  resolve_config(ds, args, ResolveContext{1, mc.hidden_size, 6});
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.source = with_adapter_values(random_source(mc, 1), *model);
  Engine engine(model, ds, comm, eo);
  CHECK(model->named_parameters()[q + ".lora_B.weight"].abs().max().item<double>() == 0.0);
  CHECK(at::equal(model->named_parameters()[q + ".lora_A.weight"].detach().cpu(), a));
  CHECK(model->named_parameters()[q + ".weight"].abs().max().item<double>() > 0.0);
}

namespace {

// Rows of a sequence task over the tiny vocabulary: each token follows from the last as
// 3·x + `shift` (mod 125), from a random first token; labels are the inputs (every token).
at::Tensor sequence_task(int64_t shift, int64_t rows, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor ids = at::empty({rows, 24}, at::kLong);
  at::Tensor x = at::randint(3, 128, {rows}, gen, at::kLong);
  for (int64_t t = 0; t < 24; ++t) {
    ids.select(1, t).copy_(x);
    x = (3 * (x - 3) + shift).remainder(125) + 3;
  }
  return ids;
}

// The losses of `steps` AdamW steps of `model`'s trainable parameters on the task's batches.
std::vector<double> train_losses(CausalLM& model, int64_t shift, int steps, double lr) {
  std::vector<at::Tensor> trainable;
  for (auto& p : model.parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(lr).weight_decay(0.0));
  model.train();
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    const at::Tensor ids = sequence_task(shift, 16, 1000 + static_cast<uint64_t>(s));
    opt.zero_grad();
    LossSum l = model.loss(ids, ids);
    const at::Tensor mean = l.sum / static_cast<double>(l.tokens);
    mean.backward();
    opt.step();
    out.push_back(mean.item<double>());
  }
  return out;
}

}  // namespace

TEST_CASE("QLoRA's and DoRA's loss curves stay within a band of LoRA's on a trained model",
          "[quant][peft][slow]") {
  // The fixture llama (transformers' initialization) first learns one task in full: a model
  // whose weights mean something, so a 4-bit base's error is not noise on noise. Then LoRA,
  // QLoRA (NF4, double quantization), DoRA and DoRA over the 4-bit base learn a second task
  // from it, the same seed and steps each.
  const std::string dir = test::temp_dir("band");
  {
    auto base = base_model("llama");
    const std::vector<double> pre = train_losses(*base, 1, 150, 3e-3);
    REQUIRE(pre.back() < 0.3 * pre.front());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : base->named_parameters())
      tensors.emplace_back(p.key(), p.value().detach());
    save_sharded_safetensors(dir, tensors);
    files::write_atomic(dir + "/config.json",
                        files::read_text(fixture("models/llama/config.json")));
  }
  auto run = [&](bool four_bit, bool dora) {
    ModelConfig c = load_model_config(dir);
    if (four_bit) {
      QuantizationConfig q;
      q.quant_type = "nf4";
      q.double_quant = true;
      c.quantization = q;
    }
    CausalLM m(c, at::TensorOptions(), true);
    load_weights(m, *checkpoint_source(dir));
    PeftConfig p;
    p.type = FinetuningType::kLora;
    p.lora.r = 8;
    p.lora.alpha = 16;
    p.lora.use_dora = dora;
    apply_peft(m, p, 3);
    return train_losses(m, 7, 60, 1e-2);
  };
  const std::vector<double> lora = run(false, false);
  INFO("LoRA: " << lora.front() << " -> " << lora.back());
  REQUIRE(lora.back() < 0.05 * lora.front());  // the second task is learned
  const std::vector<double> qlora = run(true, false), dora = run(false, true),
                            qdora = run(true, true);
  // The stated band (docs/quantization.md), on the mean loss of every 10 steps: a 4-bit base
  // within 15 % (+ 0.02) of the same adapter over the full-precision one; DoRA within 10 % of
  // LoRA's starting loss of LoRA's, and below 5 % of it by the end.
  auto window = [](const std::vector<double>& v, size_t w) {
    double sum = 0;
    for (size_t k = w; k < w + 10; ++k) sum += v[k] / 10;
    return sum;
  };
  for (size_t w = 0; w + 10 <= lora.size(); w += 10) {
    INFO("steps " << w + 1 << "-" << w + 10 << ": LoRA " << window(lora, w) << ", QLoRA "
                  << window(qlora, w) << ", DoRA " << window(dora, w) << ", 4-bit DoRA "
                  << window(qdora, w));
    CHECK(std::abs(window(qlora, w) - window(lora, w)) <= 0.15 * window(lora, w) + 0.02);
    CHECK(std::abs(window(qdora, w) - window(dora, w)) <= 0.15 * window(dora, w) + 0.02);
    CHECK(std::abs(window(dora, w) - window(lora, w)) <= 0.1 * lora.front());
  }
  CHECK(window(dora, 50) < 0.05 * lora.front());
  CHECK(window(qdora, 50) < 0.05 * lora.front());
}
