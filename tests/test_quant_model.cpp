// A model with a 4-bit base (QLoRA): its projections hold the checkpoint's weights in
// bitsandbytes' blocks, LoRA over it computes what LoRA over the dequantized weights computes,
// and ZeRO stages 0-3 (and parameter offload) at world 1, 2 and 4 train it as one process does.
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "model/layers.hpp"
#include "model/quantized_weights.hpp"
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

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

ModelConfig four_bit_config(const std::string& family, const std::string& type, bool double_quant) {
  ModelConfig mc = load_model_config(fixture("models/" + family));
  QuantizationConfig q;
  q.quant_type = type;
  q.double_quant = double_quant;
  mc.quantization = q;
  return mc;
}

PeftConfig lora_config() {
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.r = 4;
  c.lora.alpha = 8;
  return c;
}

// The loaded tensor `name` of the family's checkpoint.
at::Tensor checkpoint_tensor(const std::string& family, const std::string& name) {
  SafetensorsCheckpoint ckpt(fixture("models/" + family));
  at::Tensor out = at::empty(ckpt.info(name).shape, at::kFloat);
  ckpt.read_range(name, 0, out.view({-1}));
  return out;
}

}  // namespace

TEST_CASE("a 4-bit model's projections hold bitsandbytes' blocks of the checkpoint's weights",
          "[quant]") {
  for (const char* type : {"nf4", "fp4"}) {
    for (bool dq : {false, true}) {
      INFO(type << (dq ? " with" : " without") << " double quantization");
      const ModelConfig mc = four_bit_config("llama", type, dq);
      CausalLM model(mc, at::TensorOptions(), /*allocate=*/true);
      load_weights(model, *checkpoint_source(fixture("models/llama")));
      const auto quantized = model::quantized_weights(model);
      // Every decoder projection, and neither the embeddings nor the output layer.
      CHECK(quantized.size() == static_cast<size_t>(7 * mc.num_hidden_layers));
      CHECK(quantized.count("lm_head.weight") == 0);
      CHECK(quantized.count("model.embed_tokens.weight") == 0);
      for (const auto& item : model.named_parameters(true)) {
        if (quantized.count(item.key()) == 0) {
          CHECK(item.value().scalar_type() == at::kFloat);
          CHECK(at::equal(item.value(), checkpoint_tensor("llama", item.key())));
          continue;
        }
        INFO(item.key());
        const quant::FourBitLayout& layout = *quantized.at(item.key());
        const at::Tensor dense = checkpoint_tensor("llama", item.key());
        CHECK(item.value().scalar_type() == at::kByte);
        CHECK_FALSE(item.value().requires_grad());
        // The storage is the blockwise quantizer's output for the file's values …
        const quant::FourBitBlocks blocks = quant::quantize_4bit(dense, layout.type, 64);
        const quant::FourBitParts parts = quant::parts_of(layout, item.value());
        CHECK(at::equal(parts.codes, blocks.packed));
        at::Tensor absmax = parts.absmax;
        if (dq) {
          const quant::DoubleQuantized nested = quant::double_quantize(blocks.absmax);
          CHECK(at::equal(parts.absmax, nested.codes));
          CHECK(at::equal(parts.nested_absmax, nested.nested_absmax));
          CHECK(parts.offset.item<float>() == nested.offset);
          absmax = quant::double_dequantize(nested);
        } else {
          CHECK(at::equal(absmax, blocks.absmax));
        }
        // … and the model's (ATen) dequantization equals the quantizer's own, bit for bit.
        const at::Tensor want = quant::dequantize_4bit(blocks.packed, absmax, layout.type, 64,
                                                       dense.numel(), at::kFloat);
        CHECK(at::equal(quant::dequantize_weight(layout, item.value(), at::kFloat),
                        want.view(dense.sizes())));
        // Within the 4-bit code's resolution of the full-precision weight.
        CHECK((want.view(dense.sizes()) - dense).abs().max().item<float>() <=
              0.6f * dense.abs().max().item<float>());
      }
      // Counted by their values, as PEFT counts a 4-bit model.
      CausalLM dense_model(load_model_config(fixture("models/llama")), at::TensorOptions(), true);
      CHECK(count_parameters(model).all == count_parameters(dense_model).all);
    }
  }
}

