// PEFT adapters against HF PEFT 0.21: adapters PEFT created load into zerotrain and give PEFT's
// logits and loss; trainable-parameter counts equal PEFT's; zerotrain's saved adapters have
// PEFT's layout and round-trip; merging; Freeze; and errors. Tolerances as in test_model.cpp
// (fp32: 2e-5 absolute on logits, 1e-5 relative on the loss).
#include "support/catch.hpp"
#include "support/messages.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "model/layers.hpp"
#include "peft/lora_targets.hpp"
#include "peft/prompt_encoders.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using Catch::Contains;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::shared_ptr<CausalLM> base_llama() {
  ModelConfig c = load_model_config(fixture("models/llama"));
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*m, *checkpoint_source(fixture("models/llama")));
  return m;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

// Logits compared where the token is real; virtual tokens (prepended by P-Tuning) count as real.
double max_abs_on_real_tokens(const at::Tensor& got, const at::Tensor& want,
                              const at::Tensor& mask) {
  const int64_t extra = got.size(1) - mask.size(1);
  at::Tensor real =
      at::cat({at::ones({mask.size(0), extra}, mask.options()), mask}, 1).to(at::kBool);
  return max_abs(got.index({real}), want.index({real}));
}

const char* kMethods[] = {"lora",   "lora_rslora_all_linear", "ptuning_mlp", "ptuning_lstm",
                          "prefix", "prefix_projection"};

}  // namespace

TEST_CASE("adapters PEFT created give PEFT's logits and loss in zerotrain", "[peft][parity]") {
  for (const char* name : kMethods) {
    INFO("adapter " << name);
    const std::string dir = fixture(std::string("peft/") + name);
    auto model = base_llama();
    load_adapter(*model, dir, /*trainable=*/false);
    SafetensorsFile expected(dir + "/expected.safetensors");
    at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    at::Tensor labels = expected.load("labels");
    at::Tensor want = expected.load("logits");
    at::NoGradGuard no_grad;
    at::Tensor got = model->logits(ids, mask);
    REQUIRE(got.sizes() == want.sizes());
    CHECK(max_abs_on_real_tokens(got, want, mask) < 2e-5);
    LossSum loss = model->loss(ids, labels, mask);
    CHECK(loss.sum.item<double>() / loss.tokens ==
          Approx(expected.load("loss").item<double>()).epsilon(1e-5));
  }
}

TEST_CASE("trainable-parameter counts equal PEFT's for the same config", "[peft]") {
  for (const char* name : kMethods) {
    INFO("adapter " << name);
    const std::string dir = fixture(std::string("peft/") + name);
    PeftConfig c = load_adapter_config(dir);
    auto model = base_llama();
    ParameterCount count = apply_peft(*model, c, 1);
    std::string counts = files::read_text(dir + "/counts.json");
    auto number = [&](const char* key) {
      size_t at = counts.find(key);
      return std::stoll(counts.substr(counts.find(':', at) + 1));
    };
    CHECK(count.trainable == number("\"trainable\""));
    CHECK(count.all == number("\"all\""));
  }
  auto model = base_llama();
  PeftConfig lora;
  lora.type = FinetuningType::kLora;
  lora.lora.r = 4;
  lora.lora.alpha = 8;
  lora.lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  CHECK(apply_peft(*model, lora, 1).line() ==
        "trainable params: 3,584 || all params: 106,304 || trainable%: 3.3715");
}

TEST_CASE("zerotrain's prompt encoders compute what PEFT's do", "[peft][parity]") {
  // PEFT's full trainable state (encoder weights) loaded into zerotrain's encoder reproduces the
  // prompt_embeddings PEFT saved.
  for (const char* name : {"ptuning_mlp", "ptuning_lstm", "prefix", "prefix_projection"}) {
    INFO(name);
    const std::string dir = fixture(std::string("peft/") + name);
    auto model = base_llama();
    apply_peft(*model, load_adapter_config(dir), 1);
    SafetensorsFile state(dir + "/trainable_state.safetensors");
    at::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().rfind("prompt_encoder.", 0) != 0) continue;
      std::string key =
          "prompt_encoder.default." + item.key().substr(std::string("prompt_encoder.").size());
      REQUIRE(state.contains(key));
      item.value().copy_(state.load(key));
    }
    at::Tensor table = std::string(name).rfind("prefix", 0) == 0
                           ? dynamic_cast<peft::PrefixEncoder*>(model->prompt_adapter())->encode()
                           : model->prompt_adapter()->virtual_embeddings();
    CHECK(max_abs(table,
                  SafetensorsFile(dir + "/adapter_model.safetensors").load("prompt_embeddings")) <
          1e-5);
  }
}

