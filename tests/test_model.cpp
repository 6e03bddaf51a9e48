// Decoder models against transformers 5.17: configs in both spellings, logits, hidden states,
// loss and gradients on the fixtures tests/tools/make_fixtures.py wrote; loading errors;
// random init; generation with a KV cache.
//
// Tolerance: fp32 on CPU, 2e-5 absolute on logits and hidden states (values of order 1; the two
// implementations differ only in summation order), 1e-5 relative on the loss, 1e-4 relative on
// gradient norms and 1e-5 absolute on gradient elements.
#include "support/catch.hpp"

#include <ATen/Parallel.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "model/blocks.hpp"
#include "model/families/moe.hpp"
#include "model/layers.hpp"
#include "peft/lora.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;
using Catch::Contains;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::shared_ptr<CausalLM> load_fixture_model(const std::string& name,
                                             const std::string& config_file = "config.json") {
  ModelConfig c = load_model_config(fixture("models/" + name + "/" + config_file));
  auto model =
      std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), /*allocate=*/false);
  load_weights(*model, *checkpoint_source(fixture("models/" + name)));
  return model;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

}  // namespace

TEST_CASE("HF config.json in the 5.x and 4.x spellings parse to the same config",
          "[model][config]") {
  for (const char* name :
       {"llama", "llama_rope_llama3", "llama_rope_linear", "qwen2", "mistral", "glm", "glm4"}) {
    INFO(name);
    ModelConfig a = load_model_config(fixture(std::string("models/") + name));
    ModelConfig b = load_model_config(fixture(std::string("models/") + name + "/config_v4.json"));
    CHECK(a.model_type == b.model_type);
    CHECK(a.rope_theta == b.rope_theta);
    CHECK(a.rope_scaling.type == b.rope_scaling.type);
    CHECK(a.rope_scaling.factor == b.rope_scaling.factor);
    CHECK(a.rope_scaling.original_max_position_embeddings ==
          b.rope_scaling.original_max_position_embeddings);
    CHECK(a.dtype == b.dtype);
    CHECK(a.num_key_value_heads == 2);
    CHECK(a.head_dim == 16);
    CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
    // Written back in 5.x spelling, it reads the same again.
    ModelConfig c = parse_model_config(model_config_json(a));
    CHECK(c.model_type == a.model_type);
    CHECK(c.rope_scaling.type == a.rope_scaling.type);
    CHECK(c.rope_scaling.low_freq_factor == a.rope_scaling.low_freq_factor);
    CHECK(c.qkv_bias == a.qkv_bias);
    CHECK(c.parameter_count() == a.parameter_count());
    CHECK(a.partial_rotary_factor == b.partial_rotary_factor);
    CHECK(c.partial_rotary_factor == a.partial_rotary_factor);
    CHECK(c.post_sublayer_norms == a.post_sublayer_norms);
    CHECK(c.fused_gate_up == a.fused_gate_up);
  }
  for (const char* name : {"glm", "glm4"}) {
    INFO(name);
    ModelConfig g = load_model_config(fixture(std::string("models/") + name));
    CHECK(g.rotary_dim() == 8);  // half of head_dim 16
    CHECK(g.rope_interleaved);
    CHECK(g.fused_gate_up);
    CHECK(g.qkv_bias);
    CHECK_FALSE(g.o_proj_bias);
    CHECK(g.post_sublayer_norms == (std::string(name) == "glm4"));
  }
  ModelConfig q = load_model_config(fixture("models/qwen2"));
  CHECK(q.qkv_bias);
  CHECK_FALSE(q.o_proj_bias);
  CHECK(q.tie_word_embeddings);
  CHECK(q.rope_theta == 1000000.0);
  CHECK(load_model_config(fixture("models/llama_rope_llama3")).rope_scaling.type == "llama3");
}

namespace {

// config.json text with the given keys left out: what a reader of one transformers line sees
// of a file (4.x knows only rope_theta / rope_scaling / torch_dtype, and its ModelConfig is what
// our parser makes of those; a 5.x-only reader is played by leaving the 4.x keys out).
std::string without_keys(const std::string& text, std::initializer_list<const char*> keys) {
  rapidjson::Document doc;
  doc.Parse(text.c_str());
  for (const char* k : keys) doc.RemoveMember(k);
  return json::dump(doc);
}

}  // namespace

