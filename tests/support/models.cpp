#include "support/models.hpp"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

#include <fmt/format.h>

#include "model/blocks.hpp"
#include "support/catch.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::test {

void check_same_scaling(const RopeScaling& got, const RopeScaling& want) {
  CHECK(got.type == want.type);
  CHECK(got.factor == want.factor);
  CHECK(got.low_freq_factor == want.low_freq_factor);
  CHECK(got.high_freq_factor == want.high_freq_factor);
  CHECK(got.original_max_position_embeddings == want.original_max_position_embeddings);
  CHECK(got.attention_factor == want.attention_factor);
  CHECK(got.beta_fast == want.beta_fast);
  CHECK(got.beta_slow == want.beta_slow);
  CHECK(got.mscale == want.mscale);
  CHECK(got.mscale_all_dim == want.mscale_all_dim);
  CHECK(got.truncate == want.truncate);
  CHECK(got.short_factor == want.short_factor);
  CHECK(got.long_factor == want.long_factor);
}

void check_same_model(const ModelConfig& got, const ModelConfig& want, bool same_dtype) {
  CHECK(got.model_type == want.model_type);
  CHECK(got.vocab_size == want.vocab_size);
  CHECK(got.hidden_size == want.hidden_size);
  CHECK(got.intermediate_size == want.intermediate_size);
  CHECK(got.num_hidden_layers == want.num_hidden_layers);
  CHECK(got.num_attention_heads == want.num_attention_heads);
  CHECK(got.num_key_value_heads == want.num_key_value_heads);
  CHECK(got.head_dim == want.head_dim);
  CHECK(got.max_position_embeddings == want.max_position_embeddings);
  CHECK(got.rms_norm_eps == want.rms_norm_eps);
  CHECK(got.rope_theta == want.rope_theta);
  check_same_scaling(got.rope_scaling, want.rope_scaling);
  CHECK(got.partial_rotary_factor == want.partial_rotary_factor);
  CHECK(got.tie_word_embeddings == want.tie_word_embeddings);
  CHECK(got.qkv_bias == want.qkv_bias);
  CHECK(got.o_proj_bias == want.o_proj_bias);
  CHECK(got.mlp_bias == want.mlp_bias);
  CHECK(got.fused_gate_up == want.fused_gate_up);
  CHECK(got.rope_interleaved == want.rope_interleaved);
  CHECK(got.post_sublayer_norms == want.post_sublayer_norms);
  CHECK(got.sliding_window == want.sliding_window);
  CHECK(got.eos_token_id == want.eos_token_id);
  CHECK(got.pad_token_id == want.pad_token_id);
  if (same_dtype) CHECK(got.dtype == want.dtype);
  CHECK(got.parameter_count() == want.parameter_count());
  // What the family composes from its own members (soft-caps, layer types, ...): every block.
  const model::DecoderSpec a = model::decoder_spec(got), b = model::decoder_spec(want);
  CHECK(a.scale_embeddings == b.scale_embeddings);
  CHECK(a.logit_softcap == b.logit_softcap);
  CHECK(a.final_norm.eps == b.final_norm.eps);
  CHECK(a.final_norm.unit_offset == b.final_norm.unit_offset);
  REQUIRE(a.rotaries.size() == b.rotaries.size());
  for (size_t i = 0; i < a.rotaries.size(); ++i) {
    INFO("rotary " << i);
    CHECK(a.rotaries[i].theta == b.rotaries[i].theta);
    check_same_scaling(a.rotaries[i].scaling, b.rotaries[i].scaling);
    CHECK(a.rotaries[i].max_positions == b.rotaries[i].max_positions);
    CHECK(a.rotaries[i].rotary_dim == b.rotaries[i].rotary_dim);
    CHECK(a.rotaries[i].interleaved == b.rotaries[i].interleaved);
  }
  REQUIRE(a.layers.size() == b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    INFO("layer " << i);
    const model::LayerSpec &x = a.layers[i], &y = b.layers[i];
    CHECK(x.attention.heads == y.attention.heads);
    CHECK(x.attention.kv_heads == y.attention.kv_heads);
    CHECK(x.attention.head_dim == y.attention.head_dim);
    CHECK(x.attention.qkv_bias == y.attention.qkv_bias);
    CHECK(x.attention.o_bias == y.attention.o_bias);
    CHECK(x.attention.qk_norm.has_value() == y.attention.qk_norm.has_value());
    CHECK(x.attention.window == y.attention.window);
    CHECK(x.attention.scale == y.attention.scale);
    CHECK(x.attention.softcap == y.attention.softcap);
    CHECK(x.attention.rotary == y.attention.rotary);
    CHECK(x.mlp.intermediate == y.mlp.intermediate);
    CHECK(x.mlp.bias == y.mlp.bias);
    CHECK(x.mlp.fused_gate_up == y.mlp.fused_gate_up);
    CHECK(x.mlp.activation == y.mlp.activation);
    CHECK(x.norm.eps == y.norm.eps);
    CHECK(x.norm.unit_offset == y.norm.unit_offset);
    CHECK(x.norms.before_attention == y.norms.before_attention);
    CHECK(x.norms.after_attention == y.norms.after_attention);
    CHECK(x.norms.before_mlp == y.norms.before_mlp);
    CHECK(x.norms.after_mlp == y.norms.after_mlp);
    REQUIRE(x.moe.has_value() == y.moe.has_value());
    if (x.moe) {
      CHECK(x.moe->experts == y.moe->experts);
      CHECK(x.moe->top_k == y.moe->top_k);
      CHECK(x.moe->intermediate == y.moe->intermediate);
      CHECK(x.moe->normalize_top_k == y.moe->normalize_top_k);
      CHECK(x.moe->activation == y.moe->activation);
    }
  }
}
namespace {

constexpr int64_t kFeatures = 8, kHidden = 32, kClasses = 5;
constexpr int64_t kVocab = 32, kModel = 16, kHeads = 2, kSeq = 6, kBlocks = 2;

at::Tensor ce_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                labels.reshape({-1}).to(logits.device()), {}, at::Reduction::Sum,
                                -100);
}