TEST_CASE("P-Tuning's virtual tokens are scaled where the family's model scales its embeddings",
          "[peft]") {
  // PEFT passes the virtual tokens and the token embeddings together as inputs_embeds.
  // transformers 5's Gemma 2 and Gemma 3 scale the tokens by √hidden inside their embedding
  // modules (Gemma2TextScaledWordEmbedding, Gemma3TextScaledWordEmbedding), so the virtual
  // tokens enter unscaled (4.x's Gemma 2 scaled inputs_embeds in the model); LLaMA scales
  // nothing.
  struct Case {
    std::string family;
    double virtual_scale, token_scale;
  };
  for (const Case& k : {Case{"gemma2", 1.0, std::sqrt(64.0)},
                        Case{"gemma3_text", 1.0, std::sqrt(64.0)}, Case{"llama", 1.0, 1.0}}) {
    INFO(k.family);
    ModelConfig mc = load_model_config(fixture("models/" + k.family));
    REQUIRE(mc.hidden_size == 64);
    auto model = std::make_shared<CausalLM>(mc, at::TensorOptions(), false);
    load_weights(*model, *checkpoint_source(fixture("models/" + k.family)));
    PeftConfig c = load_adapter_config(fixture("peft/ptuning_mlp"));
    apply_peft(*model, c, 3);
    at::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(3, 128, {2, 5}, at::kLong);
    const std::vector<at::Tensor> states = model->hidden_states(ids, at::Tensor());
    const int64_t n = c.prompt.num_virtual_tokens;
    const at::Tensor virt = model->prompt_adapter()->virtual_embeddings();
    CHECK(max_abs(states[0][0].narrow(0, 0, n), virt * k.virtual_scale) < 1e-5);
    CHECK(max_abs(states[0][1].narrow(0, n, 5),
                  model->named_parameters()["model.embed_tokens.weight"].index_select(0, ids[1]) *
                      k.token_scale) < 1e-5);
    // Generation starts from the same first step.
    const at::Tensor logits = model->logits(ids.narrow(0, 0, 1), at::Tensor());
    GenerationOptions g;
    g.max_new_tokens = 1;
    CHECK(model->generate(ids.narrow(0, 0, 1), g).item<int64_t>() ==
          logits[0][-1].argmax().item<int64_t>());
  }
}

TEST_CASE("saved adapters have PEFT's layout and load back to the same logits", "[peft]") {
  at::Tensor ids = at::randint(3, 128, {2, 9}, at::kLong);
  for (const char* name : {"lora", "ptuning_mlp", "prefix_projection"}) {
    INFO(name);
    PeftConfig c = load_adapter_config(fixture(std::string("peft/") + name));
    auto model = base_llama();
    apply_peft(*model, c, 5);
    {
      at::NoGradGuard no_grad;  // give LoRA's B (zero at init) an effect
      for (auto& item : model->named_parameters()) {
        if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
      }
    }
    std::string dir = test::temp_dir("adapter");
    save_adapter(*model, c, dir);
    // Same tensor names and shapes as the adapter PEFT wrote for this config.
    SafetensorsFile ours(dir + "/adapter_model.safetensors");
    SafetensorsFile peft(fixture(std::string("peft/") + name + "/adapter_model.safetensors"));
    CHECK(ours.names().size() == peft.names().size());
    for (const std::string& key : peft.names()) {
      INFO(key);
      REQUIRE(ours.contains(key));
      CHECK(ours.info(key).shape == peft.info(key).shape);
    }
    PeftConfig back = load_adapter_config(dir);
    CHECK(back.type == c.type);
    CHECK(back.lora.r == c.lora.r);
    CHECK(back.prompt.num_virtual_tokens == c.prompt.num_virtual_tokens);
    auto loaded = base_llama();
    load_adapter(*loaded, dir, false);
    at::NoGradGuard no_grad;
    CHECK(max_abs(model->logits(ids), loaded->logits(ids)) < 1e-5);
  }
}

namespace {

// A test's own adapter method: output += x · Dᵀ with a trained D [out, in] registered on the
// projection as "<module>.delta.weight". What a new method (DoRA) is: one LinearAdapter.
class DeltaAdapter final : public model::LinearAdapter {
 public:
  explicit DeltaAdapter(model::Linear& host) {
    d_ = host.register_module(
        "delta", std::make_shared<model::Linear>(host.in_features, host.out_features, false,
                                                 model::ParamFactory{host.weight.options(), true}));
    at::NoGradGuard no_grad;
    d_->weight.normal_(0.0, 0.1);
  }
  at::Tensor forward(const model::Linear& base, const at::Tensor& x, bool output_unread,
                     const at::Tensor& kept) const override {
    if (output_unread || kept.defined()) return base.base_forward(x, output_unread, kept);
    return base.base_forward(x) + at::linear(x, d_->weight);
  }
  bool reuses_kept(bool) const override { return false; }
  void merge_into(at::Tensor& weight) const override { weight.add_(d_->weight.to(at::kFloat)); }
  void unmerge_from(at::Tensor& weight) const override { weight.sub_(d_->weight.to(at::kFloat)); }
  at::Tensor d() const { return d_->weight; }

 private:
  std::shared_ptr<model::Linear> d_;
};

}  // namespace

TEST_CASE("an adapter method is a plug-in of Linear: forward, merge and unmerge go through it",
          "[peft]") {
  auto model = base_llama();
  auto plain = base_llama();  // the same base values
  const std::string q = "model.layers.0.self_attn.q_proj";
  std::shared_ptr<model::Linear> lin;
  for (const auto& m : model->named_modules()) {
    if (m.key() == q) lin = std::dynamic_pointer_cast<model::Linear>(m.value());
  }
  REQUIRE(lin);
  auto adapter = std::make_shared<DeltaAdapter>(*lin);
  lin->adapter = adapter;
  REQUIRE(model->named_parameters().contains(q + ".delta.weight"));
  const at::Tensor ids = at::randint(3, 128, {2, 9}, at::kLong);
  at::NoGradGuard no_grad;
  const at::Tensor with_adapter = model->logits(ids);
  CHECK(max_abs(with_adapter, plain->logits(ids)) > 1e-3);  // the adapter takes part
  // The same model with D folded into the base by hand.
  plain->named_parameters()[q + ".weight"].add_(adapter->d());
  CHECK(max_abs(with_adapter, plain->logits(ids)) < 1e-5);
  const at::Tensor base_q = lin->weight.clone();
  merge_lora(*model);
  CHECK(lin->adapter_merged);
  CHECK(max_abs(lin->weight, base_q + adapter->d()) < 1e-6);
  CHECK(max_abs(model->logits(ids), with_adapter) < 1e-5);
  unmerge_lora(*model);
  CHECK_FALSE(lin->adapter_merged);
  CHECK(max_abs(lin->weight, base_q) < 1e-6);
}

