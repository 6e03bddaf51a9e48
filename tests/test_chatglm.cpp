// ChatGLM2/3-6B in its own layout: the config's mapping to glm's arithmetic, ChatGLM's module
// names, the same outputs as the weights give as transformers' glm (and merge --as glm), the
// SentencePiece tokenizer against THUDM's SPTokenizer and ChatGLM-Finetuning's data_set.py
// (references written by tests/tools/make_chatglm_references.py with their own code), the
// P-Tuning v2 prefix encoder ChatGLM's way, and train.py's command-line flags.
#include "support/catch.hpp"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "model/family.hpp"
#include "peft/prompt_encoders.hpp"
#include "support/ranks.hpp"
#include "tokenizer/chatglm_tokenizer.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
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

// ChatGLM3-6B's config.json members that decide the model.
std::string chatglm3_6b(const std::string& extra = "") {
  return R"({"model_type": "chatglm", "padded_vocab_size": 65024, "hidden_size": 4096,
             "ffn_hidden_size": 13696, "num_layers": 28, "num_attention_heads": 32,
             "kv_channels": 128, "multi_query_attention": true, "multi_query_group_num": 2,
             "add_qkv_bias": true, "layernorm_epsilon": 1e-05, "seq_length": 8192,
             "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float16")" +
         extra + "}";
}

// A tiny ChatGLM config (the fixture's shape) with random weights.
ModelConfig tiny_config() {
  return parse_model_config(R"({"model_type": "chatglm", "padded_vocab_size": 416,
      "hidden_size": 64, "ffn_hidden_size": 80, "num_layers": 2, "num_attention_heads": 4,
      "kv_channels": 16, "multi_query_attention": true, "multi_query_group_num": 2,
      "add_qkv_bias": true, "layernorm_epsilon": 1e-5, "seq_length": 128, "rope_ratio": 2.0})");
}

std::shared_ptr<CausalLM> random_model(const ModelConfig& c, uint64_t seed) {
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat));
  m->initialize_random(seed);
  at::NoGradGuard no_grad;
  for (auto& p : m->named_parameters()) {  // non-trivial norms and biases
    if (p.key().find("norm") != std::string::npos || p.key().find(".bias") != std::string::npos)
      p.value().add_(at::randn_like(p.value()) * 0.1);
  }
  return m;
}

// The glm model whose weights are the ChatGLM model's, mapped as transformers' converter does.
std::shared_ptr<CausalLM> as_glm(CausalLM& chatglm) {
  auto g = std::make_shared<CausalLM>(chatglm_as_glm(chatglm.config()),
                                      at::TensorOptions().dtype(at::kFloat));
  std::map<std::string, at::Tensor> glm_params;
  for (auto& p : g->named_parameters()) glm_params[p.key()] = p.value();
  at::NoGradGuard no_grad;
  size_t filled = 0;
  for (auto& p : chatglm.named_parameters()) {
    for (const GlmTensorFrom& f : glm_names_of_chatglm(chatglm.config(), p.key())) {
      at::Tensor src = f.rows < 0 ? p.value() : p.value().narrow(0, f.first_row, f.rows);
      REQUIRE(glm_params.count(f.glm_name) == 1);
      glm_params.at(f.glm_name).copy_(src);
      ++filled;
    }
  }
  CHECK(filled == glm_params.size());
  return g;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

std::vector<rapidjson::Document> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<rapidjson::Document> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    out.emplace_back();
    out.back().Parse(line.c_str(), line.size());
    REQUIRE(!out.back().HasParseError());
  }
  return out;
}

std::vector<int32_t> ints(const rapidjson::Value& v) {
  std::vector<int32_t> out;
  for (const auto& x : v.GetArray()) out.push_back(x.GetInt());
  return out;
}

std::shared_ptr<ChatGlmTokenizer> fixture_tokenizer() {
  auto tok =
      std::dynamic_pointer_cast<ChatGlmTokenizer>(load_tokenizer(fixture("models/chatglm"), 416));
  REQUIRE(tok);
  return tok;
}

}  // namespace