struct Mlp : TestModel {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  Mlp() {
    l1 = register_module("l1", torch::nn::Linear(kFeatures, kHidden));
    l2 = register_module("l2", torch::nn::Linear(kHidden, kHidden));
    l3 = register_module("l3", torch::nn::Linear(kHidden, kClasses));
  }
  at::Tensor loss_sum(const at::Tensor& x, const at::Tensor& labels) override {
    const at::Tensor& w = l1->weight;  // empty but typed while ZeRO-3 has it released
    at::Tensor h = gate(0, {x.to(w.device()).to(w.scalar_type())},
                        [l1 = l1.ptr()](const std::vector<at::Tensor>& in) {
                          return std::vector<at::Tensor>{at::tanh(l1->forward(in[0]))};
                        })[0];
    h = gate(1, {h}, [l2 = l2.ptr()](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{at::tanh(l2->forward(in[0]))};
    })[0];
    at::Tensor logits = gate(2, {h}, [l3 = l3.ptr()](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{l3->forward(in[0])};
    })[0];
    return ce_sum(logits, labels);
  }
  std::vector<UnitSpec> units() override {
    return {{"l1", l1.ptr()}, {"l2", l2.ptr()}, {"l3", l3.ptr()}};
  }
};

// ~270k parameters in 256-wide layers: large enough that alignment padding is negligible when
// memory is measured against the ZeRO formulas.
struct Wide : TestModel {
  static constexpr int64_t kIn = 16, kWidth = 256, kLayers = 4, kOut = 16;
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList list{nullptr};
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
  Wide() {
    input = register_module("input", torch::nn::Linear(kIn, kWidth));
    list = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < kLayers; ++i) {
      layers.push_back(std::make_shared<torch::nn::LinearImpl>(kWidth, kWidth));
      list->push_back(layers.back());
    }
    output = register_module("output", torch::nn::Linear(kWidth, kOut));
  }
  at::Tensor loss_sum(const at::Tensor& x, const at::Tensor& labels) override {
    const at::Tensor& w = input->weight;
    at::Tensor h = gate(0, {x.to(w.device()).to(w.scalar_type())},
                        [l = input.ptr()](const std::vector<at::Tensor>& in) {
                          return std::vector<at::Tensor>{at::tanh(l->forward(in[0]))};
                        })[0];
    for (size_t i = 0; i < layers.size(); ++i) {
      h = gate(1 + i, {h}, [l = layers[i]](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::tanh(l->forward(in[0]))};
      })[0];
    }
    at::Tensor logits =
        gate(1 + layers.size(), {h}, [l = output.ptr()](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{l->forward(in[0])};
        })[0];
    return ce_sum(logits, labels);
  }
  std::vector<UnitSpec> units() override {
    std::vector<UnitSpec> u{{"input", input.ptr()}};
    for (size_t i = 0; i < layers.size(); ++i)
      u.push_back({"layer" + std::to_string(i), layers[i]});
    u.push_back({"output", output.ptr()});
    return u;
  }
};