TEST_CASE("a written config.json keeps the input's members and reads the same in 4.x and 5.x",
          "[model][config]") {
  for (const char* name :
       {"llama", "llama_rope_llama3", "llama_rope_linear", "llama_rope_dynamic", "llama_rope_yarn",
        "qwen2", "qwen3", "qwen3_rope_yarn", "mistral", "mistral_head_dim", "phi3", "phi3_longrope",
        "gemma2", "gemma3_text", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"}) {
    for (const char* file : {"config.json", "config_v4.json"}) {
      INFO(name << "/" << file);
      const std::string path = fixture(std::string("models/") + name + "/" + file);
      ModelConfig in = load_model_config(path);
      ModelConfig changed = in;
      changed.dtype = at::kBFloat16;  // what training changes: the weights' dtype
      const std::string written = model_config_json(changed);
      rapidjson::Document before, after;
      before.Parse(files::read_text(path).c_str());
      after.Parse(written.c_str());
      REQUIRE(after.IsObject());
      // Every member of the input is there as it was, but the dtype.
      for (auto it = before.MemberBegin(); it != before.MemberEnd(); ++it) {
        const std::string key = it->name.GetString();
        INFO(key);
        REQUIRE(after.HasMember(key.c_str()));
        if (key == "torch_dtype" || key == "dtype") continue;
        CHECK(after[key.c_str()] == it->value);
      }
      CHECK(std::string(after["torch_dtype"].GetString()) == "bfloat16");
      CHECK(std::string(after["dtype"].GetString()) == "bfloat16");
      // Each line's reader sees the same model.
      ModelConfig v4 = parse_model_config(without_keys(written, {"rope_parameters", "dtype"}));
      ModelConfig v5 =
          parse_model_config(without_keys(written, {"rope_theta", "rope_scaling", "torch_dtype"}));
      test::check_same_model(v4, in, /*same_dtype=*/false);  // written in bf16
      test::check_same_model(v5, in, /*same_dtype=*/false);
      CHECK(v4.dtype == at::kBFloat16);
      CHECK(v5.dtype == at::kBFloat16);
    }
  }
  // An inline config (zerotrain writes every member itself) in both spellings, each complete.
  ModelConfig inline_config =
      parse_model_config(R"({"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rope_theta": 1000000.0, "eos_token_id": [5, 7]})");
  CHECK(inline_config.source_json.empty());
  const std::string written = model_config_json(inline_config);
  for (const char* key : {"rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype",
                          "use_cache", "max_window_layers", "architectures"}) {
    CHECK_THAT(written, Contains(std::string("\"") + key + "\""));
  }
  test::check_same_model(parse_model_config(without_keys(written, {"rope_parameters", "dtype"})),
                         inline_config);
  test::check_same_model(
      parse_model_config(without_keys(written, {"rope_theta", "rope_scaling", "torch_dtype"})),
      inline_config);
  // Gemma's query_pre_attn_scalar is an int in transformers' config classes, which 5.x checks
  // strictly: an inline config's whole number is written as one.
  rapidjson::Document gemma;
  gemma.Parse(
      model_config_json(parse_model_config(
                            R"({"model_type": "gemma2", "vocab_size": 300, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
      "query_pre_attn_scalar": 24.0})"))
          .c_str());
  REQUIRE(gemma.IsObject());
  CHECK(gemma["query_pre_attn_scalar"].IsInt64());
  CHECK(gemma["query_pre_attn_scalar"].GetInt64() == 24);
  // A list of eos ids stays a list when the file had one.
  const std::string dir = test::temp_dir("eos_list");
  files::write_atomic(dir + "/config.json",
                      R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 7]})");
  rapidjson::Document out;
  out.Parse(model_config_json(load_model_config(dir)).c_str());
  REQUIRE(out["eos_token_id"].IsArray());
  CHECK(out["eos_token_id"].Size() == 2);
  CHECK(std::string(out["rope_scaling"]["type"].GetString()) == "linear");  // the input's own form
  CHECK(out["rope_parameters"]["factor"].GetDouble() == 2.0);
}

