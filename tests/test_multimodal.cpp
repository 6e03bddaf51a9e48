// Multimodal folders whose text decoder zerotrain trains on text alone: Gemma 3 as published
// (model_type gemma3, Gemma3ForConditionalGeneration). The fixture models/gemma3 is transformers
// 5.17's own save of a tiny Gemma3ForConditionalGeneration with a SigLIP tower
// (tests/tools/make_fixtures.py multimodal).
#include "support/catch.hpp"

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "data/chat_templates.hpp"
#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The layouts transformers saves a Gemma3ForConditionalGeneration in: the original one
// (language_model.model.*, vision_tower.*; 5.x's default), and its module tree's names
// (model.language_model.*, model.vision_tower.*: 4.52-4.57, and 5.x with
// save_original_format=False — the same 103 names for this fixture, seen on the GPU machine).
std::string module_tree_name(const std::string& original) {
  for (const auto& [from, to] :
       {std::pair{"language_model.model.", "model.language_model."},
        std::pair{"language_model.lm_head.", "lm_head."},
        std::pair{"vision_tower.", "model.vision_tower."},
        std::pair{"multi_modal_projector.", "model.multi_modal_projector."}}) {
    if (starts_with(original, from)) return to + original.substr(std::string(from).size());
  }
  return original;
}

std::string dtype_name_of(at::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "float32";
}

bool is_vision_part(const std::string& name) {
  return name.find("vision_tower.") != std::string::npos ||
         name.find("multi_modal_projector.") != std::string::npos;
}

// A copy of `from` whose tensors are renamed by `rename` and whose config.json is `config`.
void write_folder(const std::string& from, const std::string& to, const std::string& config,
                  std::string (*rename)(const std::string&)) {
  fs::create_directories(to);
  files::write_atomic(to + "/config.json", config);
  SafetensorsCheckpoint in(from);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& name : in.names()) tensors.emplace_back(rename(name), in.load(name));
  save_safetensors(to + "/model.safetensors", tensors);
}

std::shared_ptr<CausalLM> load(const std::string& dir) {
  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*model, *checkpoint_source(dir));
  check_checkpoint(*model, dir);
  return model;
}

std::string same_name(const std::string& name) {
  return name;
}

// The fixture's config.json as google/gemma-3-4b-it's is written (transformers 4.50): text_config
// holds only what differs from Gemma3TextConfig's defaults, RoPE in the 4.x spelling, no
// top-level tie_word_embeddings or dtype.
std::string released_config() {
  rapidjson::Document doc;
  doc.Parse(files::read_text(fixture("models/gemma3/config.json")).c_str());
  rapidjson::Value& text = doc["text_config"];
  for (const char* key :
       {"_sliding_window_pattern", "attention_bias", "attention_dropout", "attn_logit_softcapping",
        "final_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id",
        "hidden_activation", "initializer_range", "layer_types", "rms_norm_eps",
        "sliding_window_pattern", "tie_word_embeddings", "use_bidirectional_attention", "use_cache",
        "rope_parameters"}) {
    REQUIRE(text.HasMember(key));
    text.RemoveMember(key);
  }
  rapidjson::Document scaling(&doc.GetAllocator());
  scaling.Parse(R"({"factor": 8.0, "rope_type": "linear"})");
  text.AddMember("rope_scaling", rapidjson::Value(scaling, doc.GetAllocator()), doc.GetAllocator());
  doc.RemoveMember("tie_word_embeddings");
  doc.RemoveMember("dtype");
  return json::dump(doc);
}

}  // namespace