TEST_CASE("ChatGLM2/3 configs state glm's arithmetic in Megatron's names", "[chatglm][config]") {
  // The switches ChatGLM2/3's configs write, at the values they write.
  ModelConfig c = parse_model_config(chatglm3_6b(
      R"(, "add_bias_linear": false, "rmsnorm": true, "post_layer_norm": true,
         "apply_residual_connection_post_layernorm": false, "original_rope": true,
         "quantization_bit": 0, "fp32_residual_connection": false)"));
  CHECK(model::family_of(c).names.fused_qkv == "query_key_value");  // Megatron's module tree
  CHECK(c.vocab_size == 65024);
  CHECK(c.num_hidden_layers == 28);
  CHECK(c.intermediate_size == 13696);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 128);
  CHECK(c.rotary_dim() == 64);  // RoPE on half of each head, in adjacent pairs
  CHECK(c.rope_interleaved);
  CHECK(c.fused_gate_up);
  CHECK(c.qkv_bias);
  CHECK_FALSE(c.o_proj_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.rms_norm_eps == Approx(1e-5));
  CHECK(c.dtype == at::kHalf);
  // ChatGLM2/3-6B's published parameter count, and the model the config builds.
  CHECK(c.parameter_count() == 6243584000);
  CausalLM shape(c, at::TensorOptions(), /*allocate=*/false);
  int64_t n = 0;
  for (const auto& p : shape.parameters()) n += p.numel();
  CHECK(n == c.parameter_count());
  CHECK(parse_model_config(chatglm3_6b(R"(, "rope_ratio": 50)")).rope_theta == 500000.0);
  std::string groups = chatglm3_6b();
  groups.replace(groups.find("\"multi_query_group_num\": 2"), 26, "\"multi_query_group_num\": 3");
  CHECK_THROWS_WITH(parse_model_config(groups),
                    Contains("multi_query_group_num") && !Contains("twice"));
  std::string mha = chatglm3_6b();
  mha.replace(mha.find("\"multi_query_attention\": true"), 29, "\"multi_query_attention\": false");
  CHECK(parse_model_config(mha).num_key_value_heads == 32);
  // What the remote code could compute but these models never do is refused, naming the key.
  for (const char* bad :
       {R"(, "rmsnorm": false)", R"(, "quantization_bit": 4)",
        R"(, "apply_residual_connection_post_layernorm": true)", R"(, "add_bias_linear": true)",
        R"(, "post_layer_norm": false)", R"(, "original_rope": false)"}) {
    INFO(bad);
    std::string key = std::string(bad).substr(3);
    key = key.substr(0, key.find('"'));
    CHECK_THROWS_WITH(parse_model_config(chatglm3_6b(bad)), Contains(key));
  }
}

TEST_CASE("a ChatGLM model has ChatGLM's module names", "[chatglm][model]") {
  CausalLM m(tiny_config(), at::TensorOptions(), /*allocate=*/false);
  std::set<std::string> names;
  for (const auto& p : m.named_parameters()) names.insert(p.key());
  for (const char* want :
       {"transformer.embedding.word_embeddings.weight",
        "transformer.encoder.layers.0.input_layernorm.weight",
        "transformer.encoder.layers.0.self_attention.query_key_value.weight",
        "transformer.encoder.layers.0.self_attention.query_key_value.bias",
        "transformer.encoder.layers.0.self_attention.dense.weight",
        "transformer.encoder.layers.1.post_attention_layernorm.weight",
        "transformer.encoder.layers.1.mlp.dense_h_to_4h.weight",
        "transformer.encoder.layers.1.mlp.dense_4h_to_h.weight",
        "transformer.encoder.final_layernorm.weight", "transformer.output_layer.weight"}) {
    CHECK(names.count(want) == 1);
  }
  CHECK(names.size() == 3 + 2 * 7);
  CHECK(m.config().layer_prefix(1) == "transformer.encoder.layers.1.");
}