TEST_CASE("unsupported or inconsistent model configs are errors naming the key",
          "[model][config][errors]") {
  auto err = [](const std::string& json) {
    try {
      parse_model_config(json, "config.json");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string base = R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
      "num_hidden_layers": 1, "num_attention_heads": 2)";
  CHECK_THAT(
      err(R"({"model_type": "gpt2", )" + base + "}"),
      Contains("model_type") && Contains("gpt2") &&
          Contains("llama, qwen2, qwen3, qwen3_moe, mistral, mistral3, mixtral, phi3, gemma2, "
                   "gemma3_text, gemma3, glm, glm4"));
  CHECK_THAT(err(R"({"model_type": "llama"})"), Contains("vocab_size"));
  CHECK(err(R"({"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4}, )" + base +
            "}") == "(accepted)");
  CHECK_THAT(err(R"({"model_type": "llama", "num_key_value_heads": 3, )" + base + "}"),
             Contains("num_key_value_heads"));
  CHECK_THAT(err(R"({"model_type": "llama", "hidden_act": "gelu", )" + base + "}"),
             Contains("hidden_act") && Contains("gelu"));
  CHECK_THAT(err(R"({"model_type": "qwen2", "use_sliding_window": true, )" + base + "}"),
             Contains("use_sliding_window"));
  // A layer list that disagrees with the layers, or asks for windows these families lack, is
  // refused naming the key: for every family that reads it.
  for (const char* family : {"qwen2", "qwen3"}) {
    INFO(family);
    const std::string head = std::string(R"({"model_type": ")") + family + "\", ";
    CHECK_THAT(
        err(head + R"("layer_types": ["full_attention", "full_attention"], )" + base + "}"),
        Contains("layer_types") && Contains("list of 1 layer types") && Contains("2 entries"));
    CHECK_THAT(err(head + R"("layer_types": "full_attention", )" + base + "}"),
               Contains("layer_types") && Contains("no list"));
    CHECK_THAT(err(head + R"("layer_types": ["sliding_attention"], )" + base + "}"),
               Contains("layer_types") && Contains("layer 0 is \"sliding_attention\""));
    CHECK_THAT(err(head + R"("layer_types": [7], )" + base + "}"),
               Contains("layer_types") && Contains("not a string"));
    CHECK(err(head + R"("layer_types": ["full_attention"], )" + base + "}") == "(accepted)");
    CHECK_THAT(err(head + R"("use_sliding_window": true, )" + base + "}"),
               Contains("use_sliding_window"));
  }
  // Gemma: a soft-cap must be positive (null: none), the layer list must fit the layers.
  for (const char* family : {"gemma2", "gemma3_text"}) {
    INFO(family);
    const std::string head = std::string(R"({"model_type": ")") + family + "\", ";
    for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"}) {
      CHECK_THAT(err(head + "\"" + key + R"(": 0, )" + base + "}"),
                 Contains(key) && Contains("positive"));
      CHECK_THAT(err(head + "\"" + key + R"(": -30.0, )" + base + "}"), Contains(key));
      CHECK(err(head + "\"" + key + R"(": null, )" + base + "}") == "(accepted)");
    }
    CHECK_THAT(err(head + R"("layer_types": ["full_attention", "full_attention"], )" + base + "}"),
               Contains("layer_types") && Contains("list of 1 layer types"));
    CHECK_THAT(err(head + R"("layer_types": ["local"], )" + base + "}"),
               Contains("layer_types") && Contains("layer 0"));
    CHECK_THAT(err(head + R"("hidden_activation": "relu", )" + base + "}"),
               Contains("hidden_activation") && Contains("relu"));
  }
  // Gemma 3's 5.x rope_parameters hold one block per layer type: a flat block (transformers
  // fails on it with a KeyError), a type its layers use left out, or another key is refused.
  {
    const std::string head = R"({"model_type": "gemma3_text", )";
    const std::string full = R"("layer_types": ["full_attention"], )";
    CHECK_THAT(err(head + R"("rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, )" +
                   base + "}"),
               Contains("rope_parameters") && Contains("one block per layer type"));
    CHECK_THAT(err(head + full + R"("rope_parameters": {"sliding_attention": {}}, )" + base + "}"),
               Contains("rope_parameters") && Contains("one block per layer type"));
    CHECK_THAT(
        err(head + R"("rope_parameters": {"sliding_attention": {}, "global": {}}, )" + base + "}"),
        Contains("rope_parameters.global"));
    CHECK(err(head + full + R"("rope_parameters": {"full_attention": {"rope_type": "linear", )" +
              R"("factor": 8.0}}, )" + base + "}") == "(accepted)");
  }
  // Phi-3: dropout inside the decoder and biases are refused by key; LongRoPE (its 128k and
  // Phi-4-mini configs) names what RoPE types are built.
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"}) {
    CHECK_THAT(err(std::string(R"({"model_type": "phi3", ")") + key + R"(": 0.1, )" + base + "}"),
               Contains(key) && Contains("dropout"));
  }
  CHECK_THAT(err(R"({"model_type": "phi3", "mlp_bias": true, )" + base + "}"),
             Contains("mlp_bias"));
  CHECK_THAT(err(R"({"model_type": "phi3", "partial_rotary_factor": 0.3, )" + base + "}"),
             Contains("partial_rotary_factor") && Contains("even"));
  // RoPE: a type not built names those that are; LongRoPE's lists hold one factor per rotated
  // frequency (here head_dim 4: 2); a factor that shrinks the context is refused.
  CHECK_THAT(err(R"({"model_type": "llama", "rope_scaling": {"type": "su", "factor": 2.0}, )" +
                 base + "}"),
             Contains("rope_type") && Contains("su") && Contains("yarn, longrope"));
  for (const char* lists : {R"("short_factor": [1.0], "long_factor": [1.5, 2.0])",
                            R"("short_factor": [1.0, 1.1], "long_factor": [1.5, 2.0, 2.5])"}) {
    CHECK_THAT(err(std::string(R"({"model_type": "phi3", "rope_scaling": {"type": "longrope", )") +
                   lists + "}, " + base + "}"),
               Contains("rope_scaling") && Contains("factor") && Contains("rotary_dim 4"));
  }
  CHECK(err(R"({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": )"
            R"([1.0, 1.1], "long_factor": [1.5, 2.0]}, )" +
            base + "}") == "(accepted)");
  for (const char* bad :
       {R"("short_factor": [1.0, -1.0], "long_factor": [1.5, 2.0])",
        R"("short_factor": "1.0", "long_factor": [1.5, 2.0])", R"("long_factor": [1.5, 2.0])"}) {
    CHECK_THAT(err(std::string(R"({"model_type": "phi3", "rope_scaling": {"type": "longrope", )") +
                   bad + "}, " + base + "}"),
               Contains("short_factor") && Contains("positive"));
  }
  for (const char* type : {"yarn", "dynamic", "llama3"}) {
    CHECK_THAT(
        err(std::string(R"({"model_type": "qwen3", "rope_scaling": {"rope_type": ")") + type +
            R"(", "factor": 0.5, "original_max_position_embeddings": 8}, )" + base + "}"),
        Contains("factor") && Contains("at least 1"));
  }
  CHECK_THAT(err(R"({"model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4, )"
                 R"("attention_factor": -1}, )" +
                 base + "}"),
             Contains("attention_factor"));
  CHECK_THAT(err(R"({"model_type": "llama", "torch_dtype": "int8", )" + base + "}"),
             Contains("torch_dtype"));
  CHECK_THAT(
      err(R"({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}, )" + base + "}"),
      Contains("factor"));
  // GLM: RoPE needs an even number of rotated dimensions; ChatGLM's own layout is named.
  CHECK_THAT(err(R"({"model_type": "glm", "partial_rotary_factor": 0.3, )" + base + "}"),
             Contains("partial_rotary_factor") && Contains("even"));
  CHECK_THAT(err(R"({"model_type": "glm", "mlp_bias": true, )" + base + "}"), Contains("mlp_bias"));
  // ChatGLM's config has its own names (test_chatglm.cpp): HF's are not enough.
  CHECK_THAT(err(R"({"model_type": "chatglm", )" + base + "}"), Contains("ffn_hidden_size"));
  CHECK_THROWS_AS(load_model_config("/nonexistent"), IoError);
}