TEST_CASE("Gemma 3 as published: its text_config at Gemma3TextConfig's defaults, either layout",
          "[model][families][multimodal]") {
  const std::string dir = fixture("models/gemma3");
  SafetensorsFile expected(dir + "/expected.safetensors");
  const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
  const at::Tensor real = mask.to(at::kBool);
  auto model = load(dir);
  const at::Tensor want = model->logits(ids, mask);
  CHECK(max_abs(want.index({real}), expected.load("logits").index({real})) < 2e-5);
  // transformers' module tree: the decoder under model.language_model, the head tied.
  for (const auto& p : model->named_parameters()) {
    INFO(p.key());
    CHECK(starts_with(p.key(), "model.language_model."));
  }

  // The same weights under the module tree's names, and under a config.json written as a diff.
  const std::string tmp = test::temp_dir("gemma3_layouts");
  write_folder(dir, tmp + "/new_names", files::read_text(dir + "/config.json"), module_tree_name);
  write_folder(dir, tmp + "/released", released_config(), same_name);
  for (const char* variant : {"new_names", "released"}) {
    INFO(variant);
    auto other = load(tmp + "/" + variant);
    CHECK(max_abs(other->logits(ids, mask), want) < 1e-6);
    test::check_same_model(other->config(), model->config());
  }

  // text_config left out: every member at Gemma3TextConfig's default (its source, transformers
  // 5.17), as Gemma3Config(text_config=None) builds it. google/gemma-3-4b-it's six keys give
  // its published size, 3.88 B parameters beside the vision tower.
  const ModelConfig defaults =
      parse_model_config(R"({"model_type": "gemma3", "vision_config": {}})", "defaults.json");
  CHECK(defaults.vocab_size == 262208);
  CHECK(defaults.hidden_size == 2304);
  CHECK(defaults.intermediate_size == 9216);
  CHECK(defaults.num_hidden_layers == 26);
  CHECK(defaults.num_attention_heads == 8);
  CHECK(defaults.num_key_value_heads == 4);
  CHECK(defaults.head_dim == 256);
  CHECK(defaults.rms_norm_eps == 1e-6);
  CHECK(defaults.rope_theta == 1e6);
  CHECK(defaults.tie_word_embeddings);
  CHECK(defaults.max_position_embeddings == 131072);
  CHECK(defaults.bos_token_id == 2);
  CHECK(defaults.eos_token_id == 1);
  CHECK(defaults.pad_token_id == 0);
  const ModelConfig four_b = parse_model_config(
      R"({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {"hidden_size": 2560,
          "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
          "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
          "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"}})",
      "gemma-3-4b-it.json");
  CHECK(four_b.parameter_count() / 10'000'000 == 388);
  CHECK(four_b.dtype == at::kBFloat16);
  CHECK(four_b.eos_token_id == 1);
  CHECK(four_b.rope_scaling.type == "linear");

  // Bad input names its place inside text_config.
  auto error_of = [](const std::string& text) {
    try {
      parse_model_config(text, "bad.json");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_of(R"({"model_type": "gemma3", "text_config": "big"})"),
             Catch::Contains("text_config") && Catch::Contains("object"));
  CHECK_THAT(error_of(R"({"model_type": "gemma3", "text_config": {"hidden_size": "big"}})"),
             Catch::Contains("text_config.hidden_size"));
  CHECK_THAT(error_of(R"({"model_type": "gemma3", "text_config": {"hidden_activation": "relu"}})"),
             Catch::Contains("text_config.hidden_activation"));
  CHECK_THAT(error_of(R"({"model_type": "gemma3", "text_config": {"num_key_value_heads": 3}})"),
             Catch::Contains("text_config.num_key_value_heads"));
}

TEST_CASE("Mistral-Small-3.1 as published: an untied head from text_config, its layout's names",
          "[model][families][multimodal]") {
  // transformers 5.17's own mistral3 fixture ties the head (its Mistral3Config writes a top-level
  // tie_word_embeddings true). The published folders (transformers 4.50) have no top-level key,
  // text_config's false, and language_model.lm_head.weight: that head is read, as vLLM reads it
  // (transformers 5 would tie it to the embeddings: vLLM #51063).
  const std::string dir = fixture("models/mistral3");
  const std::string tmp = test::temp_dir("mistral3_released");
  rapidjson::Document config;
  config.Parse(files::read_text(dir + "/config.json").c_str());
  config.RemoveMember("tie_word_embeddings");
  REQUIRE(config["text_config"]["tie_word_embeddings"].IsFalse());
  fs::create_directories(tmp);
  files::write_atomic(tmp + "/config.json", json::dump(config));
  SafetensorsCheckpoint in(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& name : in.names()) tensors.emplace_back(name, in.load(name));
  const at::Tensor head = in.load("language_model.model.embed_tokens.weight") * 1.5;
  tensors.emplace_back("language_model.lm_head.weight", head);
  save_safetensors(tmp + "/model.safetensors", tensors);
  auto model = load(tmp);
  CHECK_FALSE(model->config().tie_word_embeddings);
  const auto params = model->named_parameters();
  REQUIRE(params.contains("lm_head.weight"));
  CHECK(at::equal(params["lm_head.weight"], head));
  // The fixture's own (tied) logits with the head scaled: 1.5 × the tied model's.
  auto tied = load(dir);
  SafetensorsFile expected(dir + "/expected.safetensors");
  const at::Tensor ids = expected.load("input_ids");
  CHECK(max_abs(model->logits(ids), tied->logits(ids) * 1.5) < 1e-4);

  // Mistral-Small-3.1-24B-Instruct-2503's text_config: 23.57 B parameters beside the tower.
  const ModelConfig small = parse_model_config(
      R"({"model_type": "mistral3", "image_token_index": 10, "projector_hidden_act": "gelu",
          "spatial_merge_size": 2, "text_config": {"head_dim": 128, "hidden_size": 5120,
          "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
          "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
          "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": null,
          "vocab_size": 131072}, "torch_dtype": "bfloat16", "vision_config": {"model_type": "pixtral"}})",
      "mistral-small-3.1.json");
  CHECK(small.parameter_count() / 10'000'000 == 2357);
  CHECK_FALSE(small.tie_word_embeddings);
  CHECK_FALSE(small.sliding_window.has_value());
  // A text decoder of another family under mistral3 is refused by key.
  CHECK_THROWS_WITH(parse_model_config(R"({"model_type": "mistral3", "text_config":
                                           {"model_type": "ministral3"}})",
                                       "ministral.json"),
                    Catch::Contains("text_config.model_type") && Catch::Contains("ministral3"));
}