TEST_CASE("merged LoRA gives the adapter's outputs, and its export loads as a plain model",
          "[peft]") {
  const std::string dir = fixture("peft/lora_rslora_all_linear");
  auto model = base_llama();
  load_adapter(*model, dir, false);
  at::Tensor ids = at::randint(3, 128, {2, 11}, at::kLong);
  at::NoGradGuard no_grad;
  at::Tensor with_adapter = model->logits(ids);
  at::Tensor base_q = model->named_parameters()["model.layers.0.self_attn.q_proj.weight"].clone();
  merge_lora(*model);
  CHECK(max_abs(model->logits(ids), with_adapter) < 1e-5);
  CHECK_FALSE(
      at::equal(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"], base_q));
  unmerge_lora(*model);
  CHECK(max_abs(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"], base_q) <
        1e-6);
  std::string out = test::temp_dir("merged");
  export_merged(*model, out, at::kFloat);
  ModelConfig c = load_model_config(out);
  auto plain = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*plain, *checkpoint_source(out));
  CHECK(max_abs(plain->logits(ids), with_adapter) < 1e-5);
  for (const std::string& n : SafetensorsCheckpoint(out).names())
    CHECK(n.find("lora") == std::string::npos);
}

TEST_CASE("freeze trains the chosen layers and modules only", "[peft]") {
  auto trainable_names = [](CausalLM& m) {
    std::vector<std::string> out;
    for (const auto& p : m.named_parameters()) {
      if (p.value().requires_grad()) out.push_back(p.key());
    }
    return out;
  };
  auto all_start = [](const std::vector<std::string>& names, const std::string& prefix) {
    for (const std::string& n : names) {
      if (n.rfind(prefix, 0) != 0) return false;
    }
    return !names.empty();
  };
  PeftConfig c;
  c.type = FinetuningType::kFreeze;
  c.freeze.trainable_layers = 1;
  auto m = base_llama();
  apply_peft(*m, c, 0);
  CHECK(all_start(trainable_names(*m), "model.layers.1."));
  c.freeze.trainable_layers = -1;
  apply_peft(*m, c, 0);
  CHECK(all_start(trainable_names(*m), "model.layers.0."));
  c.freeze.trainable_modules = {"mlp"};
  apply_peft(*m, c, 0);
  CHECK(all_start(trainable_names(*m), "model.layers.0.mlp."));
  c.freeze.trainable_modules = {"all"};
  c.freeze.module_names = {"layers.1.self_attn"};
  c.freeze.extra_modules = {"lm_head"};
  apply_peft(*m, c, 0);
  for (const std::string& n : trainable_names(*m)) {
    CHECK((n.find("layers.1.self_attn") != std::string::npos || n.rfind("lm_head", 0) == 0));
  }
  c.freeze.module_names = {"no_such_module"};
  c.freeze.extra_modules.clear();
  CHECK_THROWS_AS(apply_peft(*m, c, 0), ConfigError);
  c.freeze.module_names.clear();
  c.freeze.trainable_modules = {"attention"};
  CHECK_THROWS_WITH(apply_peft(*m, c, 0),
                    Contains("freeze_trainable_modules") && Contains("self_attn"));
}

TEST_CASE("flat training options select the method, and misuse is an error", "[peft][config]") {
  TrainingArguments a;
  apply_training_flags(a, {"--finetuning_type", "lora", "--lora_r", "16", "--lora_target_modules",
                           "q_proj, v_proj", "--lora_modules_to_save", "lm_head"});
  PeftConfig c = peft_config_for(a);
  CHECK(c.type == FinetuningType::kLora);
  CHECK(c.lora.r == 16);
  CHECK(c.lora.target_modules == std::vector<std::string>({"q_proj", "v_proj"}));
  CHECK(c.lora.modules_to_save == std::vector<std::string>({"lm_head"}));
  TrainingArguments r;
  apply_training_flags(r,
                       {"--finetuning_type", "lora", "--lora_target_modules", ".*\\.(q|v)_proj"});
  CHECK(peft_config_for(r).lora.target_regex == ".*\\.(q|v)_proj");
  TrainingArguments v2;
  apply_training_flags(v2, {"--finetuning_type", "ptuning_v2", "--pre_seq_len", "8"});
  CHECK(peft_config_for(v2).type == FinetuningType::kPrefix);
  CHECK(peft_config_for(v2).prompt.num_virtual_tokens == 8);
  TrainingArguments bad;
  CHECK_THROWS_WITH(
      apply_training_flags(bad, {"--finetuning_type", "ptuning", "--pre_seq_len", "8"}),
      Contains("pre_seq_len") && Contains("prefix"));
  CHECK_THROWS_WITH(apply_training_flags(bad, {"--lora_bias", "some"}), Contains("lora_bias"));
  // A regex or names that match nothing.
  auto m = base_llama();
  PeftConfig none;
  none.type = FinetuningType::kLora;
  none.lora.target_modules = {"query_key_value"};
  CHECK_THROWS_WITH(apply_peft(*m, none, 0),
                    Contains("matches no projection") && Contains("q_proj"));
}

TEST_CASE("LoRA target patterns are matched in linear time: PEFT's forms work, others are refused",
          "[peft][errors][hostile]") {
  auto targets = [](const std::string& pattern) {
    auto m = base_llama();
    LoraOptions o;
    o.target_regex = pattern;
    return peft::lora_targets(*m, o);
  };
  // What PEFT users write (re.fullmatch against the module path).
  for (const char* pattern :
       {".*\\.(q|v)_proj", R"(model\.layers\.\d+\.self_attn\.(q|k|v)_proj)",
        ".*(?:gate|up|down)_proj", "^.*\\.o_proj$", R"(.*layers\.[01]\..*proj)"}) {
    INFO(pattern);
    CHECK_FALSE(targets(pattern).empty());
  }
  CHECK(targets(".*\\.q_proj").size() * 2 == targets(".*\\.(q|v)_proj").size());
  // Backtracking bombs finish at once (std::regex ran past 120 s) and match what they say.
  const std::string bomb = "(.*.*)*x_proj";
  CHECK(targets(bomb).empty());
  CHECK(targets("(.*.*)*q_proj").size() == targets(".*q_proj").size());
  // 30,000 nested groups (std::regex's recursion overflowed the stack): compiled and matched.
  const std::string nested = std::string(30000, '(') + ".*q_proj" + std::string(30000, ')');
  CHECK(targets(nested).size() == targets(".*q_proj").size());
  // Refused, naming the option and the pattern, never a crash: constructs RE2 lacks, programs
  // over the memory bound, syntax errors.
  struct Bad {
    std::string pattern;
    const char* says;
  };
  const std::vector<Bad> bad{{".*(?<!lm_)head", "lookaround"},
                             {R"((q)_proj\1)", "backreferences"},
                             {"((((a{100}){100}){100}){100})", "lora_target_modules"},
                             {"(unclosed", "missing )"}};
  for (const Bad& b : bad) {
    INFO(b.pattern.substr(0, 60));
    CHECK_THROWS_WITH(targets(b.pattern), Contains("lora_target_modules") && Contains(b.says));
  }
}

TEST_CASE("adapter options zerotrain lacks are errors naming them", "[peft][errors]") {
  auto write = [](const std::string& json) {
    std::string dir = test::temp_dir("badadapter");
    std::ofstream(dir + "/adapter_config.json") << json;
    return dir;
  };
  CHECK_THROWS_WITH(load_adapter_config(write(R"({"peft_type": "LORA", "fan_in_fan_out": true})")),
                    Contains("fan_in_fan_out"));
  // Starts that change the base as well (OLoRA, LoftQ, CorDA): the adapter means nothing without.
  for (const char* init : {"olora", "loftq", "corda", "pissa_niter_x", "pissa_niter_"}) {
    INFO(init);
    CHECK_THROWS_WITH(load_adapter_config(write(fmt::format(
                          R"({{"peft_type": "LORA", "init_lora_weights": "{}"}})", init))),
                      Contains("init_lora_weights") && Contains(init));
  }
  CHECK_THROWS_WITH(load_adapter_config(write(R"({"peft_type": "LORA", "init_lora_weights": 3})")),
                    Contains("init_lora_weights"));
  CHECK_THROWS_WITH(load_adapter_config(write(R"({"peft_type": "IA3"})")),
                    Contains("IA3") && Contains("LORA, P_TUNING, PREFIX_TUNING"));
  CHECK_THROWS_WITH(
      load_adapter_config(write(R"({"peft_type": "LORA", "layers_to_transform": [0]})")),
      Contains("layers_to_transform"));
  CHECK_THROWS_WITH(load_adapter_config(write(R"({"peft_type": "LORA", "task_type": "SEQ_CLS"})")),
                    Contains("task_type"));
  // An adapter of another base: shapes do not fit.
  std::string dir = test::temp_dir("otherbase");
  std::filesystem::copy(fixture("peft/lora/adapter_config.json"), dir + "/adapter_config.json");
  save_safetensors(
      dir + "/adapter_model.safetensors",
      {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", at::zeros({4, 99})}});
  auto m = base_llama();
  CHECK_THROWS_AS(load_adapter(*m, dir, false), IoError);
}

// The other direction of interoperability: adapters zerotrain wrote were loaded into HF PEFT
// 0.21 on the GPU machine (tests/tools/check_peft_loads.py) and PEFT's logits with them were
// kept as fixtures. Here zerotrain loads the same files and must give those logits, and must
// write the very same files again from what it loaded — so the fixture stays "what zerotrain
// writes", not a one-off.
namespace {

// What each adapter is: a PEFT fixture's configuration, or zerotrain's own flags (on the tiny
// llama, or the tiny qwen2 where biases matter).
struct WrittenAdapter {
  const char* name;
  const char* peft_fixture;        // nullptr: from `flags`
  std::vector<std::string> flags;  // training flags (finetuning_type, lora_*, ...)
  const char* base = "llama";
};

const std::vector<WrittenAdapter>& written_by_zerotrain() {
  static const std::vector<WrittenAdapter> all = {
      {"lora", "lora", {}},
      {"ptuning_mlp", "ptuning_mlp", {}},
      {"prefix_projection", "prefix_projection", {}},
      {"lora_all_linear", nullptr, {"--finetuning_type", "lora"}},  // the defaults
      {"lora_names",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "4", "--lora_target_modules",
        "q_proj,v_proj,down_proj"}},
      {"lora_regex",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules", ".*\\.(k|o)_proj"}},
      {"rslora",
       nullptr,
       {"--finetuning_type", "lora", "--use_rslora", "--lora_r", "16", "--lora_alpha", "8"}},
      {"lora_modules_to_save",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules", "q_proj", "--lora_modules_to_save",
        "lm_head"}},
      {"lora_bias_all", nullptr, {"--finetuning_type", "lora", "--lora_bias", "all"}, "qwen2"},
      {"lora_bias_lora_only",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules", "q_proj,o_proj", "--lora_bias",
        "lora_only"},
       "qwen2"},
      {"ptuning_lstm",
       nullptr,
       {"--finetuning_type", "ptuning", "--encoder_reparameterization_type", "LSTM",
        "--num_virtual_tokens", "4"}},
      {"prefix", nullptr, {"--finetuning_type", "prefix", "--num_virtual_tokens", "3"}},
      // DoRA (its magnitude under PEFT's key) and PiSSA (PEFT decomposes the base again when it
      // loads an adapter saved with init_lora_weights "pissa").
      {"dora", nullptr, {"--finetuning_type", "lora", "--lora_r", "4", "--use_dora", "true"}},
      {"dora_rslora_bias",
       nullptr,
       {"--finetuning_type", "lora", "--use_dora", "true", "--use_rslora", "true", "--lora_bias",
        "all"},
       "qwen2"},
      {"pissa",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "4", "--lora_target_modules",
        "q_proj,v_proj,up_proj", "--pissa_init", "true", "--pissa_iter", "-1"}},
      // The GLM family under PEFT's names for it: transformers' glm / glm4, and ChatGLM's own
      // remote-code modules (loaded in PEFT over THUDM's modeling_chatglm.py).
      {"glm4_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "glm4"},
      // Gemma 3 as published: PEFT wraps Gemma3ForConditionalGeneration, SigLIP tower and all;
      // zerotrain's targets are the decoder's module paths, so the tower stays untouched.
      {"gemma3_mm_lora_names",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules", "q_proj,v_proj"},
       "gemma3"},
      {"gemma3_mm_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "gemma3"},
      {"glm_lora_names",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules", "q_proj,gate_up_proj"},
       "glm"},
      {"chatglm_lora",
       nullptr,
       {"--finetuning_type", "lora", "--lora_target_modules",
        "query_key_value,dense,dense_h_to_4h,dense_4h_to_h"},
       "chatglm"},
      // The families of [1/7]: LoRA's defaults (all-linear, under each family's names: Phi-3's
      // fused qkv_proj and gate_up_proj), P-Tuning where the embeddings are scaled (Gemma 2:
      // the virtual tokens with them; Gemma 3: inside the embedding, without them), prefix tuning
      // over q/k norms and over sliding windows.
      {"qwen3_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "qwen3"},
      {"mistral_head_dim_lora_all_linear",
       nullptr,
       {"--finetuning_type", "lora"},
       "mistral_head_dim"},
      {"phi3_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "phi3"},
      {"gemma2_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "gemma2"},
      {"gemma3_lora_all_linear", nullptr, {"--finetuning_type", "lora"}, "gemma3_text"},
      {"gemma2_ptuning_mlp",
       nullptr,
       {"--finetuning_type", "ptuning", "--num_virtual_tokens", "4"},
       "gemma2"},
      {"gemma3_ptuning_mlp",
       nullptr,
       {"--finetuning_type", "ptuning", "--num_virtual_tokens", "4"},
       "gemma3_text"},
      {"qwen3_prefix",
       nullptr,
       {"--finetuning_type", "prefix", "--num_virtual_tokens", "3"},
       "qwen3"},
      {"gemma3_prefix",
       nullptr,
       {"--finetuning_type", "prefix", "--num_virtual_tokens", "3"},
       "gemma3_text"},
      // LoRA on the experts' fused tensors (PEFT's target_parameters), nested and alone.
      {"qwen3_moe_experts",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj",
        "--lora_target_parameters", "experts.gate_up_proj,experts.down_proj"},
       "qwen3_moe"},
      {"mixtral_experts_rslora",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "2", "--use_rslora", "true",
        "--lora_target_modules", "o_proj", "--lora_target_parameters", "experts.down_proj"},
       "mixtral"},
      // all-linear as PEFT 0.21 converts it on transformers 5: attention, routers (gate.weight),
      // the experts with gate_up_proj at rank 2r; GLM-4.5's shared expert and dense layer not.
      {"qwen3_moe_all_linear",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "2", "--lora_target_modules", "all-linear"},
       "qwen3_moe"},
      {"glm4_moe_all_linear",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "2", "--lora_target_modules", "all-linear"},
       "glm4_moe"},
      {"gpt_oss_experts",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "2", "--lora_target_modules", "q_proj",
        "--lora_target_parameters", "experts.gate_up_proj,experts.down_proj"},
       "gpt_oss"},
      {"mixtral_w123_gate",
       nullptr,
       {"--finetuning_type", "lora", "--lora_r", "2", "--lora_target_modules",
        "q_proj,w1,w2,w3,gate"},
       "mixtral"},
  };
  return all;
}

std::shared_ptr<CausalLM> base_model(const std::string& name) {
  ModelConfig c = load_model_config(fixture("models/" + name));
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*m, *checkpoint_source(fixture("models/" + name)));
  return m;
}

// The logits zerotrain computes with the adapter in `dir` over its base, for the PEFT check.
void write_zerotrain_logits(const std::string& dir, const std::string& base) {
  auto model = base_model(base);
  load_adapter(*model, dir, /*trainable=*/false);
  SafetensorsFile inputs(fixture("peft/lora/expected.safetensors"));
  at::Tensor ids = inputs.load("input_ids"), mask = inputs.load("attention_mask");
  at::NoGradGuard no_grad;
  save_safetensors(
      dir + "/zerotrain_logits.safetensors",
      {{"input_ids", ids}, {"attention_mask", mask}, {"logits", model->logits(ids, mask)}});
}

// An adapter with an effect worth checking (LoRA's B is zero at init): every trainable value
// nudged. Its base_model_name_or_path is the fixture's path relative to the repository root, as
// PEFT resolves it from the current directory.
void write_zerotrain_adapter(const WrittenAdapter& a, const std::string& dir) {
  PeftConfig c;
  if (a.peft_fixture != nullptr) {
    c = load_adapter_config(fixture(std::string("peft/") + a.peft_fixture));
  } else {
    TrainingArguments args;
    apply_training_flags(args, a.flags);
    c = peft_config_for(args);
  }
  c.base_model_name_or_path = std::string("tests/fixtures/models/") + a.base;
  auto model = base_model(a.base);
  apply_peft(*model, c, 5);
  {
    at::NoGradGuard no_grad;
    at::manual_seed(11);
    for (auto& item : model->named_parameters()) {
      if (item.value().requires_grad()) item.value().add_(at::randn_like(item.value()), 0.05);
    }
  }
  save_adapter(*model, c, dir);
  write_zerotrain_logits(dir, a.base);
}

}  // namespace