TEST_CASE("logits, hidden states, loss and gradients match transformers", "[model][parity]") {
  // chatglm: THUDM's remote modeling_chatglm.py (tests/tools/make_chatglm_fixture.py).
  for (const char* name :
       {"llama", "llama_rope_llama3", "llama_rope_linear", "qwen2", "mistral", "glm", "glm4",
        "chatglm", "qwen3", "mistral_head_dim", "phi3", "gemma2", "gemma3_text",
        // Gemma 3 as published: Gemma3ForConditionalGeneration with a SigLIP tower, in the
        // layout transformers 5 saves (language_model.model.*), on text alone.
        "gemma3",
        // Mistral-Small-3.1 / 3.2 as published: Mistral3ForConditionalGeneration with a Pixtral
        // tower (its head tied: transformers 5's Mistral3Config writes tie_word_embeddings true).
        "mistral3",
        // RoPE scalings: yarn (Qwen3's; DeepSeek's members), dynamic NTK, LongRoPE short and long.
        "qwen3_rope_yarn", "llama_rope_yarn", "llama_rope_dynamic", "phi3_longrope",
        "phi3_longrope_long",
        // Mixtures of experts: routers made sharp enough that another expert choice would show;
        // GLM-4.5's sigmoid router over groups with its correction bias, a shared expert, a
        // dense first layer and partial RoPE in halves.
        "qwen3_moe", "mixtral", "glm4_moe",
        // gpt-oss: attention sinks, alternating sliding windows, yarn without truncation, the
        // router's bias and softmax over the top logits, [E, in, out] experts with biases and
        // the clamped, interleaved SwiGLU.
        "gpt_oss"}) {
    INFO("model " << name);
    auto model = load_fixture_model(name);
    SafetensorsFile expected(fixture(std::string("models/") + name + "/expected.safetensors"));
    at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    at::Tensor labels = expected.load("labels");
    at::Tensor real = mask.to(at::kBool);  // padded positions are not compared
    at::Tensor logits = model->logits(ids, mask);
    at::Tensor want = expected.load("logits");
    CHECK(max_abs(logits.index({real}), want.index({real})) < 2e-5);
    std::vector<at::Tensor> states = model->hidden_states(ids, mask);
    for (size_t i = 0; i + 1 < states.size(); ++i) {  // HF's last entry is after the final norm
      INFO("hidden state " << i);
      // Relative to the states' size: Gemma's grow with √hidden and its (1 + w) norms.
      const at::Tensor want_state = expected.load("hidden_states." + std::to_string(i));
      const double size = std::max(1.0, want_state.abs().max().item<double>());
      INFO("largest |value| " << size);
      CHECK(max_abs(states[i].index({real}), want_state.index({real})) / size < 2e-5);
    }
    // HF's loss is the mean over its tokens; ours is the sum and the count, here in odd chunks.
    LossSum loss = model->loss(ids, labels, mask, /*chunk_tokens=*/7);
    const double hf_loss = expected.load("loss").item<double>();
    CHECK(loss.sum.item<double>() / loss.tokens == Approx(hf_loss).epsilon(1e-5));
    (loss.sum / static_cast<double>(loss.tokens)).backward();
    int compared = 0;
    for (const auto& p : model->named_parameters()) {
      std::string key = "grad." + p.key();
      if (!expected.contains(key)) continue;
      INFO("gradient of " << p.key());
      at::Tensor g = expected.load(key);
      const double size = std::max(1.0, g.abs().max().item<double>());
      INFO("largest |gradient| " << size);
      CHECK(max_abs(p.value().grad(), g) / size < 2e-5);
      CHECK(p.value().grad().norm().item<double>() ==
            Approx(g.norm().item<double>()).epsilon(1e-4));
      ++compared;
    }
    CHECK(compared >= 4);
  }
}

TEST_CASE("the mixtures' load-balancing loss matches transformers' where the fixture has it",
          "[model][parity][moe]") {
  // make_fixtures.py records transformers' aux_loss, its loss with router_aux_loss_coef · aux
  // and the gradients then (the aux.* tensors, from the 2026-12-05 tool on); fixtures made
  // before carry none, and the test then checks nothing but that.
  for (const char* name : {"qwen3_moe", "mixtral", "gpt_oss"}) {
    INFO("model " << name);
    SafetensorsFile expected(fixture(std::string("models/") + name + "/expected.safetensors"));
    if (!expected.contains("aux.aux_loss")) {
      WARN(name << ": the fixture has no aux.* tensors yet (make_fixtures.py families)");
      continue;
    }
    ModelConfig c = load_model_config(fixture(std::string("models/") + name));
    REQUIRE(model::moe::set_router_aux(c, expected.load("aux.coef").item<double>()));
    auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), /*allocate=*/false);
    load_weights(*model, *checkpoint_source(fixture(std::string("models/") + name)));
    const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    LossSum l = model->loss(ids, expected.load("labels"), mask);
    REQUIRE(l.aux.defined());
    CHECK(l.aux.item<double>() ==
          Approx(expected.load("aux.aux_loss").item<double>()).epsilon(1e-5));
    const at::Tensor total = l.sum / static_cast<double>(l.tokens) + l.aux * l.aux_coef;
    CHECK(total.item<double>() == Approx(expected.load("aux.loss").item<double>()).epsilon(1e-5));
    total.backward();
    int compared = 0;
    for (const auto& p : model->named_parameters()) {
      const std::string key = "aux.grad." + p.key();
      if (!expected.contains(key)) continue;
      INFO("gradient of " << p.key());
      const at::Tensor g = expected.load(key);
      CHECK(max_abs(p.value().grad(), g) / std::max(1.0, g.abs().max().item<double>()) < 2e-5);
      ++compared;
    }
    CHECK(compared >= 3);
  }
}

TEST_CASE("a config.json leaving out keys at their class defaults is the model transformers reads",
          "[model][parity]") {
  // transformers 4.x writes a base key such as tie_word_embeddings only where it differs from a
  // default (google/gemma-2-9b's config.json has none, nor its checkpoint an lm_head), and a
  // sub-config (Gemma 3's text_config) only its members that differ: without the key each
  // family takes its config class's default — Gemma 3's, Mixtral's and gpt-oss's own
  // rope_theta among them — so where the fixture holds that default its logits stay.
  struct Case {
    const char* name;
    const char* config;
    const char* key;
  };
  const Case cases[] = {{"gemma2", "config.json", "tie_word_embeddings"},
                        {"gemma3_text", "config.json", "tie_word_embeddings"},
                        {"gemma3_text", "config_v4.json", "rope_theta"},
                        {"mixtral", "config_v4.json", "rope_theta"},
                        {"gpt_oss", "config_v4.json", "rope_theta"}};
  for (const auto& [name, config, key] : cases) {
    INFO(name << "/" << config << " without " << key);
    const std::string from = fixture(std::string("models/") + name);
    const std::string dir = test::temp_dir("class_defaults");
    for (const char* file : {"model.safetensors", "generation_config.json"}) {
      std::filesystem::copy_file(from + "/" + file, dir + "/" + file);
    }
    std::ofstream(dir + "/config.json")
        << without_keys(files::read_text(from + "/" + config), {key});
    ModelConfig c = load_model_config(dir);
    auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
    load_weights(*model, *checkpoint_source(dir));
    SafetensorsFile expected(from + "/expected.safetensors");
    const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    const at::Tensor real = mask.to(at::kBool);
    CHECK(max_abs(model->logits(ids, mask).index({real}), expected.load("logits").index({real})) <
          2e-5);
  }
}