TEST_CASE("Gemma 3 and Mistral-Small as published train LoRA, QLoRA and full, keeping the tower",
          "[model][families][multimodal][peft][trainer]") {
  for (const std::string family : {"gemma3", "mistral3"}) {
    INFO(family);
    // A base of the byte-level tokenizer's vocabulary in the original layout, with the
    // fixture's vision tower and projector.
    const std::string dir = test::temp_dir(family + "_runs");
    rapidjson::Document config;
    config.Parse(files::read_text(fixture("models/" + family + "/config.json")).c_str());
    config["text_config"]["vocab_size"].SetInt(300);
    // As some published folders state it: a dtype inside text_config too (the runs write fp32).
    config["text_config"].AddMember("dtype", "bfloat16", config.GetAllocator());
    test::write_model_folder(dir + "/random", json::dump(config), 41);
    {
      SafetensorsCheckpoint random(dir + "/random"), tower(fixture("models/" + family));
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const std::string& name : random.names()) {
        REQUIRE(starts_with(name, "model.language_model."));
        tensors.emplace_back("language_model.model." + name.substr(21), random.load(name));
      }
      for (const std::string& name : tower.names()) {
        if (is_vision_part(name)) tensors.emplace_back(name, tower.load(name));
      }
      fs::create_directories(dir + "/base");
      files::write_atomic(dir + "/base/config.json", json::dump(config));
      save_safetensors(dir + "/base/model.safetensors", tensors);
    }
    SafetensorsCheckpoint base(dir + "/base");
    std::map<std::string, at::Tensor> tower;
    for (const std::string& name : base.names()) {
      if (is_vision_part(name)) tower[module_tree_name(name)] = base.load(name);
    }
    REQUIRE(tower.size() > 10);
    test::write_data(dir, "train.jsonl", 16, 9);

    // The vision tower, under transformers' module names, exactly as the base had it; the
    // config.json the base's multimodal one.
    auto check_whole_folder = [&](const std::string& folder) {
      INFO("folder " << folder);
      SafetensorsCheckpoint written(folder);
      for (const auto& [name, values] : tower) {
        INFO(name);
        REQUIRE(written.contains(name));
        CHECK(at::equal(written.load(name), values));
      }
      const ModelConfig c = load_model_config(folder);
      CHECK(c.model_type == family);
      // The dtype written, at the top and wherever text_config states one.
      rapidjson::Document written_config;
      written_config.Parse(files::read_text(folder + "/config.json").c_str());
      CHECK(json::text(written_config["dtype"]) == dtype_name_of(c.dtype));
      for (const char* d : {"torch_dtype", "dtype"}) {
        if (written_config["text_config"].HasMember(d)) {
          CHECK(json::text(written_config["text_config"][d]) ==
                json::text(written_config["dtype"]));
        }
      }
      CHECK_THAT(files::read_text(folder + "/config.json"), Catch::Contains("vision_config"));
      return load(folder);
    };

    const int64_t layers = load_model_config(dir + "/base").num_hidden_layers;
    for (const std::string method : {"lora", "qlora", "full"}) {
      INFO(method);
      const std::string out = dir + "/out_" + method;
      std::vector<std::string> flags{"--max_steps",       "2",
                                     "--save_steps",      "2",
                                     "--output_dir",      out,
                                     "--finetuning_type", method == "full" ? "full" : "lora",
                                     "--lora_target",     "q_proj,v_proj",
                                     "--lora_r",          "4"};
      if (method == "qlora") flags.insert(flags.end(), {"--quantization_bit", "4"});
      const std::vector<double> losses = test::train_on_base(dir, flags);
      REQUIRE(losses.size() == 2);
      for (double l : losses) CHECK(std::isfinite(l));
      if (method == "full") {
        check_whole_folder(out);
        continue;
      }
      // PEFT's keys on the *ForConditionalGeneration, and targets that leave the tower alone
      // (PEFT would match "q_proj" in the vision tower too).
      SafetensorsCheckpoint adapter(out + "/adapter_model.safetensors");
      for (const std::string& key : adapter.names()) {
        INFO(key);
        CHECK(starts_with(key, "base_model.model.model.language_model.layers."));
      }
      rapidjson::Document adapter_config;
      adapter_config.Parse(files::read_text(out + "/adapter_config.json").c_str());
      const rapidjson::Value& targets = adapter_config["target_modules"];
      REQUIRE(targets.IsArray());
      CHECK(targets.Size() == 2 * layers);  // q and v of every layer
      for (const auto& t : targets.GetArray()) {
        CHECK(starts_with(json::text(t), "model.language_model.layers."));
      }
      MergeOptions options;
      options.dtype = at::kFloat;
      merge_checkpoint(out, dir + "/merged_" + method, options);
      auto merged = check_whole_folder(dir + "/merged_" + method);
      if (method == "qlora") continue;  // merged into the dequantized projections, as PEFT does
      auto with_adapter = load(dir + "/base");
      load_adapter(*with_adapter, out, /*trainable=*/false);
      auto plain = load(dir + "/base");
      at::NoGradGuard no_grad;
      const at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
      const at::Tensor want = with_adapter->logits(ids);
      CHECK(max_abs(merged->logits(ids), want) < 1e-4);
      CHECK(max_abs(plain->logits(ids), want) > 1e-4);
    }
  }
}