TEST_CASE("QLoRA computes LoRA over the dequantized base: the loss and the adapter's gradients",
          "[quant][peft]") {
  for (const char* family : {"llama", "qwen2"}) {
    INFO(family);
    const ModelConfig mc = four_bit_config(family, "nf4", true);
    auto q = std::make_shared<CausalLM>(mc, at::TensorOptions(), true);
    load_weights(*q, *checkpoint_source(fixture(std::string("models/") + family)));
    apply_peft(*q, lora_config(), 3);
    // The same model dense, its projections the 4-bit ones' dequantized values.
    auto d = std::make_shared<CausalLM>(load_model_config(fixture(std::string("models/") + family)),
                                        at::TensorOptions(), true);
    load_weights(*d, *checkpoint_source(fixture(std::string("models/") + family)));
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, layout] : model::quantized_weights(*q)) {
        d->named_parameters(true)[name].copy_(
            quant::dequantize_weight(*layout, q->named_parameters(true)[name], at::kFloat));
      }
    }
    apply_peft(*d, lora_config(), 3);
    // lora_B starts at zero: give both the same nonzero values, so the adapter matters.
    {
      at::NoGradGuard no_grad;
      at::manual_seed(5);
      for (auto& item : q->named_parameters(true)) {
        if (item.key().find("lora_B") == std::string::npos) continue;
        item.value().normal_(0, 0.05);
        d->named_parameters(true)[item.key()].copy_(item.value());
      }
    }
    SafetensorsFile data(fixture(std::string("models/") + family + "/expected.safetensors"));
    const at::Tensor ids = data.load("input_ids"), labels = data.load("labels");
    const at::Tensor mask = data.load("attention_mask");
    LossSum lq = q->loss(ids, labels, mask), ld = d->loss(ids, labels, mask);
    CHECK(lq.tokens == ld.tokens);
    CHECK(lq.sum.item<double>() == Approx(ld.sum.item<double>()).epsilon(1e-5));
    lq.sum.backward();
    ld.sum.backward();
    int adapters = 0;
    for (const auto& item : q->named_parameters(true)) {
      if (!item.value().requires_grad()) continue;
      INFO(item.key());
      const at::Tensor gd = d->named_parameters(true)[item.key()].grad();
      REQUIRE(item.value().grad().defined());
      CHECK(at::allclose(item.value().grad(), gd, 1e-4, 1e-6));
      ++adapters;
    }
    CHECK(adapters == 2 * 7 * mc.num_hidden_layers);
  }
}

TEST_CASE("4-bit options: refused where they cannot apply, with the option named", "[quant]") {
  ModelConfig mc = four_bit_config("llama", "nf4", true);
  mc.quantization->quant_type = "int4";
  CHECK_THROWS_AS(std::make_shared<CausalLM>(mc, at::TensorOptions(), true), ConfigError);
  mc.quantization->quant_type = "nf4";
  mc.quantization->blocksize = 48;
  CHECK_THROWS_AS(std::make_shared<CausalLM>(mc, at::TensorOptions(), true), ConfigError);
  // A 4-bit base is frozen: training it in full is refused by the engine's parameters
  // (uint8 cannot require gradients), and merging an adapter into it in place too.
  mc.quantization->blocksize = 64;
  CausalLM q(mc, at::TensorOptions(), true);
  load_weights(q, *checkpoint_source(fixture("models/llama")));
  apply_peft(q, lora_config(), 3);
  CHECK_THROWS_AS(merge_lora(q), InvalidArgument);
}

namespace {

// A model for a bitsandbytes folder, its 4-bit weights read from the folder's parts.
std::shared_ptr<CausalLM> load_prequantized(const std::string& folder) {
  ModelConfig mc = load_model_config(folder);
  mc.quantization = model::saved_quantization(mc);
  REQUIRE(mc.quantization);
  auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), true);
  check_checkpoint(*model, folder);
  load_weights(*model, *model::prequantized_source(folder, model::quantized_weights(*model)));
  return model;
}

// A copy of `folder` with `change` applied to its tensors.
std::string changed_copy(const std::string& folder,
                         const std::function<void(std::map<std::string, at::Tensor>&)>& change) {
  const std::string dir = test::temp_dir("bnb_bad");
  std::map<std::string, at::Tensor> tensors;
  SafetensorsFile file(folder + "/model.safetensors");
  for (const std::string& name : file.names()) tensors[name] = file.load(name);
  change(tensors);
  std::vector<std::pair<std::string, at::Tensor>> list(tensors.begin(), tensors.end());
  save_safetensors(dir + "/model.safetensors", list);
  std::filesystem::copy_file(folder + "/config.json", dir + "/config.json");
  return dir;
}