TEST_CASE("tool: write zerotrain adapters for the PEFT check", "[.tool]") {
  const char* out = std::getenv("ZT_OUT");
  REQUIRE(out != nullptr);
  for (const WrittenAdapter& a : written_by_zerotrain()) {
    const std::string dir = std::string(out) + "/" + a.name;
    std::filesystem::create_directories(dir);
    write_zerotrain_adapter(a, dir);
  }
  // What training writes with the defaults (LoRA on all-linear), at every ZeRO stage: the
  // final output folder and the checkpoint folder.
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string run = test::temp_dir("peft_run");
    std::string data;
    for (int i = 0; i < 8; ++i)
      data +=
          fmt::format("{{\"input_ids\": [{}, {}, {}, {}, {}]}}\n", 3 + i, 9, 20 + i, 7, 100 - i);
    files::write_atomic(run + "/train.jsonl", data);
    TrainingArguments args;
    apply_training_flags(
        args,
        {"--model_name_or_path", fixture("models/llama"), "--train_file", run + "/train.jsonl",
         "--output_dir", run + "/out", "--finetuning_type", "lora", "--max_steps", "2",
         "--save_steps", "2", "--learning_rate", "0.05", "--per_device_train_batch_size", "2",
         "--deepspeed", fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", stage)});
    Trainer(args, comm).train();
    for (const auto& [from, tag] :
         {std::pair{run + "/out", "output"}, std::pair{run + "/out/checkpoint-2", "checkpoint"}}) {
      const std::string dir = fmt::format("{}/trained_zero{}_{}", out, stage, tag);
      std::filesystem::create_directories(dir);
      for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) {
        std::filesystem::copy_file(from + "/" + f, dir + "/" + f);
      }
      // The base as PEFT would find it from the repository root.
      std::string config = files::read_text(dir + "/adapter_config.json");
      const std::string absolute = "\"" + fixture("models/llama") + "\"";
      config.replace(config.find(absolute), absolute.size(), "\"tests/fixtures/models/llama\"");
      files::write_atomic(dir + "/adapter_config.json", config);
      write_zerotrain_logits(dir, "llama");
    }
  }
}