TEST_CASE("a multimodal folder's processor template (chat_template.json) is its chat template",
          "[data][multimodal]") {
  // Gemma 3's processor carries the template in chat_template.json; the tokenizer's own
  // (chat_template.jinja, tokenizer_config.json's member) comes first where there is one.
  const std::string dir = test::temp_dir("processor_template");
  const std::string text = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}";
  rapidjson::Document doc(rapidjson::kObjectType);
  doc.AddMember("chat_template", rapidjson::Value(text.c_str(), doc.GetAllocator()),
                doc.GetAllocator());
  files::write_atomic(dir + "/chat_template.json", json::dump(doc));
  files::write_atomic(dir + "/tokenizer_config.json", R"({"eos_token": "<eos>"})");
  std::string source;
  const std::string name = data::detect_chat_template(dir, &source);
  CHECK(name == "jinja:" + dir + "/chat_template.json");
  const data::ChatTemplate& t = data::chat_template(name);
  CHECK(t.whole_text());
  // The tokenizer's template wins, as AutoTokenizer reads it.
  files::write_atomic(dir + "/tokenizer_config.json",
                      R"({"chat_template": "{{ messages[0]['content'] }}"})");
  CHECK(data::detect_chat_template(dir, &source) == "jinja:" + dir + "/tokenizer_config.json");
}

TEST_CASE("LLaMA-Factory's gemma3, mistral_small, phi4 ... templates are the folder's own format",
          "[data][multimodal]") {
  // LLaMA-Factory's YAML for Gemma 3 says template: gemma3; its turns are Gemma 3's own chat
  // template's, which the folder carries.
  const std::string dir = test::temp_dir("lf_template_names");
  files::write_atomic(
      dir + "/tokenizer_config.json",
      R"({"chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"})");
  auto tok = byte_tokenizer();
  for (const char* name : {"gemma3", "gemma2", "mistral_small", "phi4", "gpt_oss"}) {
    INFO(name);
    std::string source;
    CHECK(resolve_template(name, dir, *tok, &source) == "jinja:" + dir + "/tokenizer_config.json");
    CHECK_THAT(source, Catch::Contains(name) && Catch::Contains("LLaMA-Factory"));
  }
  // Without a template in the folder: named, with what to give instead.
  const std::string empty = test::temp_dir("lf_template_none");
  CHECK_THROWS_WITH(resolve_template("gemma3", empty, *tok),
                    Catch::Contains("gemma3") && Catch::Contains("jinja:FILE"));
  CHECK_THROWS_WITH(resolve_template("gemma3", "", *tok), Catch::Contains("no model folder"));
  // A name LLaMA-Factory has and zerotrain does not stays an error naming the choices.
  CHECK_THROWS_WITH(resolve_template("cohere", dir, *tok), Catch::Contains("unknown template"));
}