TEST_CASE("a key given as null is transformers' None, not the class default an absent key takes",
          "[model][parity]") {
  // Mistral v0.2 / v0.3, Nemo and Small write "sliding_window": null (full attention), where an
  // absent key is MistralConfig's 4096; Gemma 2's soft-caps are off when null, 50 / 30 absent.
  const ModelConfig mistral = load_model_config(fixture("models/mistral"));
  REQUIRE(
      files::read_text(fixture("models/mistral/config.json")).find("\"sliding_window\": null") !=
      std::string::npos);
  CHECK_FALSE(mistral.sliding_window.has_value());
  for (const auto& l : model::decoder_spec(mistral).layers) CHECK_FALSE(l.attention.window);
  CHECK(load_model_config(fixture("models/mistral_head_dim")).sliding_window == std::nullopt);
  const ModelConfig absent = parse_model_config(
      without_keys(files::read_text(fixture("models/mistral/config.json")), {"sliding_window"}),
      "mistral without sliding_window");
  CHECK(absent.sliding_window == 4096);

  std::string gemma2 = files::read_text(fixture("models/gemma2/config.json"));
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    const std::string quoted = std::string("\"") + key + "\": ";
    const size_t at = gemma2.find(quoted);
    REQUIRE(at != std::string::npos);
    const size_t end = gemma2.find_first_of(",}", at);
    gemma2.replace(at, end - at, quoted + "null");
  }
  const model::DecoderSpec uncapped =
      model::decoder_spec(parse_model_config(gemma2, "gemma2 with null soft-caps"));
  CHECK_FALSE(uncapped.logit_softcap.has_value());
  for (const auto& l : uncapped.layers) CHECK_FALSE(l.attention.softcap.has_value());
  const model::DecoderSpec capped =
      model::decoder_spec(load_model_config(fixture("models/gemma2")));
  CHECK(capped.logit_softcap.has_value());
}

TEST_CASE("the same model loads from a sharded folder and from the 4.x config", "[model][parity]") {
  auto a = load_fixture_model("qwen2");
  ModelConfig c = load_model_config(fixture("models/qwen2/config_v4.json"));
  auto b = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*b, *checkpoint_source(fixture("models/qwen2_sharded")));
  at::Tensor ids = at::randint(0, c.vocab_size, {1, 9}, at::kLong);
  CHECK(at::equal(a->logits(ids), b->logits(ids)));
}

TEST_CASE("a checkpoint missing a tensor or with a wrong shape names the tensor",
          "[model][errors]") {
  std::string dir = test::temp_dir("ckpt");
  SafetensorsFile src(fixture("models/llama/model.safetensors"));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& n : src.names()) {
    if (n != "model.layers.1.self_attn.k_proj.weight") tensors.emplace_back(n, src.load(n));
  }
  save_safetensors(dir + "/model.safetensors", tensors);
  ModelConfig c = load_model_config(fixture("models/llama"));
  CausalLM model(c, at::TensorOptions(), false);
  CHECK_THROWS_WITH(load_weights(model, *checkpoint_source(dir)),
                    Contains("model.layers.1.self_attn.k_proj.weight") && Contains(dir));
  CHECK_THROWS_WITH(check_checkpoint(model, dir),
                    Contains("model.layers.1.self_attn.k_proj.weight"));
  tensors.emplace_back("model.layers.1.self_attn.k_proj.weight", at::zeros({5, 5}));
  save_safetensors(dir + "/model.safetensors", tensors);
  CHECK_THROWS_WITH(load_weights(model, *checkpoint_source(dir)),
                    Contains("shape") && Contains("[5, 5]"));
}

TEST_CASE("random initialization is seeded and follows transformers' rule", "[model]") {
  ModelConfig c = load_model_config(fixture("models/qwen2"));
  CausalLM a(c, at::TensorOptions()), b(c, at::TensorOptions()), d(c, at::TensorOptions());
  a.initialize_random(5);
  b.initialize_random(5);
  d.initialize_random(6);
  auto pa = a.named_parameters(), pb = b.named_parameters(), pd = d.named_parameters();
  for (const auto& p : pa) {
    INFO(p.key());
    CHECK(at::equal(p.value(), pb[p.key()]));
    if (p.key().find("norm.weight") != std::string::npos) {
      CHECK(at::equal(p.value(), at::ones_like(p.value())));
    } else if (p.key().find(".bias") != std::string::npos) {
      CHECK(at::equal(p.value(), at::zeros_like(p.value())));
    } else {
      CHECK_FALSE(at::equal(p.value(), pd[p.key()]));
      CHECK(p.value().std().item<double>() == Approx(0.02).epsilon(0.1));
    }
  }
  CHECK(c.parameter_count() == [&] {
    int64_t n = 0;
    for (const auto& p : pa) n += p.value().numel();
    return n;
  }());
}

TEST_CASE("greedy generation with the KV cache equals step-by-step full forwards",
          "[model][generate]") {
  // The mixtures of experts (fixture configs without weights yet) with seeded random weights,
  // their routers scaled up so that each token's choice of experts matters.
  // Gemma 2 / 3 and gpt-oss slide a window of 4 (soft-capped, sinks); dynamic NTK and LongRoPE
  // recompute their frequencies as the positions reach further.
  for (const char* name : {"llama", "qwen2", "mistral", "glm", "chatglm", "glm4", "qwen3", "phi3",
                           "gemma2", "gemma3_text", "llama_rope_dynamic", "phi3_longrope",
                           "qwen3_rope_yarn", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"}) {
    INFO(name);
    std::shared_ptr<CausalLM> model;
    if (std::filesystem::exists(fixture(std::string("models/") + name + "/model.safetensors"))) {
      model = load_fixture_model(name);
    } else {
      const ModelConfig c = load_model_config(fixture(std::string("models/") + name));
      model = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), false);
      load_weights(*model, *random_source(c, 17));
      at::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) {
        if (p.key().find("mlp.gate.weight") != std::string::npos) p.value().mul_(20.0);
      }
    }
    at::NoGradGuard no_grad;
    at::Tensor prompt = at::randint(3, 128, {2, 5}, at::kLong);
    GenerationOptions o;
    o.max_new_tokens = 6;
    at::Tensor fast = model->generate(prompt, o);
    at::Tensor seq = prompt;
    for (int i = 0; i < 6; ++i) {
      at::Tensor next = model->logits(seq).select(1, seq.size(1) - 1).argmax(-1, true);
      seq = at::cat({seq, next}, 1);
    }
    CHECK(at::equal(fast, seq.narrow(1, 5, 6)));
    // Sampling restricted to the top token is greedy; sampling is reproducible by seed.
    o.do_sample = true;
    o.top_k = 1;
    CHECK(at::equal(model->generate(prompt, o), fast));
    o.top_k = 0;
    o.top_p = 0.9;
    o.temperature = 0.8;
    o.seed = 3;
    CHECK(at::equal(model->generate(prompt, o), model->generate(prompt, o)));
  }
}