// peft_from_zerotrain/: adapters zerotrain wrote, with the logits PEFT computed from them;
// peft_made/: adapters PEFT itself wrote (trainable biases), with PEFT's logits. Either way,
// zerotrain loading the files gives PEFT's logits, and saving them again writes the same tensors
// under the same keys.
TEST_CASE(
    "adapters zerotrain saved give zerotrain's logits in HF PEFT, and PEFT's files load and resave",
    "[peft][parity]") {
  std::map<std::string, size_t> checked;
  for (const char* root : {"peft_from_zerotrain", "peft_made"}) {
    for (const auto& entry : std::filesystem::directory_iterator(fixture(root))) {
      if (!entry.is_directory()) continue;
      const std::string dir = entry.path().string();
      INFO("adapter " << root << "/" << entry.path().filename().string());
      ++checked[root];
      const PeftConfig config = load_adapter_config(dir);
      // The fixture the adapter names (tests/fixtures/models/<base>; none: the tiny llama).
      const std::string& named = config.base_model_name_or_path;
      const std::string base =
          named.empty() ? "llama" : std::filesystem::path(named).filename().string();
      SafetensorsFile expected(dir + "/peft_logits.safetensors");
      at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
      at::Tensor want = expected.load("logits");
      auto model = base_model(base);
      load_adapter(*model, dir, /*trainable=*/false);
      at::NoGradGuard no_grad;
      at::Tensor got = model->logits(ids, mask);
      REQUIRE(got.sizes() == want.sizes());
      CHECK(max_abs_on_real_tokens(got, want, mask) < 2e-5);

      // Saving what was loaded writes the fixture's files again, tensor for tensor.
      std::string again = test::temp_dir("resave");
      save_adapter(*model, config, again);
      SafetensorsFile a(dir + "/adapter_model.safetensors"),
          b(again + "/adapter_model.safetensors");
      // The same keys (PEFT's files list them in another order, which readers ignore).
      const std::vector<std::string> names_a = a.names(), names_b = b.names();
      CHECK(std::set<std::string>(names_a.begin(), names_a.end()) ==
            std::set<std::string>(names_b.begin(), names_b.end()));
      for (const std::string& key : a.names()) {
        INFO(key);
        REQUIRE(b.contains(key));
        CHECK(at::equal(a.load(key), b.load(key)));
      }
      CHECK(load_adapter_config(again).type == config.type);
      // target_modules as PEFT keeps it: a list of names (all-linear written out) or a regex.
      rapidjson::Document doc;
      doc.Parse(files::read_text(dir + "/adapter_config.json").c_str());
      if (config.type == FinetuningType::kLora) {
        const rapidjson::Value& t = doc["target_modules"];
        CHECK((t.IsString() || t.IsArray()));
        if (t.IsArray()) {
          for (const auto& x : t.GetArray()) CHECK(std::string(x.GetString()) != "all-linear");
        }
      }
    }
  }
  CHECK(checked["peft_from_zerotrain"] >= 33);
  CHECK(checked["peft_made"] >= 2);
}