TEST_CASE("ChatGLM's layout computes what the same weights compute as transformers' glm",
          "[chatglm][model]") {
  auto chatglm = random_model(tiny_config(), 3);
  auto glm = as_glm(*chatglm);
  at::Tensor ids = at::randint(0, 416, {2, 11}, at::kLong);
  at::Tensor mask = at::ones({2, 11}, at::kLong);
  mask[1].narrow(0, 8, 3).zero_();
  at::Tensor real = mask.to(at::kBool);
  CHECK(max_abs(chatglm->logits(ids, mask).index({real}), glm->logits(ids, mask).index({real})) <
        1e-6);
  at::Tensor labels = ids.clone();
  labels.masked_fill_(mask.eq(0), -100);
  CHECK(chatglm->loss(ids, labels, mask).sum.item<double>() ==
        Approx(glm->loss(ids, labels, mask).sum.item<double>()).epsilon(1e-6));
}

TEST_CASE("merge --as glm writes a ChatGLM folder in transformers' glm layout",
          "[chatglm][checkpoint]") {
  auto chatglm = random_model(tiny_config(), 5);
  const std::string dir = test::temp_dir("chatglm_model"), out = test::temp_dir("as_glm") + "/o";
  export_merged(*chatglm, dir, at::kFloat);
  { std::ofstream(dir + "/modeling_chatglm.py") << "# the remote code travels with the folder\n"; }
  MergeOptions o;
  o.as_glm = true;
  merge_checkpoint(dir, out, o);
  ModelConfig g = load_model_config(out);
  CHECK(g.model_type == "glm");
  CHECK(model::family_of(g).names.fused_qkv.empty());
  CHECK(g.num_key_value_heads == 2);
  CHECK(g.partial_rotary_factor == 0.5);
  CHECK(g.rope_theta == 20000.0);
  CausalLM from_file(g, at::TensorOptions().dtype(at::kFloat), false);
  load_weights(from_file, *checkpoint_source(out));
  at::Tensor ids = at::randint(0, 416, {1, 9}, at::kLong);
  CHECK(max_abs(from_file.logits(ids), chatglm->logits(ids)) < 1e-6);
  // Its own layout keeps ChatGLM's names and the remote code.
  const std::string own = test::temp_dir("own") + "/o";
  merge_checkpoint(dir, own);
  CHECK(load_model_config(own).model_type == "chatglm");
  CHECK(std::filesystem::exists(own + "/modeling_chatglm.py"));
  SafetensorsCheckpoint ckpt(own);
  CHECK(ckpt.contains("transformer.encoder.layers.0.self_attention.query_key_value.weight"));
  // --as glm is for ChatGLM folders only.
  const std::string llama_out = test::temp_dir("llama_glm") + "/o";
  CHECK_THROWS_WITH(merge_checkpoint(fixture("models/llama"), llama_out, o),
                    Contains("--as glm") && Contains("llama"));
}

TEST_CASE("ChatGLM's tokenizer encodes as THUDM's SPTokenizer", "[chatglm][tokenizer]") {
  auto tok = fixture_tokenizer();
  CHECK(tok->generation() == ChatGlmTokenizer::kChatGlm3);
  CHECK(tok->vocab_size() == 409);  // 400 pieces and 9 special tokens
  CHECK(tok->eos_id() == 2);
  CHECK(tok->pad_id() == 0);
  CHECK_FALSE(tok->add_bos());
  CHECK(tok->command("[gMASK]") == 401);
  CHECK(tok->command("sop") == 403);
  CHECK(tok->command("<|user|>") == 406);
  CHECK(tok->command("<|observation|>") == 408);
  CHECK(tok->command("<eos>") == 2);
  CHECK_FALSE(tok->command("<|tool|>"));
  int cases = 0;
  for (const auto& c : read_jsonl(fixture("chatglm/tokenizer_cases.jsonl"))) {
    const std::string text = c["text"].GetString();
    INFO(text);
    CHECK(tok->encode_plain(text) == ints(c["ids"]));
    // encode() reads the role tokens as ChatGLM3's tokenize(encode_special_tokens=True) does;
    // mask tokens (and sop / eop after them) are zerotrain's addition, checked below.
    if (text.find("[gMASK]") == std::string::npos) {
      CHECK(tok->encode(text) == ints(c["role_split_ids"]));
    }
    CHECK(tok->decode(ints(c["ids"])) == c["decoded"].GetString());
    ++cases;
  }
  CHECK(cases >= 15);
  auto plain = [&](const char* s) { return tok->encode_plain(s); };
  auto cat = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  CHECK(tok->encode("[gMASK]sop<|user|>\n hi") == cat({401, 403, 406}, plain("\n hi")));
  CHECK(tok->encode("[gMASK]sopx") == cat({401, 403}, plain("x")));
  CHECK(tok->encode("sophisticated") == plain("sophisticated"));  // sop only after a mask
  CHECK(tok->encode("a sop") == plain("a sop"));
  // decode skips special ids, as every zerotrain tokenizer does.
  CHECK(tok->decode(cat({401, 403, 406}, plain("hi"))) == "hi");
}