TEST_CASE("generation stops when every sequence produced an end token", "[model][generate]") {
  auto model = load_fixture_model("llama");
  at::Tensor prompt = at::randint(3, 128, {1, 4}, at::kLong);
  GenerationOptions o;
  o.max_new_tokens = 8;
  at::Tensor first = model->generate(prompt, o);
  o.eos_token_ids = {first[0][2].item<int64_t>()};
  at::Tensor stopped = model->generate(prompt, o);
  CHECK(stopped.size(1) <= 3);
}

TEST_CASE("a packed sequence gives each document's own loss and gradients", "[model][packing]") {
  // Three documents of different lengths, alone and packed into one row with padding after.
  for (const char* name : {"llama", "mistral"}) {  // mistral: a sliding window as well
    INFO(name);
    auto model = load_fixture_model(name);
    const int64_t lengths[] = {5, 9, 4};
    at::Tensor docs[3];
    at::manual_seed(3);
    for (int d = 0; d < 3; ++d)
      docs[d] = at::randint(3, model->config().vocab_size, {1, lengths[d]}, at::kLong);
    double alone_sum = 0;
    int64_t alone_tokens = 0;
    model->zero_grad();
    for (const at::Tensor& ids : docs) {
      LossSum l = model->loss(ids, ids);
      alone_sum += l.sum.item<double>();
      alone_tokens += l.tokens;
      l.sum.backward();
    }
    std::vector<at::Tensor> alone_grads;
    for (const at::Tensor& p : model->parameters()) alone_grads.push_back(p.grad().clone());

    const int64_t total = 5 + 9 + 4, padded = total + 3;
    at::Tensor ids = at::zeros({1, padded}, at::kLong),
               labels = at::full({1, padded}, -100, at::kLong);
    at::Tensor mask = at::zeros({1, padded}, at::kLong),
               positions = at::zeros({1, padded}, at::kLong);
    int64_t at_pos = 0;
    for (int d = 0; d < 3; ++d) {
      ids.narrow(1, at_pos, lengths[d]).copy_(docs[d]);
      labels.narrow(1, at_pos, lengths[d]).copy_(docs[d]);
      labels[0][at_pos] = -100;  // the first token's label would be predicted across documents
      mask.narrow(1, at_pos, lengths[d]).fill_(d + 1);
      positions.narrow(1, at_pos, lengths[d]).copy_(at::arange(lengths[d], at::kLong));
      at_pos += lengths[d];
    }
    model->zero_grad();
    LossSum packed = model->loss(ids, labels, mask, 1024, positions);
    packed.sum.backward();
    CHECK(packed.tokens == alone_tokens);
    CHECK(packed.sum.item<double>() == Approx(alone_sum).epsilon(1e-5));
    size_t i = 0;
    for (const at::Tensor& p : model->parameters())
      CHECK(max_abs(p.grad(), alone_grads[i++]) < 1e-5);
  }
}

TEST_CASE("document spans: each row's runs laid end to end, or none where a document comes back",
          "[model][packing]") {
  // Rows described as runs (document number, length); the mask writes them out and the spans
  // must be the runs' lengths, cumulated over the rows in order.
  using Runs = std::vector<std::pair<int64_t, int64_t>>;
  auto mask_of = [](const std::vector<Runs>& rows) {
    int64_t width = 0;
    for (const auto& [doc, n] : rows[0]) width += n;
    at::Tensor m = at::empty({static_cast<int64_t>(rows.size()), width}, at::kLong);
    for (size_t r = 0; r < rows.size(); ++r) {
      int64_t t = 0;
      for (const auto& [doc, n] : rows[r]) m[r].narrow(0, t, n).fill_(doc), t += n;
      REQUIRE(t == width);
    }
    return m;
  };
  const std::vector<std::vector<Runs>> cases = {
      {{{1, 5}, {2, 9}, {3, 4}, {0, 3}}, {{1, 21}}, {{1, 7}, {2, 7}, {0, 7}}},  // packed
      {{{1, 6}, {0, 2}}, {{1, 8}}},                                             // plain, padded
      {{{0, 3}, {1, 5}}, {{1, 8}}},        // left padding; a row boundary inside doc 1
      {{{0, 2}, {1, 3}, {0, 2}, {2, 1}}},  // padding twice in a row
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO("case " << i);
    std::optional<model::DocumentSpans> spans =
        model::document_spans(mask_of(cases[i]), at::Device(at::kCPU));
    REQUIRE(spans.has_value());
    std::vector<int32_t> want{0};
    int64_t longest = 0;
    for (const Runs& row : cases[i]) {
      for (const auto& [doc, n] : row) {
        want.push_back(want.back() + static_cast<int32_t>(n));
        longest = std::max(longest, n);
      }
    }
    const at::Tensor got = spans->cu_seqlens;
    CHECK(got.scalar_type() == at::kInt);
    CHECK(std::vector<int32_t>(got.data_ptr<int32_t>(), got.data_ptr<int32_t>() + got.numel()) ==
          want);
    CHECK(spans->max_length == longest);
  }
  // Document 1 again after document 2 in one row: the two runs attend to each other under the
  // mask, which spans cannot say.
  CHECK_FALSE(model::document_spans(mask_of({{{1, 2}, {2, 2}, {1, 2}}}), at::Device(at::kCPU)));
  // Variable-length attention is a GPU path: never on the CPU, whatever the dtype.
  ModelConfig c = load_model_config(fixture("models/llama/config.json"));
  CHECK_FALSE(model::varlen_attention_applies(c, at::kBFloat16, at::Device(at::kCPU)));
}

