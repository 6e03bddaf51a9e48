// Model families (lib/model/family.hpp): each registered family reads back the config.json it
// writes, and a family defined outside the library is one definition and one registration.
#include "support/catch.hpp"

#include <filesystem>
#include <string>

#include "model/families/decoder.hpp"
#include "model/family.hpp"
#include "support/messages.hpp"
#include "support/models.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

namespace {

std::string fixture_config(const std::string& name) {
  return std::string(ZT_FIXTURES) + "/models/" + name + "/config.json";
}

// A test's own family: llama's keys under another model_type, written under another
// architecture name. One definition, one registration.
void read_twin(json::ObjectReader& r, ModelConfig& c) {
  model::decoder::read_common(r, c);
  model::decoder::read_projection_biases(r, c);
}

void write_twin(rapidjson::Document& doc, const ModelConfig& c) {
  model::decoder::write_common(doc, c, "LlamaTwinForCausalLM");
  model::decoder::write_token_ids(doc, c);
}

const model::Family kTwin{"llama_twin", read_twin, write_twin};

}  // namespace

TEST_CASE("every family reads back the config.json it writes as the same model",
          "[model][families]") {
  // One fixture folder per family (tests/fixtures/models/<model_type>): a family without one
  // fails here, so none goes untested.
  for (const model::Family* family : model::families()) {
    if (family == &kTwin) continue;  // the next test's, when it ran first
    const std::string name(family->model_type);
    INFO("family " << name);
    REQUIRE(std::filesystem::exists(fixture_config(name)));
    ModelConfig from_file = load_model_config(fixture_config(name));
    REQUIRE(from_file.model_type == name);
    ModelConfig inline_config = from_file;
    inline_config.source_json.clear();  // written in full by the family, not copied
    const std::string text = model_config_json(inline_config);
    test::check_same_model(parse_model_config(text, name + " (written)"), from_file);
    // As read from its own file, the written text keeps the file's members.
    test::check_same_model(parse_model_config(model_config_json(from_file), name + " (kept)"),
                           from_file);
    // What the config says the model costs is what the family's blocks build (the trainer's
    // memory checks read the count before anything exists).
    CausalLM built(from_file, at::TensorOptions(), /*allocate=*/false);
    int64_t built_count = 0;
    for (const auto& p : built.parameters()) built_count += p.numel();
    CHECK(from_file.parameter_count() == built_count);
  }
}

TEST_CASE("every RoPE scaling reads back from the config.json written for it",
          "[model][families]") {
  for (const char* name :
       {"llama_rope_linear", "llama_rope_llama3", "llama_rope_yarn", "llama_rope_dynamic",
        "qwen3_rope_yarn", "phi3_longrope", "phi3_longrope_long", "gemma3_text"}) {
    INFO("fixture " << name);
    for (const char* file : {"config.json", "config_v4.json"}) {
      INFO(file);
      const ModelConfig from_file =
          load_model_config(std::string(ZT_FIXTURES) + "/models/" + name + "/" + file);
      CHECK(from_file.rope_scaling.type != "default");
      ModelConfig inline_config = from_file;
      inline_config.source_json.clear();
      test::check_same_model(parse_model_config(model_config_json(inline_config), "written"),
                             from_file);
      test::check_same_model(parse_model_config(model_config_json(from_file), "kept"), from_file);
    }
  }
}

TEST_CASE("a family defined outside the library is one definition and one registration",
          "[model][families]") {
  rapidjson::Document doc =
      json::parse(files::read_text(fixture_config("llama"), "config"), "llama config");
  model::decoder::set_member(doc, "model_type", rapidjson::Value("llama_twin"), doc.GetAllocator());
  const std::string twin_text = json::dump(doc);
  if (model::find_family("llama_twin") == nullptr) {
    CHECK_THROWS_MATCHES(
        parse_model_config(twin_text, "twin.json"), ConfigError,
        test::Has({"twin.json", "model_type", "\"llama_twin\" is not supported",
                   "supported: llama, qwen2, qwen3, qwen3_moe, mistral, mistral3, mixtral, phi3, "
                   "gemma2, gemma3_text, gemma3, glm, glm4, glm4_moe, gpt_oss, "
                   "chatglm"}));
    model::register_family(kTwin);
  }
  CHECK_THROWS_AS(model::register_family(kTwin), InvalidArgument);
  CHECK_THAT(model::family_names(), Catch::EndsWith(", llama_twin"));

  const ModelConfig twin = parse_model_config(twin_text, "twin.json");
  const ModelConfig llama = load_model_config(fixture_config("llama"));
  CHECK(twin.model_type == "llama_twin");
  CHECK(model_config_json(twin).find("\"llama_twin\"") != std::string::npos);
  ModelConfig twin_inline = twin;
  twin_inline.source_json.clear();
  CHECK(model_config_json(twin_inline).find("LlamaTwinForCausalLM") != std::string::npos);

  // The same blocks: same parameters, same logits from the same seed.
  CausalLM a(twin, at::TensorOptions()), b(llama, at::TensorOptions());
  a.initialize_random(7);
  b.initialize_random(7);
  auto pa = a.named_parameters(), pb = b.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (const auto& p : pa) {
    INFO(p.key());
    REQUIRE(pb.contains(p.key()));
    CHECK(at::equal(p.value(), pb[p.key()]));
  }
  const at::Tensor ids = at::arange(12, at::kLong).remainder(llama.vocab_size).reshape({2, 6});
  const at::Tensor mask = at::ones_like(ids);
  CHECK(at::equal(a.logits(ids, mask), b.logits(ids, mask)));
}

namespace {

// A family whose output layer is not called lm_head: llama's blocks under Megatron-like names of
// its own choosing (what a new family's file would declare).
void write_renamed(rapidjson::Document& doc, const ModelConfig& c) {
  model::decoder::write_common(doc, c, "RenamedForCausalLM");
}
constexpr model::ModuleNames kRenamedNames{
    "decoder",   "tok_embed",      "blocks", "final_norm",   "to_vocab", /*head_in_body=*/false,
    "self_attn", /*fused_qkv=*/"", "o_proj", "gate_up_proj", "down_proj"};
const model::Family kRenamed{"llama_renamed", read_twin, write_renamed,
                             nullptr,         false,     kRenamedNames};

}  // namespace

TEST_CASE("LoRA's all-linear leaves out the output layer that the model's family names",
          "[model][peft]") {
  if (model::find_family("llama_renamed") == nullptr) model::register_family(kRenamed);
  rapidjson::Document doc =
      json::parse(files::read_text(fixture_config("llama"), "config"), "llama config");
  model::decoder::set_member(doc, "model_type", rapidjson::Value("llama_renamed"),
                             doc.GetAllocator());
  const ModelConfig config = parse_model_config(json::dump(doc), "renamed.json");
  REQUIRE_FALSE(config.tie_word_embeddings);  // an output layer of its own, to leave out
  CausalLM model(config, at::TensorOptions());
  REQUIRE(model.named_parameters().contains("to_vocab.weight"));
  PeftConfig peft;
  peft.type = FinetuningType::kLora;
  peft.lora.target_modules = {"all-linear"};
  apply_peft(model, peft, 1);
  int64_t adapted = 0;
  for (const auto& p : model.named_parameters()) {
    INFO(p.key());
    CHECK(p.key().rfind("to_vocab.lora_", 0) != 0);
    adapted += p.key().find(".lora_A.") != std::string::npos;
  }
  // Every projection of every decoder layer, and nothing else.
  CHECK(adapted == 7 * config.num_hidden_layers);
}