struct Block : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, out{nullptr}, up{nullptr}, down{nullptr};
  Block() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    // No qkv bias: the key bias has an exactly-zero gradient in exact arithmetic (softmax is
    // shift-invariant), and Adam would turn its rounding noise into lr-sized updates.
    qkv = register_module(
        "qkv", torch::nn::Linear(torch::nn::LinearOptions(kModel, 3 * kModel).bias(false)));
    out = register_module("out", torch::nn::Linear(kModel, kModel));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    up = register_module("up", torch::nn::Linear(kModel, 4 * kModel));
    down = register_module("down", torch::nn::Linear(4 * kModel, kModel));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), hd = kModel / kHeads;
    at::Tensor h = ln1->forward(x);
    std::vector<at::Tensor> parts = qkv->forward(h).chunk(3, -1);
    auto heads = [&](const at::Tensor& y) { return y.view({b, t, kHeads, hd}).transpose(1, 2); };
    at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    at::Tensor mask =
        at::ones({t, t}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    scores = scores.to(at::kFloat).masked_fill(mask, -1e9);  // -1e9 does not fit fp16
    at::Tensor att = at::matmul(at::softmax(scores, -1).to(x.scalar_type()), v);
    at::Tensor y = x + out->forward(att.transpose(1, 2).reshape({b, t, kModel}));
    return y + down->forward(at::gelu(up->forward(ln2->forward(y))));
  }
};

struct Transformer : TestModel {
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList block_list{nullptr};
  std::vector<std::shared_ptr<Block>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
  Transformer() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kModel));
    block_list = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) {
      blocks.push_back(std::make_shared<Block>());
      block_list->push_back(blocks.back());
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    head = register_module("head",
                           torch::nn::Linear(torch::nn::LinearOptions(kModel, kVocab).bias(false)));
  }
  at::Tensor loss_sum(const at::Tensor& ids, const at::Tensor& labels) override {
    at::Tensor x = gate(0, {ids.to(embed->weight.device())},
                        [embed = embed.ptr()](const std::vector<at::Tensor>& in) {
                          return std::vector<at::Tensor>{embed->forward(in[0])};
                        })[0];
    for (size_t i = 0; i < blocks.size(); ++i) {
      x = gate(1 + i, {x}, [block = blocks[i]](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{block->forward(in[0])};
      })[0];
    }
    // The final norm stays outside every unit (whole on every rank under stage 3).
    at::Tensor h = norm->forward(x);
    at::Tensor logits =
        gate(1 + blocks.size(), {h}, [head = head.ptr()](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{head->forward(in[0])};
        })[0];
    return ce_sum(logits, labels);
  }
  std::vector<UnitSpec> units() override {
    std::vector<UnitSpec> u{{"embed", embed.ptr()}};
    for (size_t i = 0; i < blocks.size(); ++i)
      u.push_back({"block" + std::to_string(i), blocks[i]});
    u.push_back({"head", head.ptr()});
    return u;
  }
};

// zerotrain's own decoder (tiny LLaMA with GQA), so engine equivalence covers the real model.
struct Llm : TestModel {
  std::shared_ptr<CausalLM> lm;
  static ModelConfig config(bool tied) {
    return parse_model_config(
        std::string(R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": )") +
        (tied ? "true}" : "false}"));
  }
  Llm(uint64_t seed, bool tied) {
    lm = register_module("lm", std::make_shared<CausalLM>(config(tied), at::TensorOptions()));
    lm->initialize_random(seed);
  }
  UnitGate& unit_gate() override { return lm->gate(); }
  at::Tensor loss_sum(const at::Tensor& ids, const at::Tensor& labels) override {
    return lm->loss(ids, labels, {}, /*chunk_tokens=*/5).sum;
  }
  std::vector<UnitSpec> units() override { return lm->units(); }
};

}  // namespace

std::shared_ptr<TestModel> make_model(const std::string& kind, uint64_t seed) {
  at::manual_seed(seed);
  if (kind == "mlp") return std::make_shared<Mlp>();
  if (kind == "wide") return std::make_shared<Wide>();
  if (kind == "llm" || kind == "llm_tied") return std::make_shared<Llm>(seed, kind == "llm_tied");
  return std::make_shared<Transformer>();
}

int64_t Batch::tokens() const {
  at::Tensor counted = causal_shift ? labels.narrow(1, 1, labels.size(1) - 1) : labels;
  return counted.ne(-100).sum().item<int64_t>();
}