TEST_CASE("the example shape configs parse and have their models' parameter counts",
          "[model][config]") {
  // Published sizes: Qwen2.5-7B 7.62 B, LLaMA-2-7B 6.74 B, LLaMA-2-13B 13.02 B, GLM-4-9B 9.40 B
  // parameters; the mixtures of experts all experts counted: Qwen3-30B-A3B 30.53 B, Mixtral-8x7B
  // 46.70 B.
  const std::pair<const char*, double> shapes[] = {
      {"qwen2.5-7b", 7.62e9}, {"llama-2-7b", 6.74e9},     {"llama-2-13b", 13.02e9},
      {"glm-4-9b", 9.40e9},   {"qwen3-30b-a3b", 30.53e9}, {"mixtral-8x7b", 46.70e9}};
  for (const auto& [name, published] : shapes) {
    INFO(name);
    ModelConfig c = load_model_config(std::string(ZT_EXAMPLES) + "/shapes/" + name + ".json");
    CausalLM m(c, at::TensorOptions(), /*allocate=*/false);  // shapes only
    int64_t count = 0;
    for (const auto& p : m.parameters()) count += p.numel();
    CHECK(static_cast<double>(count) == Approx(published).epsilon(0.005));
  }
  // What one token's forward multiplies: Qwen3-30B-A3B's published 3.3 B activated parameters
  // (8 of 128 experts), Mixtral-8x7B's 12.9 B (2 of 8); a dense model's are all of them.
  for (const auto& [name, published] :
       {std::pair<const char*, double>{"qwen3-30b-a3b", 3.35e9}, {"mixtral-8x7b", 12.88e9}}) {
    INFO(name);
    const ModelConfig c = load_model_config(std::string(ZT_EXAMPLES) + "/shapes/" + name + ".json");
    const int64_t active = model::parameter_count(model::decoder_spec(c), c.hidden_size,
                                                  c.vocab_size, c.tie_word_embeddings, true);
    CHECK(static_cast<double>(active) == Approx(published).epsilon(0.01));
  }
  const ModelConfig dense = load_model_config(std::string(ZT_EXAMPLES) + "/shapes/llama-2-7b.json");
  CHECK(model::parameter_count(model::decoder_spec(dense), dense.hidden_size, dense.vocab_size,
                               dense.tie_word_embeddings, true) == dense.parameter_count());
}

TEST_CASE("RMSNorm's own backward gives autograd's gradients of transformers' formula", "[model]") {
  // The formula as transformers writes it, differentiated by autograd.
  auto reference = [](const at::Tensor& x, const at::Tensor& w, double eps) {
    at::Tensor h = x.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return w * h.to(x.scalar_type());
  };
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool weight_grad : {true, false}) {
      INFO("dtype " << c10::toString(dtype) << ", weight requires grad " << weight_grad);
      at::Tensor x0 = (at::randn({3, 5, 64}) * 3 + 0.5).to(dtype);
      at::Tensor w0 = (at::rand({64}) + 0.5).to(dtype);
      at::Tensor g = at::randn({3, 5, 64}).to(dtype);
      at::Tensor xs[2], ws[2], ys[2];
      for (int k = 0; k < 2; ++k) {
        xs[k] = x0.clone().requires_grad_(true);
        ws[k] = w0.clone().requires_grad_(weight_grad);
        ys[k] = k == 0 ? reference(xs[k], ws[k], 1e-6) : model::rms_norm(xs[k], ws[k], 1e-6);
        ys[k].backward(g);
      }
      CHECK(at::equal(ys[0], ys[1]));  // the same forward operations: bit-identical
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      CHECK(at::allclose(xs[1].grad().to(at::kFloat), xs[0].grad().to(at::kFloat), tol, tol));
      CHECK(xs[1].grad().scalar_type() == dtype);
      if (weight_grad) {
        CHECK(at::allclose(ws[1].grad().to(at::kFloat), ws[0].grad().to(at::kFloat), tol, tol));
      } else {
        CHECK_FALSE(ws[1].grad().defined());
      }
    }
  }
}

TEST_CASE("a LoRA projection gives PEFT's output and gradients, also when its output is unread",
          "[model][peft]") {
  at::manual_seed(6);
  for (bool with_bias : {false, true}) {
    for (double scaling : {2.0, 1.0}) {
      for (bool frozen : {true, false}) {
        INFO("bias " << with_bias << ", scaling " << scaling << ", base frozen " << frozen);
        const at::Tensor x0 = at::randn({2, 3, 12}), w0 = at::randn({10, 12}), b0 = at::randn({10}),
                         a0 = at::randn({4, 12}), bb0 = at::randn({10, 4});
        const at::Tensor g = at::randn({2, 3, 10});
        // PEFT's LoRA layer: base(x) + lora_B(lora_A(dropout(x))) * scaling, dropout off.
        auto peft = [&](const std::vector<at::Tensor>& v) {
          return at::linear(v[0], v[1], with_bias ? v[2] : at::Tensor()) +
                 at::linear(at::linear(v[0], v[3]), v[4]) * scaling;
        };
        auto leaves = [&] {
          std::vector<at::Tensor> v{x0.clone(), w0.clone(), b0.clone(), a0.clone(), bb0.clone()};
          for (size_t i = 0; i < v.size(); ++i)
            v[i].requires_grad_(!(frozen && (i == 1 || i == 2)));
          return v;
        };
        std::vector<at::Tensor> want_in = leaves();
        const at::Tensor want = peft(want_in);
        want.backward(g);
        for (bool unread : {false, true}) {
          INFO("output unread " << unread);
          std::vector<at::Tensor> in = leaves();
          const at::Tensor got = peft::lora_linear(in[0], in[1], with_bias ? in[2] : at::Tensor(),
                                                   in[3], in[4], scaling, unread);
          REQUIRE(got.sizes() == want.sizes());
          if (!unread) CHECK(at::allclose(got, want, 1e-5, 1e-5));
          got.backward(g);
          for (size_t i = 0; i < in.size(); ++i) {
            INFO("input " << i << " (x, weight, bias, lora_A, lora_B)");
            if (!in[i].requires_grad() || (i == 2 && !with_bias)) {
              CHECK_FALSE(in[i].grad().defined());
              continue;
            }
            REQUIRE(in[i].grad().defined());
            CHECK(at::allclose(in[i].grad(), want_in[i].grad(), 1e-5, 1e-5));
          }
        }
      }
    }
  }
}