TEST_CASE("a broken ChatGLM tokenizer.model is refused naming the file", "[chatglm][hostile]") {
  const std::string dir = test::temp_dir("bad_tok");
  files::write_atomic(dir + "/tokenizer_config.json", R"({"tokenizer_class": "ChatGLMTokenizer"})");
  files::write_atomic(dir + "/tokenizer.model", std::string(300, '\x07'));
  CHECK_THROWS_AS(load_tokenizer(dir, 65024), ConfigError);
  CHECK_THROWS_WITH(load_tokenizer(dir, 65024), Contains(dir + "/tokenizer.model"));
  std::filesystem::remove(dir + "/tokenizer.model");
  REQUIRE(mkfifo((dir + "/tokenizer.model").c_str(), 0600) == 0);
  CHECK_THROWS_WITH(load_tokenizer(dir, 65024), Contains("tokenizer.model"));
  // A real model but a model too small for its ids.
  std::filesystem::remove(dir + "/tokenizer.model");
  std::filesystem::copy_file(fixture("models/chatglm/tokenizer.model"), dir + "/tokenizer.model");
  CHECK_THROWS_WITH(load_tokenizer(dir, 300), Contains("409") && Contains("300"));
}

TEST_CASE("ChatGLM-Finetuning's data layouts are data_set.py's, token for token",
          "[chatglm][data]") {
  auto tok = fixture_tokenizer();
  const std::string dir = fixture("chatglm");
  int compared = 0;
  for (const char* mode : {"glm2", "glm3"}) {
    for (auto [max_len, max_src] : {std::pair{1024, 256}, {48, 16}, {40, 24}}) {
      for (bool skip : {false, true}) {
        const std::string ref = fmt::format("{}/seed_{}_{}_{}{}.jsonl", dir, mode, max_len, max_src,
                                            skip ? "_skip" : "");
        INFO(ref);
        DataOptions o;
        o.glm_prompt_layout = mode;
        o.max_length = max_len;
        o.max_source_length = max_src;
        o.skip_truncated = skip;
        std::vector<rapidjson::Document> want = read_jsonl(ref);
        if (want.empty()) {  // data_set.py kept nothing: zerotrain says so
          CHECK_THROWS_WITH(tokenize_jsonl(dir + "/seed_records.jsonl", *tok, o),
                            Contains("no usable example"));
          continue;
        }
        Dataset d = tokenize_jsonl(dir + "/seed_records.jsonl", *tok, o);
        REQUIRE(d.size() == static_cast<int64_t>(want.size()));
        for (int64_t i = 0; i < d.size(); ++i) {
          CHECK(d.ids(i).to_vector() == ints(want[i]["input_ids"]));
          CHECK(d.labels(i).to_vector() == ints(want[i]["labels"]));
          ++compared;
        }
      }
    }
  }
  CHECK(compared >= 30);
  DataOptions o;
  o.glm_prompt_layout = "glm2";
  o.max_length = 100;
  o.max_source_length = 99;
  CHECK_THROWS_WITH(tokenize_jsonl(dir + "/seed_records.jsonl", *tok, o),
                    Contains("max_src_len 99") && Contains("max_len 100"));
  o.max_source_length = 20;
  CHECK_THROWS_WITH(tokenize_jsonl(dir + "/seed_records.jsonl", *byte_tokenizer(), o),
                    Contains("ChatGLM2/3's tokenizer"));
}