TEST_CASE(
    "trainable biases are saved under PEFT's keys: base_layer.bias where LoRA wraps the layer",
    "[peft]") {
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.target_modules = {"q_proj"};
  c.lora.bias = "all";
  auto model = base_model("qwen2");
  apply_peft(*model, c, 3);
  const std::string dir = test::temp_dir("bias_keys");
  save_adapter(*model, c, dir);
  SafetensorsFile st(dir + "/adapter_model.safetensors");
  const std::string layer = "base_model.model.model.layers.0.self_attn.";
  CHECK(st.contains(layer + "q_proj.base_layer.bias"));  // wrapped
  CHECK_FALSE(st.contains(layer + "q_proj.bias"));
  CHECK(st.contains(layer + "k_proj.bias"));  // not wrapped: its own name
  // Read back through both loaders: the same biases.
  auto again = base_model("qwen2");
  load_adapter(*again, dir, false);
  auto want = model->named_parameters(), got = again->named_parameters();
  CHECK(at::equal(got["model.layers.0.self_attn.q_proj.bias"],
                  want["model.layers.0.self_attn.q_proj.bias"]));
  auto source = adapter_source(dir);
  CHECK(source->has("model.layers.0.self_attn.q_proj.bias"));
  CHECK_FALSE(source->has("model.layers.0.self_attn.q_proj.base_layer.bias"));
}