Batch make_batch(const std::string& kind, int64_t step, int64_t first, int64_t count) {
  // Each sample is drawn from its own generator state, so any split of a global batch across
  // ranks and micro-steps sees exactly the same samples.
  std::vector<at::Tensor> xs, ys;
  for (int64_t i = first; i < first + count; ++i) {
    at::manual_seed(static_cast<uint64_t>(1000003 * step + i + 17));
    if (kind == "mlp" || kind == "wide") {
      const bool wide = kind == "wide";
      xs.push_back(at::randn({1, wide ? Wide::kIn : kFeatures}));
      at::Tensor y = at::randint(0, wide ? Wide::kOut : kClasses, {1}, at::kLong);
      if (at::rand({1}).item<double>() < 0.3) y.fill_(-100);  // ignored sample
      ys.push_back(y);
    } else if (kind == "llm" || kind == "llm_tied") {
      // Causal LM data: the model shifts labels itself; a random prompt length is ignored.
      at::Tensor ids = at::randint(0, 32, {1, 8}, at::kLong);
      at::Tensor labels = ids.clone();
      int64_t prompt = at::randint(1, 6, {1}, at::kLong).item<int64_t>();
      labels.narrow(1, 0, prompt).fill_(-100);
      xs.push_back(ids);
      ys.push_back(labels);
    } else {
      at::Tensor ids = at::randint(0, kVocab, {1, kSeq}, at::kLong);
      at::Tensor labels = at::roll(ids, -1, 1);
      // A random number of leading positions are "prompt" (ignored), as in instruction data.
      int64_t prompt = at::randint(0, kSeq - 1, {1}, at::kLong).item<int64_t>();
      labels.narrow(1, 0, prompt).fill_(-100);
      labels.narrow(1, kSeq - 1, 1).fill_(-100);
      xs.push_back(ids);
      ys.push_back(labels);
    }
  }
  Batch b{at::cat(xs), at::cat(ys)};
  b.causal_shift = kind == "llm" || kind == "llm_tied";
  return b;
}

std::vector<double> fixture_batch_losses(const std::shared_ptr<Communicator>& comm,
                                         const std::shared_ptr<CausalLM>& model,
                                         std::shared_ptr<ParameterSource> source,
                                         const std::string& setting, int steps) {
  const int rank = comm->rank(), world = comm->world_size();
  SafetensorsFile data(std::string(ZT_FIXTURES) + "/models/llama/expected.safetensors");
  auto ours = [&](const char* name) {
    const at::Tensor t = data.load(name);
    const int64_t rows = 4 / world;
    return at::cat({t, t.roll(5, 1)}).narrow(0, rank * rows, rows);
  };
  const at::Tensor ids = ours("input_ids"), labels = ours("labels"), mask = ours("attention_mask");
  std::string offload = setting == "3 offload" ? R"(, "offload_param": {"device": "cpu"})" : "";
  // Groups of half the job: hpZ's secondary copies, MiCS's shard groups (two nodes' worth).
  const int half = std::max(1, world / 2);
  if (setting.find("hpz") != std::string::npos && half > 1)
    offload += fmt::format(R"(, "zero_hpz_partition_size": {})", half);
  if (setting.find("mics") != std::string::npos && world > 1)
    offload += fmt::format(R"(, "mics_shard_size": {})", half);
  if (setting.find("qw") != std::string::npos) offload += R"(, "zero_quantized_weights": true)";
  if (setting.find("qg") != std::string::npos) offload += R"(, "zero_quantized_gradients": true)";
  DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
      R"({{"zero_optimization": {{"stage": {}, "stage3_param_persistence_threshold": 10{}}},
          "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}, "gradient_clipping": 1.0}})",
      setting.substr(0, 1), offload));
  TrainingArguments args;
  args.lr_scheduler_type = "constant";
  resolve_config(ds, args, ResolveContext{world, model->config().hidden_size, steps});
  EngineOptions eo;
  eo.units = model->units();
  eo.gate = &model->gate();
  eo.source = with_adapter_values(std::move(source), *model);
  Engine engine(model, ds, comm, eo);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    LossSum loss = model->loss(ids, labels, mask);
    at::Tensor global = at::tensor({loss.sum.item<float>(), static_cast<float>(loss.tokens)});
    comm->all_reduce(global)->wait();
    engine.backward(loss.sum, global[1].item<double>());
    engine.step();
    losses.push_back(global[0].item<double>() / global[1].item<double>());
  }
  return losses;
}

std::string tiny_moe_config(int experts) {
  return fmt::format(
      R"({{"model_type": "qwen3_moe", "vocab_size": 259, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "num_experts": {},
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
          "rope_theta": 1000000.0}})",
      experts);
}

}  // namespace zt::test