TEST_CASE("the records is_skip drops are counted as skipped, not as left untrained by truncation",
          "[chatglm][data][counts]") {
  auto tok = fixture_tokenizer();
  DataOptions o;
  o.glm_prompt_layout = "glm2";
  o.max_length = 40;
  o.max_source_length = 24;
  o.skip_truncated = true;
  // data_set.py's is_skip keeps 1 of the 4 records here (seed_glm2_40_24_skip.jsonl).
  DatasetStats stats;
  const Dataset d = tokenize_jsonl(fixture("chatglm") + "/seed_records.jsonl", *tok, o, &stats);
  REQUIRE(d.size() == 1);
  CHECK(stats.skipped_truncated == 3);
  CHECK(stats.dropped_examples == 3);
  CHECK(stats.truncated_examples == 0);
  CHECK(stats.untrained_examples == 0);
}

TEST_CASE("P-Tuning v2 on ChatGLM trains ChatGLM's prefix encoder and saves it both ways",
          "[chatglm][peft]") {
  auto model = random_model(tiny_config(), 9);
  PeftConfig pc;
  pc.type = FinetuningType::kPrefix;
  pc.prompt.num_virtual_tokens = 4;
  pc.prompt.prefix_projection = true;
  ParameterCount count = apply_peft(*model, pc, 1);
  const int64_t kv_size = 2 * 2 * 2 * 16;  // layers · (key, value) · groups · kv_channels
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model->named_parameters()) {
    if (p.value().requires_grad()) shapes[p.key()] = p.value().sizes().vec();
  }
  CHECK(shapes == std::map<std::string, std::vector<int64_t>>{
                      {"prompt_encoder.embedding.weight", {4, kv_size}},
                      {"prompt_encoder.trans.0.weight", {64, kv_size}},
                      {"prompt_encoder.trans.0.bias", {64}},
                      {"prompt_encoder.trans.2.weight", {kv_size, 64}},
                      {"prompt_encoder.trans.2.bias", {kv_size}}});
  CHECK(count.trainable == 4 * kv_size + 64 * kv_size + 64 + kv_size * 64 + kv_size);
  const std::string dir = test::temp_dir("chatglm_prefix");
  save_adapter(*model, pc, dir);
  SafetensorsFile chatglm_file(dir + "/prefix_encoder.safetensors");
  const std::vector<std::string> listed = chatglm_file.names();
  const std::set<std::string> names(listed.begin(), listed.end());
  CHECK(names == std::set<std::string>{"transformer.prefix_encoder.embedding.weight",
                                       "transformer.prefix_encoder.trans.0.weight",
                                       "transformer.prefix_encoder.trans.0.bias",
                                       "transformer.prefix_encoder.trans.2.weight",
                                       "transformer.prefix_encoder.trans.2.bias"});
  SafetensorsFile peft_file(dir + "/adapter_model.safetensors");
  CHECK(peft_file.load("prompt_embeddings").sizes().vec() == std::vector<int64_t>{4, kv_size});
  // The prefix reaches the loss, and in training through ChatGLM's dropout.
  at::Tensor ids = at::randint(0, 416, {1, 8}, at::kLong);
  model->eval();
  const double a = model->loss(ids, ids).sum.item<double>();
  CHECK(model->loss(ids, ids).sum.item<double>() == a);
  model->train();
  CHECK(model->loss(ids, ids).sum.item<double>() != a);
}

TEST_CASE("P-Tuning v2 gives the loss THUDM's modeling code gives with the same prefix encoder",
          "[chatglm][peft][parity]") {
  ModelConfig c = load_model_config(fixture("models/chatglm"));
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), false);
  load_weights(*model, *checkpoint_source(fixture("models/chatglm")));
  SafetensorsFile expected(fixture("models/chatglm/expected.safetensors"));
  PeftConfig pc;
  pc.type = FinetuningType::kPrefix;
  pc.prompt.num_virtual_tokens = 4;
  pc.prompt.prefix_projection = true;
  apply_peft(*model, pc, 1);
  int loaded = 0;
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      const std::string prefix = "prompt_encoder.";
      if (p.key().rfind(prefix, 0) != 0) continue;
      p.value().copy_(expected.load("prefix." + p.key().substr(prefix.size())));
      ++loaded;
    }
  }
  CHECK(loaded == 5);
  model->eval();  // the reference ran without the prefix dropout
  at::Tensor ids = expected.load("input_ids"), labels = expected.load("labels");
  LossSum loss = model->loss(ids, labels);
  CHECK(loss.sum.item<double>() / loss.tokens ==
        Approx(expected.load("prefix_loss").item<double>()).epsilon(1e-5));
}