TEST_CASE("the chunked loss gives autograd's gradients, and none for a frozen head", "[model]") {
  at::manual_seed(4);
  at::Tensor h0 = at::randn({10, 16}), w0 = at::randn({40, 16});
  at::Tensor labels = at::randint(0, 40, {10}, at::kLong);
  labels[3] = -100;
  // The reference: full logits, summed cross-entropy over the labelled rows.
  at::Tensor h_ref = h0.clone().requires_grad_(true), w_ref = w0.clone().requires_grad_(true);
  at::Tensor logits = at::matmul(h_ref, w_ref.t());
  at::Tensor ref = at::cross_entropy_loss(logits, labels, {}, at::Reduction::Sum, -100);
  ref.backward();
  // Backward gets 0.37 (as from a token normalization), so the incoming gradient must be applied.
  for (bool head_trains : {true, false}) {
    for (bool eager : {true, false}) {
      INFO("head trains " << head_trains << ", gradients "
                          << (eager ? "in forward" : "in backward"));
      at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(head_trains);
      at::Tensor loss = model::linear_cross_entropy(h, w, labels, /*chunk=*/3, eager);
      (loss * 0.37).backward();
      CHECK(loss.item<double>() == Approx(ref.item<double>()).epsilon(1e-5));
      CHECK(at::allclose(h.grad(), h_ref.grad() * 0.37, 1e-5, 1e-6));
      if (head_trains) {
        CHECK(at::allclose(w.grad(), w_ref.grad() * 0.37, 1e-5, 1e-6));
      } else {
        CHECK_FALSE(w.grad().defined());
      }
    }
  }
  at::NoGradGuard no_grad;  // evaluation: the same sum
  CHECK(model::linear_cross_entropy(h0, w0, labels, 4).item<double>() ==
        Approx(ref.item<double>()).epsilon(1e-5));
}

TEST_CASE("right padding needs no mask: causal attention never reaches it", "[model]") {
  // What the trainer relies on to run unmasked (flash) attention for right-padded batches:
  // the loss and gradients of the real tokens are the same with and without the mask. Left
  // padding is different, so the mask is kept for it.
  auto model = load_fixture_model("llama");
  at::manual_seed(5);
  const int64_t vocab = model->config().vocab_size;
  at::Tensor ids = at::randint(3, vocab, {3, 12}, at::kLong);
  at::Tensor labels = ids.clone(), mask = at::ones({3, 12}, at::kLong);
  for (int64_t r : {1, 2}) {  // rows 1 and 2 end in padding
    const int64_t real = r == 1 ? 7 : 10;
    ids[r].narrow(0, real, 12 - real).fill_(0);
    labels[r].narrow(0, real, 12 - real).fill_(-100);
    mask[r].narrow(0, real, 12 - real).fill_(0);
  }
  auto run = [&](const at::Tensor& ids_, const at::Tensor& labels_, const at::Tensor& mask_) {
    model->zero_grad();
    LossSum l = model->loss(ids_, labels_, mask_);
    l.sum.backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(l.sum.item<double>(), grads);
  };
  const auto masked = run(ids, labels, mask), unmasked = run(ids, labels, at::Tensor());
  CHECK(unmasked.first == Approx(masked.first).epsilon(1e-6));
  for (size_t i = 0; i < masked.second.size(); ++i)
    CHECK(max_abs(unmasked.second[i], masked.second[i]) < 1e-6);
  // The same rows padded on the left: without the mask the real tokens would see the padding.
  at::Tensor lids = ids.flip({1}), llabels = labels.flip({1}), lmask = mask.flip({1});
  CHECK(run(lids, llabels, at::Tensor()).first !=
        Approx(run(lids, llabels, lmask).first).epsilon(1e-4));
}

TEST_CASE("random weights are the same whole, in slices and on any number of threads", "[model]") {
  // Ranks read the slices they keep; the values must not depend on how the reads are cut (the
  // weight spans three generator chunks of 4 Mi elements) or on the thread count.
  ModelConfig c = load_model_config(fixture("models/qwen2"));
  auto source = random_source(c, 7);
  const std::vector<int64_t> shape{3, 3'000'001};
  const int64_t n = 3 * 3'000'001;
  at::Tensor whole = at::empty({n});
  source->read("model.layers.0.mlp.up_proj.weight", shape, 0, whole);
  CHECK(whole.std().item<double>() == Approx(c.initializer_range).epsilon(0.01));
  at::Tensor pieces = at::empty({n});
  const int64_t cuts[] = {0, 17, 4'194'303, 4'194'305, 8'388'700, n};
  ::setenv("ZT_CPU_THREADS", "3", 1);  // util/threads.hpp
  for (size_t i = 0; i + 1 < std::size(cuts); ++i) {
    source->read("model.layers.0.mlp.up_proj.weight", shape, cuts[i],
                 pieces.narrow(0, cuts[i], cuts[i + 1] - cuts[i]));
  }
  ::unsetenv("ZT_CPU_THREADS");
  CHECK(at::equal(whole, pieces));
  at::Tensor bf16 = at::empty({n}, at::kBFloat16);  // another dtype goes through fp32
  source->read("model.layers.0.mlp.up_proj.weight", shape, 0, bf16);
  CHECK(at::equal(bf16, whole.to(at::kBFloat16)));
  at::Tensor other = at::empty({n});
  source->read("model.layers.1.mlp.up_proj.weight", shape, 0, other);
  CHECK_FALSE(at::equal(whole.narrow(0, 0, 1000), other.narrow(0, 0, 1000)));
}