namespace {

std::vector<std::string> saved_targets(const std::string& dir) {
  rapidjson::Document doc;
  doc.Parse(files::read_text(dir + "/adapter_config.json").c_str());
  std::vector<std::string> names;
  for (const auto& x : doc["target_modules"].GetArray()) names.emplace_back(x.GetString());
  return names;
}

}  // namespace

TEST_CASE("all-linear is saved as the module paths it picked, condensed from 20 as PEFT saves it",
          "[peft]") {
  TrainingArguments args;
  apply_training_flags(args, {"--finetuning_type", "lora"});
  PeftConfig c = peft_config_for(args);
  auto model = base_llama();
  apply_peft(*model, c, 1);
  const std::string dir = test::temp_dir("all_linear");
  save_adapter(*model, c, dir);
  // 14 projections (7 in each of 2 layers): fewer than PEFT's 20, so the full paths, sorted.
  std::vector<std::string> want;
  for (const auto& item : model->named_modules("", false)) {
    const std::string& m = item.key();
    if (m.find("_proj") != std::string::npos && m.find("lora") == std::string::npos)
      want.push_back(m);
  }
  std::sort(want.begin(), want.end());
  REQUIRE(want.size() == 14);
  CHECK(saved_targets(dir) == want);
  // 3 layers: 21 paths, which PEFT condenses to the shortest suffixes that pick only them.
  ModelConfig deeper = model->config();
  deeper.num_hidden_layers = 3;
  CausalLM three(deeper, at::TensorOptions());
  apply_peft(three, c, 1);
  const std::string dir3 = test::temp_dir("all_linear_3");
  save_adapter(three, c, dir3);
  CHECK(saved_targets(dir3) == std::vector<std::string>{"down_proj", "gate_proj", "k_proj",
                                                        "o_proj", "q_proj", "up_proj", "v_proj"});
  // Read back, the names pick the same projections (and not the output layer).
  auto again = base_llama();
  load_adapter(*again, dir, false);
  int64_t adapted = 0;
  for (const auto& item : again->named_parameters())
    adapted += item.key().find("lora_A") != std::string::npos;
  CHECK(adapted == 7 * 2);  // 7 projections in each of the 2 layers
  for (const auto& item : again->named_parameters())
    CHECK(item.key().find("lm_head.lora") == std::string::npos);
  // PEFT's own string forms read as PEFT reads them: "all-linear" and a regex.
  const std::string saved = files::read_text(dir + "/adapter_config.json");
  for (const char* target : {"\"all-linear\"", "\".*\\\\.(q|v)_proj\""}) {
    INFO(target);
    std::string config = saved;
    const size_t at = config.find("\"target_modules\"");
    const size_t end = config.find(']', at);
    config.replace(at, end + 1 - at, std::string("\"target_modules\": ") + target);
    files::write_atomic(dir + "/adapter_config.json", config);
    PeftConfig back = load_adapter_config(dir);
    auto m = base_llama();
    apply_peft(*m, back, 1);
    int64_t n = 0;
    for (const auto& item : m->named_parameters())
      n += item.key().find("lora_A") != std::string::npos;
    CHECK(n == (std::string(target) == "\"all-linear\"" ? 14 : 4));
  }
}