TEST_CASE("ChatGLM-Finetuning's train.py flags set their HF options and defaults",
          "[chatglm][config]") {
  // The README's P-Tuning line, paths aside.
  TrainingArguments a;
  apply_training_flags(a, {"--train_path",
                           "data/spo_0.json",
                           "--model_name_or_path",
                           "ChatGLM3-6B",
                           "--per_device_train_batch_size",
                           "1",
                           "--max_len",
                           "768",
                           "--max_src_len",
                           "512",
                           "--learning_rate",
                           "1e-4",
                           "--weight_decay",
                           "0.1",
                           "--num_train_epochs",
                           "2",
                           "--gradient_accumulation_steps",
                           "4",
                           "--warmup_ratio",
                           "0.1",
                           "--mode",
                           "glm3",
                           "--train_type",
                           "ptuning",
                           "--seed",
                           "1234",
                           "--ds_file",
                           "ds_zero2_no_offload.json",
                           "--gradient_checkpointing",
                           "--show_loss_step",
                           "10",
                           "--pre_seq_len",
                           "16",
                           "--prefix_projection",
                           "True",
                           "--output_dir",
                           "./output-glm"});
  CHECK(a.train_file == "data/spo_0.json");
  CHECK(a.max_length == 768);
  CHECK(a.max_source_length == 512);
  CHECK(a.glm_prompt_layout == "glm3");
  CHECK(a.finetuning_type == "prefix");
  CHECK(a.deepspeed == "ds_zero2_no_offload.json");
  CHECK(a.gradient_checkpointing);
  CHECK(a.logging_steps == 10);
  CHECK(a.pre_seq_len == 16);
  CHECK(a.prefix_projection);
  CHECK(a.learning_rate == 1e-4);
  CHECK(a.adam_beta2 == 0.95);  // what train.py writes into the DeepSpeed config
  CHECK(a.warmup_min_lr_ratio == 0.1);
  DataOptions d = data_options_for(a);
  CHECK(d.glm_prompt_layout == "glm3");
  CHECK(d.max_source_length == 512);
  // train.py's defaults for what is not given.
  TrainingArguments b;
  apply_training_flags(b, {"--train_path", "x.jsonl", "--ds_file", "ds.json"});
  CHECK(b.finetuning_type == "lora");
  CHECK(b.glm_prompt_layout == "glm2");
  CHECK(b.lora_r == 8);
  CHECK(b.lora_alpha == 30);
  CHECK(b.lora_dropout == 0.1);
  CHECK(b.lora_target_modules == "query_key_value");
  CHECK(b.per_device_train_batch_size == 16);
  CHECK(b.learning_rate == 1e-3);
  CHECK(b.num_train_epochs == 1);
  CHECK(b.seed == 1234);
  CHECK(b.max_length == 1024);
  CHECK(b.max_source_length == 256);
  TrainingArguments c;
  apply_training_flags(c,
                       {"--train_type", "freeze", "--freeze_module_name", "layers.1.,layers.0."});
  CHECK(c.finetuning_type == "freeze");
  CHECK(c.freeze_module_name == "layers.1.,layers.0.");
  TrainingArguments e;
  apply_training_flags(e, {"--train_type", "all", "--lora_dim", "4"});
  CHECK(e.finetuning_type == "full");
  CHECK(e.lora_r == 4);
  // Without any of train.py's own flags, HF's defaults stay.
  TrainingArguments hf;
  apply_training_flags(hf, {"--learning_rate", "1e-4"});
  CHECK(hf.glm_prompt_layout.empty());
  CHECK(hf.logging_steps == 500);
  CHECK(hf.adam_beta2 == 0.999);
  TrainingArguments bad;
  CHECK_THROWS_WITH(apply_training_flags(bad, {"--mode", "glm"}), Contains("ChatGLM-6B"));
  TrainingArguments both;
  CHECK_THROWS_WITH(
      apply_training_flags(both, {"--train_type", "lora", "--finetuning_type", "freeze"}),
      Contains("train_type") && Contains("finetuning_type"));
}