at::Tensor json_bytes(const std::string& text) {
  return at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())},
                       at::kByte)
      .clone();
}

}  // namespace

TEST_CASE("a folder transformers saved with bitsandbytes 4-bit weights loads to its values",
          "[quant]") {
  for (const char* kind : {"nf4", "fp4"}) {
    INFO(kind);
    const std::string folder = fixture(std::string("quant/llama_bnb_") + kind);
    auto model = load_prequantized(folder);
    const auto quantized = model::quantized_weights(*model);
    CHECK(quantized.size() == 14);
    CHECK(quantized.begin()->second->double_quant == (std::string(kind) == "nf4"));
    // Each projection dequantizes to what the reference computed from the same parts …
    SafetensorsFile expected(folder + "/expected.safetensors");
    const auto params = model->named_parameters(true);
    for (const auto& [name, layout] : quantized) {
      INFO(name);
      CHECK(at::equal(quant::dequantize_weight(*layout, params[name], at::kFloat),
                      expected.load(name)));
    }
    // … and everything else is the file's.
    SafetensorsFile file(folder + "/model.safetensors");
    CHECK(at::equal(params["model.embed_tokens.weight"], file.load("model.embed_tokens.weight")));
    CHECK(at::equal(params["lm_head.weight"], file.load("lm_head.weight")));
  }
}

TEST_CASE("bitsandbytes' packed codes stored as bfloat16, float16 or float32 load as uint8 ones",
          "[quant]") {
  // bnb_4bit_quant_storage (FSDP's QLoRA recipe stores bfloat16): bitsandbytes writes the same
  // packed bytes into ((n + 1) / (2 × itemsize), 1) elements of that dtype, and config.json says
  // which.
  const std::string folder = fixture("quant/llama_bnb_nf4");
  auto reference = load_prequantized(folder);
  for (const auto& [dtype, spelled] :
       {std::pair{at::kBFloat16, "bfloat16"}, {at::kHalf, "float16"}, {at::kFloat, "float32"}}) {
    INFO(spelled);
    const std::string dir = changed_copy(folder, [dtype = dtype](auto& t) {
      for (auto& [name, value] : t) {
        if (name.size() < 12 || name.compare(name.size() - 12, 12, "_proj.weight") != 0) continue;
        const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
        at::Tensor stored = at::empty({value.numel() / itemsize, 1}, dtype);
        std::memcpy(stored.data_ptr(), value.contiguous().data_ptr(),
                    static_cast<size_t>(value.numel()));
        value = stored;
      }
    });
    std::string config = files::read_text(dir + "/config.json");
    const std::string uint8 = R"("bnb_4bit_quant_storage": "uint8")";
    REQUIRE(config.find(uint8) != std::string::npos);
    config.replace(config.find(uint8), uint8.size(),
                   fmt::format(R"("bnb_4bit_quant_storage": "{}")", spelled));
    files::write_atomic(dir + "/config.json", config);
    auto model = load_prequantized(dir);
    for (const auto& [name, layout] : model::quantized_weights(*model)) {
      INFO(name);
      CHECK(
          at::equal(model->named_parameters(true)[name], reference->named_parameters(true)[name]));
    }
  }
  // A storage bitsandbytes does not have is refused, naming config.json's key.
  const std::string dir = changed_copy(folder, [](auto&) {});
  std::string config = files::read_text(dir + "/config.json");
  const std::string uint8 = R"("bnb_4bit_quant_storage": "uint8")";
  config.replace(config.find(uint8), uint8.size(), R"("bnb_4bit_quant_storage": "int4")");
  files::write_atomic(dir + "/config.json", config);
  CHECK_THROWS_WITH(load_prequantized(dir), Catch::Contains("bnb_4bit_quant_storage"));
}