TEST_CASE("a LoRA name that matches nothing is named, with the model's projection names once",
          "[peft][errors]") {
  auto m = base_llama();
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.target_modules = {"q_proj", "v_prj"};
  try {
    apply_peft(*m, c, 0);
    FAIL("no error");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    CHECK_THAT(
        what,
        Contains("\"v_prj\"") &&
            Contains("down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"));
    CHECK(what.find("q_proj, q_proj") == std::string::npos);
  }
}

TEST_CASE("training continues from a LoRA adapter folder with its values", "[peft]") {
  const std::string dir = fixture("peft/lora_rslora_all_linear");
  TrainingArguments args;
  apply_training_flags(args, {"--finetuning_type", "lora", "--adapter_name_or_path", dir});
  auto model = base_llama();
  ParameterCount count = apply_peft_from_args(*model, args, 0);
  std::string counts = files::read_text(dir + "/counts.json");
  CHECK(count.trainable ==
        std::stoll(counts.substr(counts.find(':', counts.find("\"trainable\"")) + 1)));
  SafetensorsFile expected(dir + "/expected.safetensors");
  at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
  LossSum loss = model->loss(ids, expected.load("labels"), mask);
  CHECK(loss.sum.item<double>() / loss.tokens ==
        Approx(expected.load("loss").item<double>()).epsilon(1e-5));
  loss.sum.backward();
  int64_t with_grad = 0;
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    const bool lora = item.key().find("lora_") != std::string::npos;
    CHECK(item.value().requires_grad() == lora);
    CHECK(item.value().grad().defined() == lora);
    if (lora) with_grad += item.value().numel();
  }
  CHECK(with_grad == count.trainable);
}

TEST_CASE("continuing from an adapter that does not fit the options is an error",
          "[peft][errors]") {
  const std::string lora = fixture("peft/lora_rslora_all_linear");
  auto model = base_llama();
  auto attempt = [&](std::vector<std::string> flags) {
    TrainingArguments args;
    apply_training_flags(args, flags);
    apply_peft_from_args(*model, args, 0);
  };
  CHECK_THROWS_WITH(attempt({"--finetuning_type", "freeze", "--adapter_name_or_path", lora}),
                    Contains("finetuning_type lora") && Contains(lora));
  CHECK_THROWS_WITH(
      attempt({"--finetuning_type", "lora", "--adapter_name_or_path", fixture("peft/prefix")}),
      Contains("prompt adapter") && Contains("checkpoint"));
  PeftConfig saved = load_adapter_config(lora);
  CHECK_THROWS_WITH(attempt({"--finetuning_type", "lora", "--adapter_name_or_path", lora,
                             "--lora_r", std::to_string(saved.lora.r * 2)}),
                    Contains("lora_r") && Contains(lora));
  CHECK_THROWS_WITH(attempt({"--finetuning_type", "lora", "--adapter_name_or_path", lora,
                             "--lora_target_modules", "q_proj"}),
                    Contains("lora_target_modules") && Contains("projections"));
  CHECK_THROWS_WITH(attempt({"--finetuning_type", "lora", "--adapter_name_or_path",
                             test::temp_dir("no_adapter")}),
                    Contains("adapter_config.json"));
  // The same targets written another way agree (PEFT saves all-linear as module paths).
  TrainingArguments same;
  apply_training_flags(same, {"--finetuning_type", "lora", "--adapter_name_or_path", lora,
                              "--lora_target_modules", "all-linear"});
  CHECK_NOTHROW(apply_peft_from_args(*model, same, 0));
}

TEST_CASE("Freeze's trainable_modules are the names the family gives a decoder layer",
          "[peft][families]") {
  struct Case {
    const char* family;
    std::vector<std::string> has, lacks;
  };
  for (const Case& k : {Case{"llama",
                             {"self_attn", "q_proj", "gate_proj", "mlp", "input_layernorm"},
                             {"gate_up_proj", "self_attention", "post_mlp_layernorm"}},
                        Case{"glm4",
                             {"gate_up_proj", "post_self_attn_layernorm", "post_mlp_layernorm"},
                             {"gate_proj", "query_key_value"}},
                        Case{"chatglm",
                             {"self_attention", "query_key_value", "dense", "dense_h_to_4h"},
                             {"self_attn", "q_proj", "gate_up_proj"}}}) {
    INFO("family " << k.family);
    auto m = base_model(k.family);
    PeftConfig c;
    c.type = FinetuningType::kFreeze;
    c.freeze.trainable_layers = 1;
    for (const std::string& name : k.has) {
      INFO("module " << name);
      c.freeze.trainable_modules = {name};
      REQUIRE_NOTHROW(apply_peft(*m, c, 0));
      // Only the last layer's parameters under that name train, and some do.
      int64_t trained = 0;
      const std::string last = m->config().layer_prefix(m->config().num_hidden_layers - 1);
      for (const auto& p : m->named_parameters(true)) {
        if (!p.value().requires_grad()) continue;
        ++trained;
        CHECK(p.key().rfind(last, 0) == 0);
        CHECK(("." + p.key() + ".").find("." + name + ".") != std::string::npos);
      }
      CHECK(trained > 0);
    }
    for (const std::string& name : k.lacks) {
      INFO("module " << name);
      c.freeze.trainable_modules = {name};
      CHECK_THROWS_MATCHES(apply_peft(*m, c, 0), ConfigError,
                           test::Has({"freeze_trainable_modules", "\"" + name + "\"",
                                      std::string("(") + k.family + ")", k.has.front()}));
    }
  }
}