TEST_CASE("zerotrain's SentencePiece reader encodes and decodes as SentencePiece itself",
          "[chatglm][tokenizer]") {
  // Random texts from pieces of ChatGLM's kind of data (runs of spaces, newlines, digits, CJK,
  // code, characters outside the vocabulary), encoded by Python's sentencepiece (Debian's
  // python3-sentencepiece, which make deps installs) and by zerotrain.
  std::string python;
  for (const char* py : {"python3", "/usr/bin/python3"}) {
    if (std::system(fmt::format("{} -c 'import sentencepiece' >/dev/null 2>&1", py).c_str()) == 0) {
      python = py;
      break;
    }
  }
  REQUIRE_FALSE(python.empty());  // make deps installs it
  const char* const parts[] = {" ",    "  ",  "    ",  "\n",   "\t",  "你好",    "模型",
                               "训练", "the", "quick", "fox",  "def", "(a, b):", "123",
                               "4",    "。",  "！",    "🙂", "𠮷",  "Ｘ",      "[gMASK]",
                               "sop",  "▁",   "a",     "é"};
  std::mt19937 gen(11);
  const std::string dir = test::temp_dir("spm");
  std::vector<std::string> texts;
  {
    std::ofstream out(dir + "/texts.jsonl");
    for (int k = 0; k < 300; ++k) {
      std::string t;
      const int n = static_cast<int>(gen() % 12);
      for (int i = 0; i < n; ++i) t += parts[gen() % std::size(parts)];
      texts.push_back(t);
      rapidjson::StringBuffer b;
      rapidjson::Writer<rapidjson::StringBuffer> w(b);
      w.String(t.c_str(), static_cast<rapidjson::SizeType>(t.size()));
      out << b.GetString() << "\n";
    }
  }
  const std::string script = fmt::format(
      "import json, sentencepiece as s\n"
      "sp = s.SentencePieceProcessor(model_file='{}')\n"
      "with open('{}/ids.jsonl', 'w') as f:\n"
      "    for line in open('{}/texts.jsonl', encoding='utf-8'):\n"
      "        ids = sp.encode(json.loads(line))\n"
      "        f.write(json.dumps({{'ids': ids, 'decoded': sp.decode(ids)}}) + '\\n')\n",
      fixture("models/chatglm/tokenizer.model"), dir, dir);
  files::write_atomic(dir + "/ref.py", script);
  REQUIRE(std::system(fmt::format("{} {}/ref.py", python, dir).c_str()) == 0);
  auto tok = fixture_tokenizer();
  std::vector<rapidjson::Document> want = read_jsonl(dir + "/ids.jsonl");
  REQUIRE(want.size() == texts.size());
  int mismatched = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    INFO(texts[i]);
    const std::vector<int32_t> ids = tok->encode_plain(texts[i]);
    CHECK(ids == ints(want[i]["ids"]));
    CHECK(tok->decode(ids) == want[i]["decoded"].GetString());
    mismatched += ids != ints(want[i]["ids"]);
  }
  CHECK(mismatched == 0);
}