TEST_CASE("a bitsandbytes folder that lies about a weight is refused, naming the tensor",
          "[quant][errors]") {
  const std::string folder = fixture("quant/llama_bnb_nf4");
  const std::string w = "model.layers.1.mlp.down_proj.weight";
  const std::string state = w + ".quant_state.bitsandbytes__nf4";
  struct Lie {
    const char* what;
    std::function<void(std::map<std::string, at::Tensor>&)> change;
    std::string names;
  };
  const std::vector<Lie> lies = {
      {"a shape that is not the weight's",
       [&](auto& t) {
         t[state] = json_bytes(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", )"
                               R"("shape": [64, 161], "nested_blocksize": 256, )"
                               R"("nested_dtype": "float32", "nested_offset": 0.01})");
       },
       state},
      {"another block size",
       [&](auto& t) {
         t[state] = json_bytes(R"({"quant_type": "nf4", "blocksize": 128, "dtype": "float32", )"
                               R"("shape": [64, 160], "nested_blocksize": 256, )"
                               R"("nested_dtype": "float32", "nested_offset": 0.01})");
       },
       state},
      {"an offset beyond fp32",
       [&](auto& t) {
         t[state] = json_bytes(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", )"
                               R"("shape": [64, 160], "nested_blocksize": 256, )"
                               R"("nested_dtype": "float32", "nested_offset": 1e300})");
       },
       state},
      {"a quant_state that is not JSON", [&](auto& t) { t[state] = json_bytes("{\"quant_"); },
       state},
      {"fp4 where the config says nf4",
       [&](auto& t) {
         t[w + ".quant_state.bitsandbytes__fp4"] = t[state];
         t.erase(state);
       },
       w + ".quant_state.bitsandbytes__fp4"},
      {"a non-finite nested absmax", [&](auto& t) { t[w + ".nested_absmax"][0] = NAN; },
       w + ".nested_absmax"},
      {"a negative nested absmax", [&](auto& t) { t[w + ".nested_absmax"][0] = -1.0f; },
       w + ".nested_absmax"},
      {"absmax codes cut short",
       [&](auto& t) { t[w + ".absmax"] = t[w + ".absmax"].narrow(0, 0, 10).clone(); },
       w + ".absmax"},
      {"packed codes cut short", [&](auto& t) { t[w] = t[w].narrow(0, 0, 100).clone(); }, w},
      {"another code table",
       [&](auto& t) { t[w + ".quant_map"] = t[w + ".quant_map"].flip(0).clone(); },
       w + ".quant_map"},
      {"the quant_state missing", [&](auto& t) { t.erase(state); }, state},
  };
  for (const Lie& lie : lies) {
    INFO(lie.what);
    const std::string dir = changed_copy(folder, lie.change);
    CHECK_THROWS_WITH(load_prequantized(dir), Catch::Contains(lie.names));
  }
  // The run's options against the folder: a type the folder does not hold is refused by the
  // Trainer (test_trainer.cpp); a model built without quantization refuses the packed weights.
  CausalLM dense(load_model_config(folder), at::TensorOptions(), true);
  CHECK_THROWS_WITH(check_checkpoint(dense, folder), Catch::Contains("quantized checkpoint"));
}

TEST_CASE("rank: qlora trains under every stage", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  std::vector<std::vector<double>> curves;
  for (const char* setting : {"0", "1", "2", "3", "3 offload"}) {
    INFO("stage " << setting);
    const ModelConfig mc = four_bit_config("llama", "nf4", true);
    auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), /*allocate=*/false);
    apply_peft(*model, lora_config(), 3);
    std::shared_ptr<ParameterSource> base = checkpoint_source(fixture("models/llama"));
    base = model::quantizing_source(*base, model::quantized_weights(*model), base);
    const std::vector<double> losses = test::fixture_batch_losses(comm, model, base, setting, 6);
    CHECK(losses.back() < 0.95 * losses.front());
    curves.push_back(losses);
  }
  const int rank = comm->rank();
  test::write_curves(rank, curves);
  comm->barrier();
}

TEST_CASE("QLoRA trains the same at world 1, 2 and 4 under ZeRO stages 0-3 and offload",
          "[quant][engine]") {
  std::vector<std::vector<std::vector<double>>> by_world;
  for (int world : {1, 2, 4}) {
    if (test::skip_cpu_world(world)) return;
    const std::vector<std::vector<double>> curves = test::curves_at_world(
        world, "rank: qlora trains under every stage", std::chrono::seconds(300));
    REQUIRE(curves.size() == 5);
    by_world.push_back(curves);
  }
  // Every stage and world follows world 1's stage-0 run, to fp32 reduction-order noise.
  const std::vector<double>& reference = by_world[0][0];
  for (size_t w = 0; w < by_world.size(); ++w) {
    for (size_t s = 0; s < by_world[w].size(); ++s) {
      INFO("world index " << w << ", setting " << s);
      REQUIRE(by_world[w][s].size() == reference.size());
      for (size_t k = 0; k < reference.size(); ++k) {
        CHECK(by_world[w][s][k] == Approx(reference[k]).epsilon(2e-4));
      }
    }
  }
}