TEST_CASE("ChatGLM sequences start with [gMASK] sop as its tokenizer(text) writes them",
          "[chatglm][data]") {
  auto tok = fixture_tokenizer();
  CHECK(tok->prefix_ids() == std::vector<int32_t>{*tok->command("[gMASK]"), *tok->command("sop")});
  const std::string dir = test::temp_dir("chatglm_prefix_data");
  files::write_atomic(dir + "/d.jsonl", R"({"instruction": "你好", "output": "hi"}
{"text": "plain text"}
)");
  DataOptions o;
  o.template_name = "alpaca_zh";
  Dataset d = tokenize_jsonl(dir + "/d.jsonl", *tok, o);
  REQUIRE(d.size() == 2);
  for (int64_t i = 0; i < 2; ++i) {
    const std::vector<int32_t> ids = d.ids(i).to_vector();
    CHECK(std::vector<int32_t>(ids.begin(), ids.begin() + 2) == tok->prefix_ids());
    CHECK(ids.back() == tok->eos_id());
  }
  CHECK(d.labels(0)[0] == kIgnoreLabel);  // the prefix is prompt
  CHECK(encode_prompt("alpaca_zh", *tok, "你好")[0] == *tok->command("[gMASK]"));
}

TEST_CASE("a pytorch_model.bin-only ChatGLM folder is refused with the conversion to safetensors",
          "[chatglm][hostile]") {
  const std::string dir = test::temp_dir("chatglm_bin");
  std::filesystem::copy_file(fixture("models/chatglm/config.json"), dir + "/config.json");
  files::write_atomic(dir + "/pytorch_model.bin", "not unpickled");
  ModelConfig c = load_model_config(dir);
  CausalLM model(c, at::TensorOptions(), false);
  CHECK_THROWS_AS(load_weights(model, *checkpoint_source(dir)), IoError);
  CHECK_THROWS_WITH(checkpoint_source(dir), Contains("pytorch_model") && Contains("pickle") &&
                                                Contains("safetensors") && Contains(dir));
}

TEST_CASE("ChatGLM3's chat format trains with ChatGLM's own tokenizer", "[chatglm][data]") {
  auto tok = fixture_tokenizer();
  CHECK(resolve_template("chatglm3", "", *tok) == "chatglm3");
  // Another family's format is refused naming its token.
  CHECK_THROWS_WITH(resolve_template("qwen2.5", "", *tok), Contains("<|im_start|>"));
  const std::string dir = test::temp_dir("chatglm3_chat");
  files::write_atomic(dir + "/c.jsonl", R"({"messages": [{"role": "user", "content": "你好"}, )"
                                        R"({"role": "assistant", "content": "hi"}]})"
                                        "\n");
  DataOptions o;
  o.template_name = "chatglm3";
  Dataset d = tokenize_jsonl(dir + "/c.jsonl", *tok, o);
  const std::vector<int32_t> ids = d.ids(0).to_vector();
  REQUIRE(ids.size() > 4);
  CHECK(std::vector<int32_t>(ids.begin(), ids.begin() + 3) ==
        std::vector<int32_t>{*tok->command("[gMASK]"), *tok->command("sop"),
                             *tok->command("<|user|>")});
  CHECK(std::count(ids.begin(), ids.end(), *tok->command("<|assistant|>")) == 1);
  CHECK(ids.back() == tok->eos_id());
  CHECK(d.labels(0).to_vector().back() == tok->eos_id());  // the reply and eos train
}

TEST_CASE("the chatglm2 template asks as data_set.py's GLM2 layout trains", "[chatglm][data]") {
  CHECK(render_prompt("chatglm2", "你好", "呀") == "[Round 1]\n\n问：你好呀\n\n答：");
  // The prompt ids equal the untruncated examples' masked part ([gMASK] sop + source).
  auto tok = fixture_tokenizer();
  std::vector<rapidjson::Document> records = read_jsonl(fixture("chatglm/seed_records.jsonl"));
  std::vector<rapidjson::Document> want = read_jsonl(fixture("chatglm/seed_glm2_1024_256.jsonl"));
  REQUIRE(records.size() == want.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const std::vector<int32_t> ids = ints(want[i]["input_ids"]), labels = ints(want[i]["labels"]);
    const size_t masked = static_cast<size_t>(
        std::find_if(labels.begin(), labels.end(), [](int32_t l) { return l != kIgnoreLabel; }) -
        labels.begin());
    INFO(records[i]["instruction"].GetString());
    CHECK(encode_prompt("chatglm2", *tok, records[i]["instruction"].GetString(),
                        records[i]["input"].GetString()) ==
          std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<int64_t>(masked)));
  }
}
