// Mixtures of experts (model/moe.hpp, families/qwen3_moe.cpp): the block against the formula
// computed token by token, routing that stays inside the experts whatever the router gives, the
// grouped products' gradients, the family's config, checkpoints with one module per expert, and
// training at several world sizes against one rank.
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/layers.hpp"
#include "model/moe.hpp"
#include "model/quantized_weights.hpp"
#include "peft/fused_experts.hpp"
#include "quant/four_bit_weight.hpp"
#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
namespace fs = std::filesystem;

namespace {

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// The mixture's output for each token on its own, as transformers' formula reads: softmax over
// the router's logits in fp32, the k largest (ties to the lower index), renormalized or not,
// and each chosen expert's gated MLP weighted by its score. Differentiable in every input.
at::Tensor formula(const model::SparseMoe& m, const at::Tensor& x) {
  const model::MoeSpec& s = m.spec;
  const int64_t inter = s.intermediate;
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    const at::Tensor xt = x[t];
    const at::Tensor probs = at::softmax(at::mv(m.gate->weight, xt).to(at::kFloat), 0);
    const at::Tensor order =
        std::get<1>(at::sort(probs.detach(), /*stable=*/true, 0, /*descending=*/true));
    at::Tensor total = at::zeros_like(xt);
    at::Tensor chosen_sum = at::zeros({}, probs.options());
    for (int64_t j = 0; j < s.top_k; ++j) chosen_sum = chosen_sum + probs[order[j].item<int64_t>()];
    for (int64_t j = 0; j < s.top_k; ++j) {
      const int64_t e = order[j].item<int64_t>();
      at::Tensor w = probs[e];
      if (s.normalize_top_k) w = w / chosen_sum;
      const at::Tensor gate = at::mv(m.experts->gate_up_proj[e].narrow(0, 0, inter), xt);
      const at::Tensor up = at::mv(m.experts->gate_up_proj[e].narrow(0, inter, inter), xt);
      const at::Tensor act =
          s.activation == model::Activation::kSilu ? at::silu(gate) : at::gelu(gate, "tanh");
      total = total + at::mv(m.experts->down_proj[e], act * up) * w.to(x.scalar_type());
    }
    rows.push_back(total);
  }
  return at::stack(rows);
}

std::shared_ptr<model::SparseMoe> random_moe(const model::MoeSpec& spec, int64_t hidden,
                                             uint64_t seed) {
  model::ParamFactory o{at::TensorOptions().dtype(at::kFloat)};
  auto m = std::make_shared<model::SparseMoe>(spec, hidden, o);
  at::manual_seed(seed);
  at::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.normal_(0.0, 0.5);
  return m;
}

const std::string kMoeConfig = test::tiny_moe_config(6);

// kMoeConfig with `mlp_only_layers` set.
std::string moe_config_with_dense(int layer) {
  std::string text = kMoeConfig;
  text.insert(text.size() - 1, fmt::format(R"(, "mlp_only_layers": [{}])", layer));
  return text;
}

}  // namespace

TEST_CASE("a mixture of experts gives the formula's output and gradients token by token",
          "[model][moe]") {
  for (const bool normalize : {true, false}) {
    for (const auto act : {model::Activation::kSilu, model::Activation::kGeluTanh}) {
      INFO("normalize " << normalize << " gelu " << (act == model::Activation::kGeluTanh));
      model::MoeSpec spec{/*experts=*/5, /*top_k=*/2, /*intermediate=*/12, normalize, act};
      auto m = random_moe(spec, 16, 7);
      at::manual_seed(8);
      const at::Tensor x0 = at::randn({3, 7, 16});
      const at::Tensor probe = at::randn({3, 7, 16});
      at::Tensor x = x0.clone().requires_grad_(true);
      const at::Tensor got = m->forward(x);
      REQUIRE(got.sizes() == x.sizes());
      (got * probe).sum().backward();
      std::vector<at::Tensor> grads{x.grad().clone()};
      for (auto& p : m->parameters()) {
        grads.push_back(p.grad().clone());
        p.mutable_grad() = at::Tensor();
      }
      at::Tensor xr = x0.reshape({-1, 16}).clone().requires_grad_(true);
      const at::Tensor want = formula(*m, xr);
      CHECK(max_abs(got.reshape({-1, 16}), want) < 1e-5);
      (want * probe.reshape({-1, 16})).sum().backward();
      CHECK(max_abs(grads[0].reshape({-1, 16}), xr.grad()) < 1e-4);
      size_t i = 1;
      for (auto& p : m->named_parameters()) {
        INFO("gradient of " << p.key());
        const at::Tensor& g = grads[i++];
        CHECK(max_abs(g, p.value().grad()) / std::max(1.0, g.abs().max().item<double>()) < 1e-5);
      }
    }
  }
}

TEST_CASE("routing stays inside the experts whatever the router's logits hold", "[model][moe]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor logits = at::tensor({nan,  nan,  nan, nan, inf, -inf, 0.0, 1.0, -inf, -inf,
                                        -inf, -inf, nan, 1.0, inf, inf,  0.0, 0.0, 0.0,  0.0},
                                       at::kFloat)
                                .reshape({5, 4});
  for (const bool normalize : {true, false}) {
    const model::Routing r = model::route_top_k(logits, 3, normalize);
    REQUIRE(r.experts.sizes() == at::IntArrayRef({5, 3}));
    CHECK(r.experts.min().item<int64_t>() >= 0);
    CHECK(r.experts.max().item<int64_t>() < 4);
    // GLM-4.5's sigmoid routing over 2 groups, the correction bias NaN and infinite too.
    model::MoeSpec groups{4, 2, 8, normalize, model::Activation::kSilu};
    groups.router = model::MoeSpec::Router::kSigmoidGroups;
    groups.groups = 2;
    groups.top_groups = 1;
    for (const at::Tensor& correction :
         {at::zeros({4}), at::tensor({nan, inf, -inf, 0.5}, at::kFloat)}) {
      const model::Routing g = model::route_sigmoid_groups(logits, correction, groups);
      REQUIRE(g.experts.sizes() == at::IntArrayRef({5, 2}));
      CHECK(g.experts.min().item<int64_t>() >= 0);
      CHECK(g.experts.max().item<int64_t>() < 4);
    }
  }
  // Whole blocks too: NaN in the router's weights reaches outputs, never an index.
  model::MoeSpec spec{4, 2, 8, true, model::Activation::kSilu};
  auto m = random_moe(spec, 8, 3);
  {
    at::NoGradGuard no_grad;
    m->gate->weight[1].fill_(nan);
    m->gate->weight[2].fill_(inf);
  }
  CHECK_NOTHROW(m->forward(at::randn({2, 5, 8})));
}

TEST_CASE("grouped products: each expert's rows by its weight, unused experts' gradients zero",
          "[model][moe]") {
  at::manual_seed(4);
  const at::Tensor w0 = at::randn({4, 6, 5});
  const std::vector<int64_t> counts{3, 0, 4, 0};
  const at::Tensor x0 = at::randn({7, 5});
  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  const at::Tensor y = model::grouped_linear(x, w, counts);
  const at::Tensor probe = at::randn({7, 6});
  (y * probe).sum().backward();
  // The same products one expert at a time through autograd.
  at::Tensor xr = x0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
  const at::Tensor want = at::cat(
      {at::matmul(xr.narrow(0, 0, 3), wr[0].t()), at::matmul(xr.narrow(0, 3, 4), wr[2].t())});
  (want * probe).sum().backward();
  CHECK(max_abs(y, want) < 1e-5);
  CHECK(max_abs(x.grad(), xr.grad()) < 1e-5);
  CHECK(max_abs(w.grad(), wr.grad()) < 1e-5);
  CHECK(w.grad()[1].abs().max().item<double>() == 0.0);
  CHECK(w.grad()[3].abs().max().item<double>() == 0.0);
  // Groups from a count tensor (as the router gives them) are the same groups.
  const model::ExpertGroups from_tensor(at::tensor(counts, at::kLong));
  CHECK(from_tensor.counts() == counts);
  CHECK(at::equal(model::grouped_linear(x0, w0, from_tensor), y.detach()));
  // 4-bit experts: the product of their dequantized values, stored [E, out, in] or [E, in, out];
  // the input's gradient only.
  for (const bool transposed : {false, true}) {
    INFO("transposed: " << transposed);
    const at::Tensor values = transposed ? w0.transpose(1, 2).contiguous() : w0;
    const auto layout = model::four_bit_layout(QuantizationConfig{}, 4 * values.size(1),
                                               values.size(2), at::kFloat, 4);
    const at::Tensor storage =
        quant::quantize_weight(*layout, values.reshape({-1, values.size(2)}));
    const at::Tensor dense =
        quant::dequantize_weight(*layout, storage, at::kFloat).view(values.sizes());
    CHECK(max_abs(dense, values) > 1e-4);  // the quantization is seen
    at::Tensor xq = x0.clone().requires_grad_(true), xd = x0.clone().requires_grad_(true);
    const at::Tensor yq =
        model::quantized_grouped_linear(xq, storage, *layout, transposed, from_tensor);
    const at::Tensor yd =
        model::grouped_linear(xd, transposed ? dense.transpose(1, 2) : dense, counts);
    CHECK(max_abs(yq, yd) < 1e-5);
    (yq * probe).sum().backward();
    (yd * probe).sum().backward();
    CHECK(max_abs(xq.grad(), xd.grad()) < 1e-5);
    CHECK_THROWS_AS(model::quantized_grouped_linear(x0, storage.narrow(0, 0, 10), *layout,
                                                    transposed, from_tensor),
                    InvalidArgument);
  }
  // Counts that do not cover the rows, or a weight of another width, are errors.
  CHECK_THROWS_AS(model::grouped_linear(x0, w0, {3, 0, 3, 0}), InvalidArgument);
  CHECK_THROWS_AS(model::grouped_linear(x0, w0, {8, -1, 0, 0}), InvalidArgument);
  CHECK_THROWS_AS(model::grouped_linear(x0, w0, {7, 0, 0}), InvalidArgument);
  CHECK_THROWS_AS(model::grouped_linear(at::randn({7, 4}), w0, counts), InvalidArgument);
}

TEST_CASE("qwen3_moe's config: sparse layers by step and list, bad values named by key",
          "[model][moe][families]") {
  // kMoeConfig with the members of `extra` (a JSON object's members) set, replacing its own.
  auto with = [](const std::string& extra) {
    rapidjson::Document doc, more;
    doc.Parse(kMoeConfig.c_str());
    more.Parse(("{" + extra + "}").c_str());
    for (auto& m : more.GetObject()) {
      doc.RemoveMember(m.name);
      doc.AddMember(rapidjson::Value(m.name, doc.GetAllocator()),
                    rapidjson::Value(m.value, doc.GetAllocator()), doc.GetAllocator());
    }
    return json::dump(doc);
  };
  {
    const ModelConfig c = parse_model_config(
        with(R"("num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3])"));
    const model::DecoderSpec d = model::decoder_spec(c);
    REQUIRE(d.layers.size() == 4);
    CHECK(!d.layers[0].moe);
    CHECK(d.layers[1].moe);
    CHECK(!d.layers[2].moe);
    CHECK(!d.layers[3].moe);  // sparse by step, dense by the list
    CHECK(d.layers[1].moe->experts == 6);
    CHECK(d.layers[1].moe->top_k == 2);
    CHECK(d.layers[1].moe->intermediate == 16);
    CHECK(d.layers[1].moe->normalize_top_k);
    CHECK(d.layers[0].mlp.intermediate == 48);
    CHECK(d.layers[1].attention.qk_norm);
    // What the config says the model costs is what is built.
    CausalLM built(c, at::TensorOptions(), /*allocate=*/false);
    int64_t count = 0;
    for (const auto& p : built.parameters()) count += p.numel();
    CHECK(c.parameter_count() == count);
  }
  using test::Has;
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("num_experts_per_tok": 7)")), ConfigError,
                       Has({"num_experts_per_tok", "7 experts per token", "6 experts"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("mlp_only_layers": [0, 2])")), ConfigError,
                       Has({"mlp_only_layers", "2 is not a layer index"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("mlp_only_layers": "all")")), ConfigError,
                       Has({"mlp_only_layers"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("num_experts": 0)")), ConfigError,
                       Has({"num_experts"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("decoder_sparse_step": 0)")), ConfigError,
                       Has({"decoder_sparse_step"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("router_aux_loss_coef": -0.1)")), ConfigError,
                       Has({"router_aux_loss_coef"}));
  CHECK_THROWS_MATCHES(parse_model_config(with(R"("output_router_logits": "yes")")), ConfigError,
                       Has({"output_router_logits"}));
  // The loss is asked for only by output_router_logits; its coefficient is written back.
  CHECK_FALSE(model::decoder_spec(parse_model_config(with(R"("router_aux_loss_coef": 0.2)")))
                  .router_aux_coef);
  const ModelConfig balanced =
      parse_model_config(with(R"("output_router_logits": true, "router_aux_loss_coef": 0.2)"));
  CHECK(model::decoder_spec(balanced).router_aux_coef == 0.2);
  CHECK(model::decoder_spec(parse_model_config(model_config_json(balanced))).router_aux_coef ==
        0.2);
  CHECK_THROWS_MATCHES(
      parse_model_config(
          with(R"("num_experts": 4096, "moe_intermediate_size": 1000000, "hidden_size": 1048576)")),
      ConfigError, Has({"num_experts", "overflow"}));
  // Mixtral: every layer sparse, experts of intermediate_size, always renormalized; noise on
  // the router's input refused.
  {
    const std::string mixtral =
        R"({"model_type": "mixtral", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 5, "num_experts_per_tok": 2})";
    const model::DecoderSpec d = model::decoder_spec(parse_model_config(mixtral));
    for (const model::LayerSpec& l : d.layers) {
      REQUIRE(l.moe);
      CHECK(l.moe->experts == 5);
      CHECK(l.moe->intermediate == 24);
      CHECK(l.moe->normalize_top_k);
    }
    std::string noisy = mixtral;
    noisy.insert(noisy.size() - 1, R"(, "router_jitter_noise": 0.01)");
    CHECK_THROWS_MATCHES(parse_model_config(noisy), ConfigError, Has({"router_jitter_noise"}));
    std::string greedy = mixtral;
    greedy.replace(greedy.find("\"num_experts_per_tok\": 2"), 24, "\"num_experts_per_tok\": 6");
    CHECK_THROWS_MATCHES(parse_model_config(greedy), ConfigError,
                         Has({"num_experts_per_tok", "5 experts (num_local_experts)"}));
  }
  // transformers' other name for the count.
  std::string local = kMoeConfig;
  local.replace(local.find("\"num_experts\""), 13, "\"num_local_experts\"");
  CHECK(model::decoder_spec(parse_model_config(local)).layers[0].moe->experts == 6);
}

TEST_CASE("a checkpoint with one module per expert loads as the fused experts' tensors",
          "[model][moe]") {
  const std::string dir = test::temp_dir("moe_layouts");
  const ModelConfig c = test::write_model_folder(dir + "/fused", kMoeConfig, 12);
  CausalLM fused(c, at::TensorOptions(), false);
  load_weights(fused, *checkpoint_source(dir + "/fused"));
  // The same weights as transformers 4.x writes them: experts.<e>.{gate,up,down}_proj.weight.
  const int64_t experts = 6, inter = 16;
  // `mixtral`: as Mixtral's 4.x files, block_sparse_moe.{gate, experts.<e>.{w1,w3,w2}}.
  auto split = [&](const std::string& to, bool drop_one, bool extra_expert, bool bad_shape,
                   bool mixtral = false) {
    const std::string gate_name = mixtral ? "w1" : "gate_proj",
                      up_name = mixtral ? "w3" : "up_proj",
                      down_name = mixtral ? "w2" : "down_proj";
    const auto block = [&](std::string n) {
      if (mixtral && n.find(".mlp.") != std::string::npos)
        n.replace(n.find(".mlp."), 5, ".block_sparse_moe.");
      return n;
    };
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : fused.named_parameters()) {
      const std::string& name = p.key();
      const at::Tensor v = p.value().detach();
      const size_t at = name.find("experts.");
      if (at == std::string::npos) {
        tensors.emplace_back(name.find("mlp.gate.weight") != std::string::npos ? block(name) : name,
                             v);
        continue;
      }
      const std::string prefix = block(name.substr(0, at + 8));
      const bool gate_up = name.find("gate_up_proj") != std::string::npos;
      for (int64_t e = 0; e < experts + (extra_expert ? 1 : 0); ++e) {
        const at::Tensor w = v[std::min(e, experts - 1)];
        if (gate_up) {
          tensors.emplace_back(fmt::format("{}{}.{}.weight", prefix, e, gate_name),
                               w.narrow(0, 0, inter).contiguous());
          if (!(drop_one && e == 3)) {
            tensors.emplace_back(fmt::format("{}{}.{}.weight", prefix, e, up_name),
                                 bad_shape && e == 2 ? w.narrow(0, inter, inter - 1).contiguous()
                                                     : w.narrow(0, inter, inter).contiguous());
          }
        } else {
          tensors.emplace_back(fmt::format("{}{}.{}.weight", prefix, e, down_name), w);
        }
      }
    }
    fs::create_directories(to);
    save_sharded_safetensors(to, tensors);
    files::write_atomic(to + "/config.json", model_config_json(c));
  };
  split(dir + "/per_expert", false, false, false);
  CausalLM pieces(c, at::TensorOptions(), false);
  check_checkpoint(pieces, dir + "/per_expert");
  load_weights(pieces, *checkpoint_source(dir + "/per_expert"));
  at::manual_seed(2);
  const at::Tensor ids = at::randint(3, 259, {2, 9}, at::kLong);
  {
    at::NoGradGuard no_grad;
    CHECK(at::equal(fused.logits(ids), pieces.logits(ids)));
  }
  // Mixtral's names for the same (the router renamed too): the same model.
  split(dir + "/mixtral_names", false, false, false, /*mixtral=*/true);
  CausalLM renamed(c, at::TensorOptions(), false);
  check_checkpoint(renamed, dir + "/mixtral_names");
  load_weights(renamed, *checkpoint_source(dir + "/mixtral_names"));
  {
    at::NoGradGuard no_grad;
    CHECK(at::equal(fused.logits(ids), renamed.logits(ids)));
  }
  // A slice across experts, as a ZeRO-3 rank reads its part.
  auto source = checkpoint_source(dir + "/per_expert");
  const std::string name = "model.layers.1.mlp.experts.gate_up_proj";
  const at::Tensor whole = fused.named_parameters()[name].detach().reshape({-1});
  at::Tensor part = at::empty({1000});
  source->read(name, {experts, 2 * inter, 32}, 777, part);
  CHECK(at::equal(part, whole.narrow(0, 777, 1000)));
  CHECK(source->has(name));
  // A missing piece, a piece of the wrong shape, an expert beyond the config: named.
  using test::Has;
  split(dir + "/missing", true, false, false);
  CHECK_THROWS_MATCHES(check_checkpoint(pieces, dir + "/missing"), IoError,
                       Has({"lacks tensor", "experts.3.up_proj.weight", "num_experts"}));
  CHECK_THROWS_MATCHES(load_weights(pieces, *checkpoint_source(dir + "/missing")), IoError,
                       Has({"experts.3.up_proj.weight"}));
  split(dir + "/shape", false, false, true);
  CHECK_THROWS_MATCHES(check_checkpoint(pieces, dir + "/shape"), IoError,
                       Has({"experts.2.up_proj.weight", "[15, 32]", "[16, 32]"}));
  split(dir + "/extra", false, true, false);
  CHECK_THROWS_MATCHES(check_checkpoint(pieces, dir + "/extra"), IoError,
                       Has({"experts.6.", "set num_experts"}));
  // A fused file whose experts' tensor holds another count than the config's: named with both
  // shapes, in the check and in the read.
  {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : fused.named_parameters()) {
      const bool experts = p.key() == "model.layers.1.mlp.experts.down_proj";
      tensors.emplace_back(
          p.key(), experts ? p.value().detach().narrow(0, 0, 5).contiguous() : p.value().detach());
    }
    fs::create_directories(dir + "/fused_count");
    save_sharded_safetensors(dir + "/fused_count", tensors);
    files::write_atomic(dir + "/fused_count/config.json", model_config_json(c));
    CHECK_THROWS_MATCHES(
        check_checkpoint(pieces, dir + "/fused_count"), IoError,
        Has({"model.layers.1.mlp.experts.down_proj", "[5, 32, 16]", "[6, 32, 16]"}));
    CHECK_THROWS_MATCHES(load_weights(pieces, *checkpoint_source(dir + "/fused_count")), IoError,
                         Has({"model.layers.1.mlp.experts.down_proj", "[5, 32, 16]"}));
  }
}

TEST_CASE(
    "LoRA all-linear on a mixture-of-experts model trains the attention, routers and experts as "
    "PEFT 0.21 converts it, and merges",
    "[model][moe][peft]") {
  const std::string dir = test::temp_dir("moe_lora");
  test::write_data(dir, "train.jsonl", 16, 4);
  // Layer 1 dense (mlp_only_layers), layer 0 a mixture.
  const ModelConfig c = test::write_model_folder(dir + "/base", moe_config_with_dense(1), 21);
  test::train_on_base(dir, {"--max_steps", "4", "--save_steps", "4", "--finetuning_type", "lora",
                            "--lora_target", "all-linear", "--lora_r", "4"});
  // PEFT 0.21 on transformers 5 resolves all-linear to names and moves the experts' 4.x names
  // and the router's to target_parameters: the attention, the routers and the experts (gate_up
  // at rank 2r) are adapted; the dense layer's MLP is no longer named.
  const std::string config = files::read_text(dir + "/out/adapter_config.json");
  INFO(config);
  for (const char* name : {"\"q_proj\"", "\"o_proj\"", "\"gate.weight\"", "\"gate_up_proj\"",
                           "\"down_proj\"", R"(".*\\.gate_up_proj": 8)"}) {
    CHECK(config.find(name) != std::string::npos);
  }
  SafetensorsCheckpoint adapter(dir + "/out/adapter_model.safetensors");
  for (const std::string& name : adapter.names()) {
    INFO(name);
    CHECK(name.find("layers.1.mlp") == std::string::npos);
  }
  CHECK(adapter.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  CHECK(adapter.contains("base_model.model.model.layers.0.mlp.gate.lora_A.weight"));
  CHECK(adapter.contains("base_model.model.model.layers.0.mlp.experts.lora_A.weight"));
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out", dir + "/merged", options);
  CausalLM with_adapter(c, at::TensorOptions(), false), merged(c, at::TensorOptions(), false);
  load_weights(with_adapter, *checkpoint_source(dir + "/base"));
  load_adapter(with_adapter, dir + "/out", false);
  load_weights(merged, *checkpoint_source(dir + "/merged"));
  at::NoGradGuard no_grad;
  at::manual_seed(6);
  const at::Tensor ids = at::randint(3, 250, {2, 10}, at::kLong);
  const at::Tensor a = with_adapter.logits(ids), b = merged.logits(ids);
  CHECK(max_abs(a, b) < 1e-4);
  // The adapter changed the outputs; the merge folded it into the router and the experts and
  // left the dense layer's MLP as it was.
  CausalLM plain(c, at::TensorOptions(), false);
  load_weights(plain, *checkpoint_source(dir + "/base"));
  CHECK(max_abs(plain.logits(ids), b) > 1e-3);
  SafetensorsCheckpoint base(dir + "/base"), out(dir + "/merged");
  for (const char* name :
       {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj"}) {
    INFO(name);
    CHECK_FALSE(at::equal(base.load(name), out.load(name)));
  }
  CHECK(at::equal(base.load("model.layers.1.mlp.down_proj.weight"),
                  out.load("model.layers.1.mlp.down_proj.weight")));
}

namespace {

// kMoeConfig (layer 1 dense) with the load-balancing loss at coefficient `coef`.
std::string balanced_config(double coef) {
  std::string text = moe_config_with_dense(1);
  text.insert(text.size() - 1,
              fmt::format(R"(, "output_router_logits": true, "router_aux_loss_coef": {})", coef));
  return text;
}

}  // namespace

TEST_CASE("the load-balancing loss: k for an even router, padding left out, its own gradient",
          "[model][moe]") {
  const ModelConfig c = parse_model_config(balanced_config(0.5));
  CausalLM m(c, at::TensorOptions(), false);
  load_weights(m, *random_source(c, 17));
  at::manual_seed(4);
  const at::Tensor ids = at::randint(3, 250, {2, 9}, at::kLong);
  at::Tensor mask = at::ones({2, 9}, at::kLong);
  mask[1].narrow(0, 6, 3).fill_(0);
  const at::Tensor labels = ids.clone();
  std::vector<at::Tensor> routers;
  for (const auto& p : m.named_parameters()) {
    if (p.key().find("mlp.gate.weight") != std::string::npos) routers.push_back(p.value());
  }
  REQUIRE(routers.size() == 1);  // layer 0; layer 1 is dense
  // Only a forward with gradients computes it (evaluation and generation do not), with the
  // config's coefficient.
  {
    at::NoGradGuard no_grad;
    CHECK_FALSE(m.loss(ids, labels, mask).aux.defined());
  }
  CHECK(m.loss(ids, labels, mask).aux_coef == 0.5);
  // A router of zeros spreads every token evenly: P_e = R / E, and the top k take the first k
  // experts (ties to the lower index), so aux = E · Σ_e C_e P_e / R² = k; padding changes
  // neither side.
  {
    at::NoGradGuard no_grad;
    for (const at::Tensor& r : routers) r.zero_();
  }
  for (const at::Tensor& with_mask : {mask, at::Tensor()}) {
    CHECK(m.loss(ids, labels, with_mask).aux.item<double>() == Approx(2.0).epsilon(1e-6));
  }
  // A trained router: the gradient that reaches the routers is the loss's own, against finite
  // differences of its value along a random direction (small enough that no choice flips).
  {
    at::NoGradGuard no_grad;
    for (const at::Tensor& r : routers) r.normal_(0.0, 0.5);
  }
  const auto aux_value = [&] { return m.loss(ids, labels, mask).aux.item<double>(); };
  const double base = aux_value();
  CHECK(base > 2.0);  // uneven routing costs more than the even one
  m.zero_grad();
  LossSum l = m.loss(ids, labels, mask);
  // The objective reaches the routers through the layers: the language-model loss (here
  // weighted 0) carries the backward there.
  (l.sum * 0.0 + l.aux).backward();
  std::vector<at::Tensor> directions;
  double analytic = 0.0;
  at::manual_seed(9);
  for (const at::Tensor& r : routers) {
    directions.push_back(at::randn_like(r));
    REQUIRE(r.grad().defined());
    analytic += (r.grad() * directions.back()).sum().item<double>();
  }
  const double eps = 1e-3;
  const auto moved = [&](double by) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < routers.size(); ++i) routers[i].add_(directions[i] * by);
  };
  moved(eps);
  const double up = aux_value();
  moved(-2 * eps);
  const double down = aux_value();
  moved(eps);
  INFO("aux " << base << ", analytic " << analytic << ", differences " << (up - down) / (2 * eps));
  CHECK(std::abs(analytic) > 1e-2);
  CHECK((up - down) / (2 * eps) == Approx(analytic).epsilon(2e-2));
}

TEST_CASE("the load-balancing loss trains the routers alike with and without recomputation",
          "[model][moe][trainer]") {
  // Activation checkpointing and ZeRO-3 recompute each layer in backward: the routers' share of
  // the loss's gradient must come from the recomputation as it comes from the first pass.
  const std::string dir = test::temp_dir("moe_balance");
  test::write_data(dir, "train.jsonl", 16, 4);
  test::write_model_folder(dir + "/base", balanced_config(0.5), 21);
  // Adam's epsilon 1e-4: fp32 summation noise on near-zero gradients stays out of the updates
  // (as the equivalence tests of test_trainer.cpp do); no clipping, which a DeepSpeed config
  // without gradient_clipping turns off.
  const std::vector<std::string> full{"--max_steps",    "3",    "--finetuning_type", "full",
                                      "--adam_epsilon", "1e-4", "--max_grad_norm",   "0"};
  const std::vector<double> plain = test::train_on_base(dir, full);
  REQUIRE(plain.size() == 3);
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--gradient_checkpointing", "true"},
        std::vector<std::string>{"--deepspeed", R"({"zero_optimization": {"stage": 3}})"}}) {
    INFO(extra[0]);
    std::vector<std::string> flags = full;
    flags.insert(flags.end(), extra.begin(), extra.end());
    flags.insert(flags.end(), {"--output_dir", dir + "/out_" + extra[0].substr(2)});
    const std::vector<double> got = test::train_on_base(dir, flags);
    REQUIRE(got.size() == plain.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(plain[i]).epsilon(1e-5));
  }
  // Without the loss the same run steps differently: its logged loss lacks coef · aux, and from
  // the second step on the routers have moved otherwise.
  fs::remove_all(dir + "/base");
  test::write_model_folder(dir + "/base", moe_config_with_dense(1), 21);
  std::vector<std::string> flags = full;
  flags.insert(flags.end(), {"--output_dir", dir + "/out_plain"});
  const std::vector<double> without = test::train_on_base(dir, flags);
  REQUIRE(without.size() == plain.size());
  CHECK(plain[0] - without[0] > 0.5);  // 0.5 · aux, aux ≥ 1
  // LLaMA-Factory's moe_aux_loss_coef turns it on over the same config.json.
  flags.insert(flags.end(), {"--output_dir", dir + "/out_option", "--moe_aux_loss_coef", "0.5"});
  const std::vector<double> option = test::train_on_base(dir, flags);
  REQUIRE(option.size() == plain.size());
  for (size_t i = 0; i < option.size(); ++i) CHECK(option[i] == Approx(plain[i]).epsilon(1e-6));
  // Batches fed by the host program refuse it rather than leave it out.
  test::write_model_folder(dir + "/host_base", balanced_config(0.5), 21);
  TrainingArguments args;
  apply_training_flags(args, {"--model_name_or_path", dir + "/host_base", "--output_dir",
                              dir + "/out_host", "--max_steps", "2"});
  Trainer host(args, std::shared_ptr<Communicator>(test::join()));
  const at::Tensor ids = at::randint(3, 250, {2, 8}, at::kLong);
  CHECK_THROWS_MATCHES(host.train_step(ids, ids), ConfigError,
                       test::Has({"output_router_logits", "train_step"}));
}

TEST_CASE("QLoRA over a mixture-of-experts base: 4-bit projections and experts, routers kept",
          "[model][moe][peft][quant]") {
  const std::string dir = test::temp_dir("moe_qlora");
  test::write_data(dir, "train.jsonl", 16, 9);
  const ModelConfig c = test::write_model_folder(dir + "/base", moe_config_with_dense(1), 22);
  const std::vector<double> losses = test::train_on_base(
      dir, {"--max_steps", "3", "--save_steps", "3", "--finetuning_type", "lora", "--lora_target",
            "all", "--lora_r", "4", "--quantization_bit", "4"});
  REQUIRE(losses.size() == 3);
  for (double l : losses) CHECK(std::isfinite(l));
  // The base the run trained over: its projections and experts 4-bit, the router as loaded.
  ModelConfig q = c;
  QuantizationConfig nf4;
  q.quantization = nf4;
  CausalLM model(q, at::TensorOptions(), false);
  load_weights(model, *checkpoint_source(dir + "/base"));
  const auto params = model.named_parameters();
  CHECK(params["model.layers.0.self_attn.q_proj.weight"].scalar_type() == at::kByte);
  CHECK(params["model.layers.1.mlp.gate_proj.weight"].scalar_type() == at::kByte);
  CHECK(params["model.layers.0.mlp.experts.gate_up_proj"].scalar_type() == at::kByte);
  CHECK(params["model.layers.0.mlp.experts.down_proj"].scalar_type() == at::kByte);
  CHECK(params["model.layers.0.mlp.gate.weight"].scalar_type() == at::kFloat);
  // The adapter trained on top of it and merges into the full-precision base.
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out", dir + "/merged", options);
  SafetensorsCheckpoint merged(dir + "/merged");
  CHECK(merged.contains("model.layers.0.mlp.experts.down_proj"));
}

TEST_CASE("Freeze and DPO train a mixture-of-experts model: the chosen layers' experts move",
          "[model][moe][trainer]") {
  // Layer 0 dense, layer 1 a mixture.
  for (const char* stage : {"sft", "dpo"}) {
    INFO("stage " << stage);
    const std::string dir = test::temp_dir("moe_freeze");
    if (std::string(stage) == "dpo") {
      test::write_pairs(dir, "train.jsonl", 12, 3);
    } else {
      test::write_data(dir, "train.jsonl", 12, 3);
    }
    test::write_model_folder(dir + "/base", moe_config_with_dense(0), 31);
    const std::vector<double> losses =
        test::train_on_base(dir, {"--stage", stage, "--per_device_eval_batch_size", "1",
                                  "--max_steps", "3", "--save_steps", "3", "--finetuning_type",
                                  "freeze", "--freeze_trainable_layers", "1"});
    REQUIRE(losses.size() == 3);
    for (double l : losses) CHECK(std::isfinite(l));
    // The last layer (the mixture) trained, router and experts included; layer 0 did not.
    SafetensorsCheckpoint base(dir + "/base"), out(dir + "/out");
    for (const char* name :
         {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
          "model.layers.1.mlp.experts.down_proj"}) {
      INFO(name);
      CHECK(max_abs(base.load(name), out.load(name)) > 0.0);
    }
    CHECK(at::equal(base.load("model.layers.0.mlp.gate_proj.weight"),
                    out.load("model.layers.0.mlp.gate_proj.weight")));
  }
}

// ---- LoRA on the experts (PEFT's target_parameters) ---------------------------------------------

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// PEFT's parameter name ("base_model.model.X.lora_A.default.weight") as the model's
// ("X.lora_A.weight").
std::string model_name_of(std::string peft) {
  peft.erase(0, std::string("base_model.model.").size());
  const size_t at = peft.find(".default");
  if (at != std::string::npos) peft.erase(at, 8);
  return peft;
}

std::shared_ptr<CausalLM> family_model(const std::string& family) {
  ModelConfig c = load_model_config(fixture("models/" + family));
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*model, *checkpoint_source(fixture("models/" + family)));
  return model;
}

// Logits compared on real tokens.
double max_abs_real(const at::Tensor& got, const at::Tensor& want, const at::Tensor& mask) {
  const at::Tensor real = mask.to(at::kBool);
  return max_abs(got.index({real}), want.index({real}));
}

}  // namespace

TEST_CASE("PEFT's adapters on the experts give PEFT's logits, loss and gradients in zerotrain",
          "[model][moe][peft][parity]") {
  // Made by PEFT 0.21 over transformers 5.17 (make_fixtures.py experts): target_parameters on
  // the fused gate_up_proj (inside) and down_proj (outside) with q/v LoRA, rsLoRA on Mixtral's
  // down_proj alone, and on GLM-4.5 target_modules ["k_proj", "down_proj"] as PEFT's conversion
  // for transformers 5 leaves them (down_proj moved to target_parameters: the experts', not the
  // dense layer's or the shared expert's).
  const std::pair<const char*, const char*> cases[] = {
      {"experts_qwen3_moe", "qwen3_moe"},
      {"experts_mixtral_rslora", "mixtral"},
      {"experts_glm4_moe", "glm4_moe"},
      {"experts_gpt_oss", "gpt_oss"},
      {"experts_qwen3_moe_all_linear", "qwen3_moe"},
      {"experts_mixtral_w123", "mixtral"}};
  for (const auto& [name, family] : cases) {
    INFO("adapter " << name);
    const std::string dir = fixture(std::string("peft/") + name);
    auto model = family_model(family);
    const ParameterCount count = load_adapter(*model, dir, /*trainable=*/true);
    const std::string counts = files::read_text(dir + "/counts.json");
    CHECK_THAT(counts, Catch::Contains(fmt::format("\"trainable\": {}", count.trainable)));
    SafetensorsFile expected(dir + "/expected.safetensors");
    const at::Tensor ids = expected.load("input_ids"), mask = expected.load("attention_mask");
    {
      at::NoGradGuard no_grad;
      CHECK(max_abs_real(model->logits(ids, mask), expected.load("logits"), mask) < 2e-5);
    }
    LossSum l = model->loss(ids, expected.load("labels"), mask);
    const at::Tensor loss = l.sum / static_cast<double>(l.tokens);
    CHECK(loss.item<double>() == Approx(expected.load("loss").item<double>()).epsilon(1e-5));
    loss.backward();
    const auto params = model->named_parameters();
    int experts = 0;
    for (const std::string& key : expected.names()) {
      if (key.rfind("grad.", 0) != 0) continue;
      const std::string ours = model_name_of(key.substr(5));
      INFO("gradient of " << ours);
      REQUIRE(params.contains(ours));
      const at::Tensor g = expected.load(key);
      CHECK(max_abs(params[ours].grad(), g) / std::max(1e-3, g.abs().max().item<double>()) < 2e-5);
      experts += ours.find("experts") != std::string::npos;
    }
    CHECK(experts >= 4);
  }
}

TEST_CASE("LoRA on the experts saves PEFT's keys, loads back, merges and turns off",
          "[model][moe][peft]") {
  // The qwen3_moe fixture with the options of PEFT's experts_qwen3_moe adapter.
  const PeftConfig c = load_adapter_config(fixture("peft/experts_qwen3_moe"));
  REQUIRE(c.lora.target_parameters.size() == 2);
  auto model = family_model("qwen3_moe");
  const auto base_params = model->named_parameters();
  const at::Tensor base_gate_up = base_params["model.layers.0.mlp.experts.gate_up_proj"].clone();
  const at::Tensor ids = at::randint(3, 128, {2, 10}, at::kLong);
  at::Tensor base_logits;
  {
    at::NoGradGuard no_grad;
    base_logits = model->logits(ids);
  }
  apply_peft(*model, c, 7);
  {
    at::NoGradGuard no_grad;  // give B (zero at the start) an effect
    for (auto& item : model->named_parameters()) {
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
    }
  }
  at::NoGradGuard no_grad;
  const at::Tensor adapted = model->logits(ids);
  CHECK(max_abs(adapted, base_logits) > 1e-3);
  // PEFT's tensor names and shapes, nothing more.
  const std::string dir = test::temp_dir("expert_adapter");
  save_adapter(*model, c, dir);
  SafetensorsFile ours(dir + "/adapter_model.safetensors");
  SafetensorsFile peft(fixture("peft/experts_qwen3_moe/adapter_model.safetensors"));
  CHECK(ours.names().size() == peft.names().size());
  for (const std::string& key : peft.names()) {
    INFO(key);
    REQUIRE(ours.contains(key));
    CHECK(ours.info(key).shape == peft.info(key).shape);
  }
  CHECK_THAT(files::read_text(dir + "/adapter_config.json"),
             Catch::Contains("\"target_parameters\"") && Catch::Contains("experts.down_proj"));
  auto loaded = family_model("qwen3_moe");
  load_adapter(*loaded, dir, /*trainable=*/false);
  CHECK(max_abs(loaded->logits(ids), adapted) < 1e-5);
  // Off: the base model; back on: the adapter.
  model->set_adapters_enabled(false);
  CHECK(max_abs(model->logits(ids), base_logits) < 1e-6);
  model->set_adapters_enabled(true);
  // Merged: the same outputs from the tensors alone; unmerged: the base tensors again.
  merge_lora(*model);
  const auto merged_params = model->named_parameters();
  CHECK(max_abs(merged_params["model.layers.0.mlp.experts.gate_up_proj"], base_gate_up) > 1e-4);
  CHECK(max_abs(model->logits(ids), adapted) < 1e-5);
  CHECK_THROWS_AS(model->set_adapters_enabled(false), InvalidArgument);
  unmerge_lora(*model);
  CHECK(max_abs(model->named_parameters()["model.layers.0.mlp.experts.gate_up_proj"],
                base_gate_up) < 1e-6);
  // The exported model folds the experts' adapters in and holds no adapter tensor.
  const std::string exported = test::temp_dir("expert_export");
  export_merged(*model, exported, at::kFloat);
  SafetensorsCheckpoint folder(exported);
  for (const std::string& n : folder.names()) CHECK(n.find("lora_") == std::string::npos);
  CausalLM plain(load_model_config(exported), at::TensorOptions(), false);
  load_weights(plain, *checkpoint_source(exported));
  CHECK(max_abs(plain.logits(ids), adapted) < 1e-5);
}

namespace {

// `zerotrain merge` of the run's output in `dir` (into `dir`/merged, fp32), and three models of
// `c`: the base with the run's adapter, the merged folder, and the base alone.
struct MergedRun {
  std::shared_ptr<CausalLM> with_adapter, merged, plain;
};
MergedRun merge_run(const std::string& dir, const ModelConfig& c) {
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out", dir + "/merged", options);
  MergedRun r{std::make_shared<CausalLM>(c, at::TensorOptions(), false),
              std::make_shared<CausalLM>(c, at::TensorOptions(), false),
              std::make_shared<CausalLM>(c, at::TensorOptions(), false)};
  load_weights(*r.with_adapter, *checkpoint_source(dir + "/base"));
  load_adapter(*r.with_adapter, dir + "/out", false);
  load_weights(*r.merged, *checkpoint_source(dir + "/merged"));
  load_weights(*r.plain, *checkpoint_source(dir + "/base"));
  return r;
}

}  // namespace

TEST_CASE("LoRA on the experts trains through the trainer, and its checkpoint merges",
          "[model][moe][peft][trainer]") {
  const std::string dir = test::temp_dir("moe_expert_lora");
  test::write_data(dir, "train.jsonl", 16, 9);
  const ModelConfig c = test::write_model_folder(dir + "/base", moe_config_with_dense(1), 23);
  const std::vector<double> losses = test::train_on_base(
      dir, {"--max_steps", "4", "--save_steps", "4", "--finetuning_type", "lora", "--lora_r", "4",
            "--lora_target", "q_proj", "--lora_target_parameters",
            "experts.gate_up_proj,mlp.experts.down_proj", "--lora_modules_to_save", "gate"});
  REQUIRE(losses.size() == 4);
  SafetensorsFile adapter(dir + "/out/adapter_model.safetensors");
  CHECK(adapter.contains("base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"));
  CHECK(adapter.contains("base_model.model.model.layers.0.mlp.experts.lora_A.weight"));
  CHECK(adapter.load("base_model.model.model.layers.0.mlp.experts.lora_B.weight")
            .abs()
            .max()
            .item<double>() > 0);
  // The router, frozen by default, trains in full when asked (modules_to_save).
  SafetensorsCheckpoint base_folder(dir + "/base");
  REQUIRE(adapter.contains("base_model.model.model.layers.0.mlp.gate.weight"));
  CHECK(max_abs(adapter.load("base_model.model.model.layers.0.mlp.gate.weight"),
                base_folder.load("model.layers.0.mlp.gate.weight")) > 0);
  // `zerotrain merge` of the run's output folds the expert adapters into the tensors.
  const MergedRun run = merge_run(dir, c);
  at::NoGradGuard no_grad;
  const at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
  const at::Tensor want = run.with_adapter->logits(ids);
  CHECK(max_abs(run.merged->logits(ids), want) < 1e-4);
  CHECK(max_abs(run.plain->logits(ids), want) > 1e-4);
  SafetensorsCheckpoint base(dir + "/base"), out(dir + "/merged");
  CHECK(max_abs(base.load("model.layers.0.mlp.experts.down_proj"),
                out.load("model.layers.0.mlp.experts.down_proj")) > 0);
}

TEST_CASE("4-bit experts compute with their dequantized values, forward and backward",
          "[model][moe][peft][quant]") {
  // Each family's fused experts as NF4 storage (double quantization, QLoRA's recipe) against a
  // twin holding every 4-bit weight's dequantized values in fp32: the same logits, and LoRA on
  // the experts and the attention gets the same gradients — the input's gradient flows through
  // the 4-bit experts to the first layer's adapter.
  for (const char* family : {"qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"}) {
    INFO(family);
    const std::string dir = fixture(std::string("models/") + family);
    const ModelConfig c = load_model_config(dir);
    ModelConfig q = c;
    q.quantization = QuantizationConfig{};
    CausalLM four(q, at::TensorOptions(), false), twin(c, at::TensorOptions(), false);
    load_weights(four, *checkpoint_source(dir));
    load_weights(twin, *model::merge_base_source(dir, c, q.quantization));
    const auto params = four.named_parameters(), dense_params = twin.named_parameters();
    int64_t stored = 0, values = 0;
    for (const auto& [name, layout] : model::quantized_weights(four)) {
      if (name.find("experts.") == std::string::npos) continue;
      INFO(name);
      CHECK(params[name].scalar_type() == at::kByte);
      CHECK(layout->value_shape() == dense_params[name].sizes().vec());
      stored += params[name].numel();
      values += layout->numel();
    }
    REQUIRE(values > 0);
    CHECK(stored * 4 < values * 3);  // under a byte a value (fp32: 4), code tables included
    const at::Tensor ids = at::randint(3, c.vocab_size - 1, {2, 9}, at::kLong);
    {
      at::NoGradGuard no_grad;
      const at::Tensor want = twin.logits(ids);
      CHECK(max_abs(four.logits(ids), want) < 1e-5);
      // The twin differs from the full-precision model: the comparison sees the quantization.
      CHECK(max_abs(family_model(family)->logits(ids), want) > 1e-5);
    }
    PeftConfig lora;
    lora.type = FinetuningType::kLora;
    lora.lora.r = 4;
    lora.lora.target_modules = {"q_proj"};
    lora.lora.target_parameters = {"experts.gate_up_proj", "experts.down_proj"};
    apply_peft(four, lora, 5);
    apply_peft(twin, lora, 5);
    {
      at::NoGradGuard no_grad;  // B is zero at the start: give it values, the same in both
      auto twin_params = twin.named_parameters();
      at::manual_seed(6);
      for (auto& item : four.named_parameters()) {
        if (item.key().find("lora_B") == std::string::npos) continue;
        item.value().normal_(0, 0.05);
        twin_params[item.key()].copy_(item.value());
      }
    }
    const at::Tensor labels = ids.roll(-1, 1);
    for (CausalLM* m : {&four, &twin}) m->loss(ids, labels).sum.backward();
    const auto twin_params = twin.named_parameters();
    int adapters = 0;
    for (const auto& item : four.named_parameters()) {
      if (!item.value().requires_grad()) continue;
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      const at::Tensor want = twin_params[item.key()].grad();
      CHECK(max_abs(item.value().grad(), want) <=
            1e-5 * std::max(1.0, want.abs().max().item<double>()));
      adapters += item.key().find("layers.0.self_attn.q_proj.lora_A") != std::string::npos;
    }
    CHECK(adapters == 1);
  }
}

TEST_CASE("LoRA on the experts over a 4-bit base trains, continues from its folder and merges",
          "[model][moe][peft][quant]") {
  // QLoRA: the projections and the experts 4-bit, the experts with their LoRA; the run's output
  // continues (adapter_name_or_path) from its saved values, and `zerotrain merge` folds the
  // experts' adapters into the dequantized base, as PEFT merges into a 4-bit model.
  const std::string dir = test::temp_dir("moe_expert_qlora");
  test::write_data(dir, "train.jsonl", 16, 9);
  const ModelConfig c = test::write_model_folder(dir + "/base", moe_config_with_dense(1), 24);
  const std::vector<std::string> lora{"--finetuning_type",
                                      "lora",
                                      "--lora_r",
                                      "4",
                                      "--lora_target",
                                      "q_proj,k_proj,v_proj,o_proj",
                                      "--lora_target_parameters",
                                      "experts.down_proj",
                                      "--quantization_bit",
                                      "4"};
  std::vector<std::string> first{"--max_steps", "3", "--save_steps", "3"};
  first.insert(first.end(), lora.begin(), lora.end());
  const std::vector<double> losses = test::train_on_base(dir, first);
  REQUIRE(losses.size() == 3);
  for (double l : losses) CHECK(std::isfinite(l));
  SafetensorsFile trained(dir + "/out/adapter_model.safetensors");
  const std::string key = "base_model.model.model.layers.0.mlp.experts.lora_B.weight";
  REQUIRE(trained.contains(key));
  CHECK(trained.load(key).abs().max().item<double>() > 0);
  // Continued from the folder: the first step starts at its values (a learning rate of 0 keeps
  // them, so the adapter written again is the one read).
  const std::string again = dir + "/again";
  std::vector<std::string> more{"--max_steps",     "1",  "--save_steps",           "1",
                                "--learning_rate", "0",  "--adapter_name_or_path", dir + "/out",
                                "--output_dir",    again};
  more.insert(more.end(), lora.begin(), lora.end());
  test::train_on_base(dir, more);
  SafetensorsFile continued(again + "/adapter_model.safetensors");
  CHECK(at::equal(continued.load(key), trained.load(key)));
  MergeOptions options;
  options.dtype = at::kFloat;
  merge_checkpoint(dir + "/out", dir + "/merged", options);
  SafetensorsCheckpoint base(dir + "/base"), merged(dir + "/merged");
  ModelConfig q = c;
  q.quantization = QuantizationConfig{};
  auto dequantized = model::merge_base_source(dir + "/base", c, q.quantization);
  const auto values = [&](const char* name) {
    at::Tensor out = at::empty(base.info(name).shape, at::kFloat);
    dequantized->read(name, out.sizes().vec(), 0, out);
    return out;
  };
  // down_proj: its adapter folded into its dequantized values; gate_up_proj: those values alone.
  const char* down = "model.layers.0.mlp.experts.down_proj";
  const char* gate_up = "model.layers.0.mlp.experts.gate_up_proj";
  CHECK(max_abs(values(down), merged.load(down).to(at::kFloat)) > 0);
  CHECK(max_abs(values(gate_up), merged.load(gate_up).to(at::kFloat)) < 1e-6);
  CHECK(max_abs(base.load(gate_up).to(at::kFloat), merged.load(gate_up).to(at::kFloat)) > 1e-4);
}

TEST_CASE("target_parameters that pick no expert tensor, or options PEFT refuses there, are named",
          "[model][moe][peft][errors]") {
  auto moe = family_model("qwen3_moe");
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.r = 2;
  c.lora.target_modules = {"q_proj"};
  auto refused = [&](std::shared_ptr<CausalLM> model, const std::vector<std::string>& words) {
    CHECK_THROWS_MATCHES(apply_peft(*model, c, 1), ConfigError, test::Has(words));
  };
  c.lora.target_parameters = {"experts.up_proj"};  // a 4.x name, not a fused tensor
  refused(moe, {"lora_target_parameters", "experts.up_proj", "gate_up_proj", "down_proj"});
  c.lora.target_parameters = {"self_attn.q_proj.weight"};  // a parameter, but no expert tensor
  refused(family_model("qwen3_moe"), {"lora_target_parameters", "q_proj.weight"});
  c.lora.target_parameters = {"experts.down_proj"};
  refused(family_model("llama"), {"lora_target_parameters", "no mixture-of-experts"});
  c.lora.dropout = 0.1;
  refused(family_model("qwen3_moe"), {"lora_target_parameters", "lora_dropout"});
  c.lora.dropout = 0;
  c.lora.use_dora = true;
  refused(family_model("qwen3_moe"), {"lora_target_parameters", "DoRA"});
  c.lora.use_dora = false;
  c.lora.init_lora_weights = "pissa";
  refused(family_model("qwen3_moe"), {"lora_target_parameters", "PiSSA"});
  // An adapter_config.json whose target_parameters is not a list of names.
  for (const char* bad : {R"("experts.down_proj")", R"([1])", R"([""])", R"({})"}) {
    INFO(bad);
    const std::string dir = test::temp_dir("bad_target_parameters");
    files::write_atomic(dir + "/adapter_config.json",
                        fmt::format(R"({{"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                       "target_modules": ["q_proj"], "target_parameters": {}}})",
                                    bad));
    CHECK_THROWS_MATCHES(load_adapter_config(dir), ConfigError,
                         test::Has({"adapter_config.json", "target_parameters"}));
  }
}

TEST_CASE("target_parameters with a layer in the name adapt that layer's experts only",
          "[model][moe][peft]") {
  // OpenAI's gpt-oss LoRA recipe names layers: "7.mlp.experts.gate_up_proj". A name matches as
  // a dotted suffix of the tensor's path, as PEFT matches it.
  auto model = family_model("qwen3_moe");  // sparse layers 0 and 2
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora.r = 2;
  c.lora.target_modules = {"q_proj"};
  c.lora.target_parameters = {"2.mlp.experts.down_proj"};
  apply_peft(*model, c, 3);
  const auto params = model->named_parameters();
  CHECK(params.contains("model.layers.2.mlp.experts.lora_A.weight"));
  CHECK_FALSE(params.contains("model.layers.0.mlp.experts.lora_A.weight"));
  CHECK_FALSE(params.contains("model.layers.2.mlp.experts.base_layer.lora_A.weight"));
  // "12.mlp..." is not layer 2's: components match whole.
  c.lora.target_parameters = {"12.mlp.experts.down_proj"};
  CHECK_THROWS_AS(apply_peft(*family_model("qwen3_moe"), c, 3), ConfigError);
}

namespace {

LoraOptions lora_on(std::vector<std::string> targets, int64_t r = 4, double alpha = 8) {
  LoraOptions o;
  o.r = r;
  o.alpha = alpha;
  o.target_modules = std::move(targets);
  return o;
}

std::vector<std::string> sorted_names(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

// PEFT 0.21 on transformers 5 (convert_peft_config_for_transformers): the 4.x names of a
// mixture's per-expert projections and router become target_parameters of the fused tensors.
TEST_CASE("LoRA targets naming the experts' 4.x projections adapt the fused tensors, as PEFT 0.21",
          "[model][moe][peft]") {
  auto qwen = family_model("qwen3_moe");  // its layer 1 dense (mlp_only_layers)
  SECTION(
      "gate_proj, up_proj and down_proj: the fused tensors, gate_up_proj at rank and alpha 2x") {
    const LoraOptions o = peft::converted_for_fused_experts(
        *qwen, lora_on({"q_proj", "gate_proj", "up_proj", "down_proj"}));
    CHECK(o.target_modules == std::vector<std::string>{"q_proj"});
    CHECK(sorted_names(o.target_parameters) ==
          std::vector<std::string>{"down_proj", "gate_up_proj"});
    REQUIRE(o.rank_pattern.size() == 1);
    CHECK(o.at("model.layers.0.mlp.experts.gate_up_proj").r == 8);
    CHECK(o.at("model.layers.0.mlp.experts.gate_up_proj").alpha == 16);
    CHECK(o.at("model.layers.0.mlp.experts.down_proj").r == 4);
    CHECK(o.at("model.layers.0.self_attn.q_proj").alpha == 8);
    // Idempotent: what PEFT reads back from the adapter_config.json it wrote.
    const LoraOptions again = peft::converted_for_fused_experts(*qwen, o);
    CHECK(again.target_modules == o.target_modules);
    CHECK(again.target_parameters == o.target_parameters);
    CHECK(again.rank_pattern == o.rank_pattern);
  }
  SECTION("a dotted name is converted too; one half of gate_up_proj alone is refused") {
    const LoraOptions o = peft::converted_for_fused_experts(*qwen, lora_on({"mlp.down_proj"}));
    CHECK(o.target_modules.empty());
    CHECK(o.target_parameters == std::vector<std::string>{"down_proj"});
    CHECK(o.rank_pattern.empty());
    CHECK_THROWS_WITH(peft::converted_for_fused_experts(*qwen, lora_on({"gate_proj"})),
                      Catch::Contains("up_proj") && Catch::Contains("gate_up_proj"));
  }
  SECTION("all-linear: the attention, the fused experts and the routers") {
    const LoraOptions o = peft::converted_for_fused_experts(*qwen, lora_on({"all-linear"}));
    CHECK(sorted_names(o.target_modules) ==
          std::vector<std::string>{"k_proj", "o_proj", "q_proj", "v_proj"});
    CHECK(sorted_names(o.target_parameters) ==
          std::vector<std::string>{"down_proj", "gate.weight", "gate_up_proj"});
    PeftConfig c;
    c.type = FinetuningType::kLora;
    c.lora = o;
    apply_peft(*qwen, c, 3);
    const auto params = qwen->named_parameters();
    // The router as a projection of rank r; the experts' gate_up_proj at rank 2r per expert;
    // the dense layer's MLP, which PEFT's conversion no longer names, untouched.
    REQUIRE(params.contains("model.layers.0.mlp.gate.lora_A.weight"));
    CHECK(params["model.layers.0.mlp.gate.lora_A.weight"].size(0) == 4);
    const at::Tensor gate_up = params["model.layers.0.mlp.experts.gate_up_proj"];
    CHECK(params["model.layers.0.mlp.experts.base_layer.lora_A.weight"].size(0) ==
          8 * gate_up.size(0));
    CHECK_FALSE(params.contains("model.layers.1.mlp.down_proj.lora_A.weight"));
    CHECK_FALSE(params.contains("model.layers.1.mlp.gate_proj.lora_A.weight"));
    CHECK(params.contains("model.layers.1.self_attn.v_proj.lora_A.weight"));
  }
  SECTION("LLaMA-Factory's all: the linear layers' names, converted, and no more") {
    // Layer 1's dense MLP gives gate_proj / up_proj / down_proj, which become the experts'
    // tensors; the router, no nn.Linear, is not in the list. Mixtral has no dense layer: its
    // list is the attention's, which nothing converts.
    const LoraOptions o = peft::converted_for_fused_experts(*qwen, lora_on({"all"}));
    CHECK(sorted_names(o.target_modules) ==
          std::vector<std::string>{"k_proj", "o_proj", "q_proj", "v_proj"});
    CHECK(sorted_names(o.target_parameters) ==
          std::vector<std::string>{"down_proj", "gate_up_proj"});
    CHECK(o.at("model.layers.0.mlp.experts.gate_up_proj").r == 8);
    auto mixtral = family_model("mixtral");
    const LoraOptions m = peft::converted_for_fused_experts(*mixtral, lora_on({"all"}));
    CHECK(sorted_names(m.target_modules) ==
          std::vector<std::string>{"k_proj", "o_proj", "q_proj", "v_proj"});
    CHECK(m.target_parameters.empty());
  }
  SECTION("a regex is resolved to names first, the experts' old names found by probing") {
    LoraOptions given = lora_on({});
    given.target_regex = R"(.*\.layers\.0\..*(q_proj|gate_proj|up_proj))";
    const LoraOptions o = peft::converted_for_fused_experts(*qwen, given);
    CHECK(o.target_regex.empty());
    CHECK(o.target_modules == std::vector<std::string>{"q_proj"});
    CHECK(o.target_parameters == std::vector<std::string>{"gate_up_proj"});
    CHECK(o.at("x.experts.gate_up_proj").r == 8);
  }
  SECTION("Mixtral's w1 / w3 / w2 and the router; a family without a pattern is left alone") {
    auto mixtral = family_model("mixtral");
    const LoraOptions o =
        peft::converted_for_fused_experts(*mixtral, lora_on({"w1", "w2", "w3", "gate", "o_proj"}));
    CHECK(o.target_modules == std::vector<std::string>{"o_proj"});
    CHECK(sorted_names(o.target_parameters) ==
          std::vector<std::string>{"down_proj", "gate.weight", "gate_up_proj"});
    auto llama = family_model("llama");
    const LoraOptions same =
        peft::converted_for_fused_experts(*llama, lora_on({"gate_proj", "down_proj"}));
    CHECK(same.target_modules == std::vector<std::string>{"gate_proj", "down_proj"});
    CHECK(same.target_parameters.empty());
  }
}

TEST_CASE("A converted LoRA config round-trips: adapter_config.json, its keys, logits and merge",
          "[model][moe][peft]") {
  PeftConfig c;
  c.type = FinetuningType::kLora;
  c.lora = lora_on({"q_proj", "gate", "gate_proj", "up_proj", "down_proj"}, 2, 4);
  auto model = family_model("qwen3_moe");
  const at::Tensor ids = at::randint(3, 128, {2, 10}, at::kLong);
  at::Tensor base_logits;
  {
    at::NoGradGuard no_grad;
    base_logits = model->logits(ids);
  }
  apply_peft(*model, c, 11);
  {
    at::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
    }
  }
  at::NoGradGuard no_grad;
  const at::Tensor adapted = model->logits(ids);
  CHECK(max_abs(adapted, base_logits) > 1e-3);
  const std::string dir = test::temp_dir("converted_adapter");
  save_adapter(*model, c, dir);
  const std::string config = files::read_text(dir + "/adapter_config.json");
  CHECK_THAT(config, Catch::Contains("\"gate_up_proj\"") && Catch::Contains("\"gate.weight\"") &&
                         Catch::Contains(R"(".*\\.gate_up_proj": 4)"));
  // PEFT's config as read back: converted already, the patterns kept.
  const PeftConfig read = load_adapter_config(dir);
  CHECK(read.lora.rank_pattern.size() == 1);
  CHECK(read.lora.target_modules == std::vector<std::string>{"q_proj"});
  SafetensorsFile saved(dir + "/adapter_model.safetensors");
  CHECK(saved.contains("base_model.model.model.layers.0.mlp.gate.lora_B.weight"));
  auto loaded = family_model("qwen3_moe");
  load_adapter(*loaded, dir, /*trainable=*/false);
  CHECK(max_abs(loaded->logits(ids), adapted) < 1e-5);
  merge_lora(*model);
  CHECK(max_abs(model->logits(ids), adapted) < 1e-5);
}

TEST_CASE("rank_pattern / alpha_pattern in adapter_config.json: read, checked, applied by path",
          "[peft]") {
  const std::string dir = test::temp_dir("rank_pattern");
  auto write = [&](const std::string& patterns) {
    files::write_atomic(
        dir + "/adapter_config.json",
        R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"])" +
            patterns + "}");
  };
  write(
      R"(, "rank_pattern": {"layers\\.0\\.self_attn\\.q_proj": 2, "v_proj": 6}, "alpha_pattern": {"v_proj": 3})");
  const PeftConfig c = load_adapter_config(dir);
  CHECK(c.lora.at("model.layers.0.self_attn.q_proj").r == 2);
  CHECK(c.lora.at("model.layers.1.self_attn.q_proj").r == 4);  // the pattern names layer 0
  CHECK(c.lora.at("model.layers.1.self_attn.v_proj").r == 6);
  CHECK(c.lora.at("model.layers.1.self_attn.v_proj").alpha == 3);
  CHECK(c.lora.at("model.layers.1.self_attn.xv_proj").r == 4);  // a whole component only
  auto model = family_model("llama");
  apply_peft(*model, c, 1);
  const auto params = model->named_parameters();
  CHECK(params["model.layers.0.self_attn.q_proj.lora_A.weight"].size(0) == 2);
  CHECK(params["model.layers.1.self_attn.q_proj.lora_A.weight"].size(0) == 4);
  CHECK(params["model.layers.1.self_attn.v_proj.lora_B.weight"].size(1) == 6);
  std::string many = R"(, "rank_pattern": {)";
  for (int i = 0; i < 1025; ++i) many += fmt::format(R"({}"p{}": 2)", i ? ", " : "", i);
  many += "}";
  for (const std::string& bad : std::vector<std::string>{
           many, R"(, "rank_pattern": {"q_proj": 0})", R"(, "rank_pattern": {"q_proj": "2"})",
           R"(, "alpha_pattern": {"(q_proj": 2})", R"(, "rank_pattern": [1])"}) {
    INFO(bad);
    write(bad);
    CHECK_THROWS_AS(load_adapter_config(dir), ConfigError);
  }
}

namespace {

const char* const kGlm4Moe =
    R"({"model_type": "glm4_moe", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 1, "partial_rotary_factor": 0.5, "attention_bias": true,
        "num_nextn_predict_layers": 1})";

// kGlm4Moe with `key` set to `value` (JSON text).
std::string glm_with(const std::string& key, const std::string& value) {
  rapidjson::Document doc;
  doc.Parse(kGlm4Moe);
  rapidjson::Document v(&doc.GetAllocator());
  v.Parse(value.c_str());
  doc.RemoveMember(key.c_str());
  doc.AddMember(rapidjson::Value(key.c_str(), doc.GetAllocator()), v, doc.GetAllocator());
  return json::dump(doc);
}

}  // namespace

TEST_CASE("GLM-4.5's config: groups, dense first layers and shared experts, bad keys refused",
          "[model][moe][config]") {
  using test::Has;
  const model::DecoderSpec d = model::decoder_spec(parse_model_config(kGlm4Moe));
  REQUIRE(d.layers.size() == 3);
  CHECK_FALSE(d.layers[0].moe);
  REQUIRE(d.layers[1].moe);
  const model::MoeSpec& m = *d.layers[1].moe;
  CHECK(m.router == model::MoeSpec::Router::kSigmoidGroups);
  CHECK(m.groups == 4);
  CHECK(m.top_groups == 2);
  CHECK(m.scaling == 2.0);
  CHECK(m.shared_intermediate == 16);
  CHECK(d.layers[1].attention.qkv_bias);
  CHECK_FALSE(d.layers[1].attention.o_bias);
  CHECK(d.rotaries[0].rotary_dim == 4);
  CHECK_FALSE(d.rotaries[0].interleaved);
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("n_group", "3")), ConfigError,
                       Has({"n_group", "do not divide"}));
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("n_group", "8")), ConfigError,
                       Has({"n_group", "groups of two"}));
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("topk_group", "5")), ConfigError,
                       Has({"topk_group"}));
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("num_experts_per_tok", "5")), ConfigError,
                       Has({"num_experts_per_tok", "groups hold only 4"}));
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("first_k_dense_replace", "4")), ConfigError,
                       Has({"first_k_dense_replace"}));
  CHECK_THROWS_MATCHES(parse_model_config(glm_with("routed_scaling_factor", "\"2\"")), ConfigError,
                       Has({"routed_scaling_factor"}));
  // Written back as read, the 4.x names of the counts included.
  const ModelConfig c = parse_model_config(kGlm4Moe);
  const ModelConfig again = parse_model_config(model_config_json(c));
  CHECK(model::decoder_spec(again).layers[2].moe->top_groups == 2);
}

TEST_CASE("GLM-4.5: the correction bias is never trained, and MTP layers are skipped on load",
          "[model][moe]") {
  using test::Has;
  const std::string dir = test::temp_dir("glm4_moe");
  const ModelConfig c = test::write_model_folder(dir + "/base", kGlm4Moe, 5);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*model, *checkpoint_source(dir + "/base"));
  // Full fine-tuning, Freeze of every layer and LoRA saving the router all leave it frozen.
  PeftConfig full;
  full.type = FinetuningType::kFull;
  apply_peft(*model, full, 1);
  auto params = model->named_parameters();
  REQUIRE(params.contains("model.layers.1.mlp.gate.e_score_correction_bias"));
  CHECK_FALSE(params["model.layers.1.mlp.gate.e_score_correction_bias"].requires_grad());
  CHECK(params["model.layers.1.mlp.gate.weight"].requires_grad());
  auto lora = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*lora, *checkpoint_source(dir + "/base"));
  PeftConfig saved;
  saved.type = FinetuningType::kLora;
  saved.lora.target_modules = {"q_proj"};
  saved.lora.modules_to_save = {"gate"};
  apply_peft(*lora, saved, 1);
  params = lora->named_parameters();
  CHECK(params["model.layers.2.mlp.gate.weight"].requires_grad());
  CHECK_FALSE(params["model.layers.2.mlp.gate.e_score_correction_bias"].requires_grad());
  // A checkpoint with the layer past num_hidden_layers that num_nextn_predict_layers names
  // loads; one more layer is a config that does not describe the file.
  SafetensorsCheckpoint base(dir + "/base");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& n : base.names()) {
    at::Tensor t = at::empty(base.info(n).shape, at::kFloat);
    base.read_range(n, 0, t);
    tensors.emplace_back(n, t);
  }
  tensors.emplace_back("model.layers.3.eh_proj.weight", at::zeros({32, 64}));
  const std::string mtp = dir + "/mtp";
  std::filesystem::create_directories(mtp);
  files::write_atomic(mtp + "/config.json", kGlm4Moe);
  save_safetensors(mtp + "/model.safetensors", tensors);
  CausalLM shape(c, at::TensorOptions(), false);
  CHECK_NOTHROW(check_checkpoint(shape, mtp));
  tensors.emplace_back("model.layers.4.eh_proj.weight", at::zeros({32, 64}));
  save_safetensors(mtp + "/model.safetensors", tensors);
  CHECK_THROWS_MATCHES(check_checkpoint(shape, mtp), IoError, Has({"num_hidden_layers"}));
}

// GLM-4.5's router against its definition written out token by token (transformers'
// Glm4MoeTopkRouter): the correction bias decides the choice and not the weights, the groups
// limit the choice, and the weights are renormalized and scaled. The bias is as large as the
// scores, so that a router that ignored it would choose otherwise for many tokens.
TEST_CASE("GLM-4.5's grouped sigmoid routing picks and weighs experts as its definition says",
          "[model][moe]") {
  at::manual_seed(12);
  const int64_t n = 64, experts = 8, groups = 4, per_group = 2;
  model::MoeSpec spec{experts, 3, 8, true, model::Activation::kSilu};
  spec.router = model::MoeSpec::Router::kSigmoidGroups;
  spec.groups = groups;
  spec.top_groups = 2;
  spec.scaling = 2.5;
  const at::Tensor logits = at::randn({n, experts}) * 2.0;
  const at::Tensor bias = at::randn({experts});
  const model::Routing r = model::route_sigmoid_groups(logits, bias, spec);
  const auto l = logits.accessor<float, 2>();
  const auto b = bias.accessor<float, 1>();
  int differs_without_bias = 0;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> score(experts), choice(experts);
    for (int64_t e = 0; e < experts; ++e) {
      score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[t][e])));
      choice[e] = score[e] + b[e];
    }
    // Groups ranked by the sum of their two best (here: both), the best two kept.
    std::vector<std::pair<double, int64_t>> ranked;
    for (int64_t g = 0; g < groups; ++g)
      ranked.emplace_back(choice[g * per_group] + choice[g * per_group + 1], g);
    std::sort(ranked.rbegin(), ranked.rend());
    std::vector<std::pair<double, int64_t>> candidates;
    for (int64_t k = 0; k < 2; ++k) {
      for (int64_t j = 0; j < per_group; ++j) {
        const int64_t e = ranked[static_cast<size_t>(k)].second * per_group + j;
        candidates.emplace_back(choice[e], e);
      }
    }
    std::sort(candidates.rbegin(), candidates.rend());
    std::set<int64_t> want;
    double sum = 0;
    for (int64_t k = 0; k < 3; ++k) {
      want.insert(candidates[static_cast<size_t>(k)].second);
      sum += score[candidates[static_cast<size_t>(k)].second];
    }
    std::set<int64_t> got;
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t e = r.experts[t][k].item<int64_t>();
      got.insert(e);
      CHECK(r.weights[t][k].item<double>() == Approx(score[e] / (sum + 1e-20) * 2.5).epsilon(1e-5));
    }
    CHECK(got == want);
    // What the choice would be by the scores alone.
    std::vector<std::pair<double, int64_t>> plain;
    for (int64_t e = 0; e < experts; ++e) plain.emplace_back(score[e], e);
    std::sort(plain.rbegin(), plain.rend());
    std::set<int64_t> unbiased{plain[0].second, plain[1].second, plain[2].second};
    differs_without_bias += unbiased != want;
  }
  CHECK(differs_without_bias > n / 4);  // the test can tell a router that ignores the bias
}

// gpt-oss's activation against its definition, with values past the clamp (the transformers
// fixture's activations stay far inside ±7, so only this tells a missing clamp).
TEST_CASE("gpt-oss's clamped SwiGLU: interleaved gate and up, clamped, (up + 1) · g · σ(αg)",
          "[model][moe]") {
  model::MoeSpec spec{4, 2, 3, true, model::Activation::kSilu};
  spec.clamped_swiglu = true;
  const at::Tensor x =
      at::tensor({-9.0, 8.0, 3.0, -12.0, 10.0, 0.5, 0.0, 7.5, -2.0, 1.0, 12.0, -0.5}, at::kFloat)
          .view({2, 6});
  const at::Tensor y = model::clamped_swiglu_interleaved(x, spec);
  REQUIRE(y.sizes() == at::IntArrayRef({2, 3}));
  const auto v = x.accessor<float, 2>();
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t j = 0; j < 3; ++j) {
      const double g = std::min(static_cast<double>(v[r][2 * j]), 7.0);
      const double u = std::clamp(static_cast<double>(v[r][2 * j + 1]), -7.0, 7.0);
      const double want = (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
      CHECK(y[r][j].item<double>() == Approx(want).epsilon(1e-5));
    }
  }
}

namespace {

// An FP4 E2M1 code by its definition (OCP Microscaling formats): sign bit 3, a 2-bit exponent
// with bias 1 (0: subnormal, 0.5 · m), a 1-bit mantissa.
double e2m1(int code) {
  const int exponent = (code >> 1) & 3, mantissa = code & 1;
  const double magnitude =
      exponent == 0 ? 0.5 * mantissa : std::ldexp(1.0 + 0.5 * mantissa, exponent - 1);
  return (code & 8) ? -magnitude : magnitude;
}

// The dequantized [E, in, out] experts' tensor of `blocks` [E, out, G, 16] and `scales` [E, out,
// G], element by element: element (e, i, o) is the (i mod 32)-th code of group i / 32 of row o,
// the low nibble of a byte first, times 2^(scale − 127).
at::Tensor mxfp4_by_definition(const at::Tensor& blocks, const at::Tensor& scales) {
  const int64_t experts = blocks.size(0), rows = blocks.size(1), groups = blocks.size(2);
  at::Tensor out = at::empty({experts, groups * 32, rows}, at::kDouble);
  auto b = blocks.accessor<uint8_t, 4>();
  auto s = scales.accessor<uint8_t, 3>();
  auto o = out.accessor<double, 3>();
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = 0; i < groups * 32; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t byte = b[e][r][i / 32][(i % 32) / 2];
        const int code = i % 2 == 0 ? byte & 0x0F : byte >> 4;
        o[e][i][r] = std::ldexp(e2m1(code), static_cast<int>(s[e][r][i / 32]) - 127);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("gpt-oss as released: MXFP4 experts read as transformers dequantizes them",
          "[model][moe]") {
  // Every byte under exponents from the smallest to the largest finite one, against the
  // definition of E2M1 and E8M0.
  {
    at::Tensor blocks = at::arange(256, at::kInt).to(at::kByte).view({1, 16, 16});
    at::Tensor scales =
        at::tensor({0, 1, 100, 126, 127, 128, 140, 200, 254, 120, 121, 122, 123, 124, 125, 129},
                   at::kInt)
            .to(at::kByte)
            .view({1, 16});
    const at::Tensor got =
        model::dequantize_mxfp4(blocks.view({1, 16, 1, 16}), scales.view({1, 16, 1}));
    const at::Tensor want =
        mxfp4_by_definition(blocks.view({1, 16, 1, 16}), scales.view({1, 16, 1}));
    // In fp32, as transformers' bf16: 6 · 2^127 overflows to infinity in both.
    CHECK(at::equal(got.view({16, 32}).t(), want.view({32, 16}).to(at::kFloat)));
  }
  // A gpt-oss folder as released: config.json with quantization_config mxfp4, the experts as
  // _blocks / _scales, everything else as the fixture has it.
  const std::string from = fixture("models/gpt_oss");
  const std::string dir = test::temp_dir("mxfp4");
  rapidjson::Document config;
  config.Parse(files::read_text(from + "/config.json").c_str());
  rapidjson::Document q(&config.GetAllocator());
  q.Parse(R"({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
      "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})");
  config.AddMember("quantization_config", q, config.GetAllocator());
  files::write_atomic(dir + "/config.json", json::dump(config));
  SafetensorsFile dense(from + "/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, at::Tensor> want;
  at::manual_seed(3);
  for (const std::string& name : dense.names()) {
    auto ends = [&](const std::string& tail) {
      return name.size() >= tail.size() &&
             name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    const bool experts = ends(".experts.gate_up_proj") || ends(".experts.down_proj");
    if (!experts) {
      tensors.emplace_back(name, dense.load(name));
      continue;
    }
    const std::vector<int64_t> shape = dense.info(name).shape;  // [E, in, out]
    const at::Tensor blocks =
        at::randint(0, 256, {shape[0], shape[2], shape[1] / 32, 16}, at::kInt).to(at::kByte);
    const at::Tensor scales =
        at::randint(118, 130, {shape[0], shape[2], shape[1] / 32}, at::kInt).to(at::kByte);
    tensors.emplace_back(name + "_blocks", blocks);
    tensors.emplace_back(name + "_scales", scales);
    want[name] = mxfp4_by_definition(blocks, scales);
  }
  REQUIRE(want.size() == 4);  // two layers' gate_up_proj and down_proj
  save_safetensors(dir + "/model.safetensors", tensors);

  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*model, *checkpoint_source(dir));
  CHECK_NOTHROW(check_checkpoint(*model, dir));
  const auto params = model->named_parameters();
  for (const auto& [name, values] : want) {
    INFO(name);
    CHECK(at::equal(params[name].to(at::kDouble), values));
  }
  // A slice that starts inside one expert and ends inside the next (ZeRO-3 reads slices).
  {
    const std::string name = want.begin()->first;
    const at::Tensor& whole = want.begin()->second;
    const int64_t per_expert = whole.size(1) * whole.size(2);
    at::Tensor slice = at::empty({per_expert}, at::kFloat);
    checkpoint_source(dir)->read(name, whole.sizes().vec(), per_expert / 2, slice);
    CHECK(at::equal(slice.to(at::kDouble), whole.view({-1}).narrow(0, per_expert / 2, per_expert)));
  }
  // The model is the full-precision one with those experts: the same logits.
  {
    auto reference = family_model("gpt_oss");
    at::NoGradGuard no_grad;
    for (auto& p : reference->named_parameters()) {
      if (want.count(p.key()) != 0) p.value().copy_(want[p.key()]);
    }
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
    CHECK(at::equal(model->logits(ids), reference->logits(ids)));
  }
  // Written back as floating-point weights: no quantization_config.
  CHECK_THAT(model_config_json(c), !Catch::Contains("quantization_config"));

  // Bad input, by class: a part missing, a part of another dtype or shape, another method.
  auto damaged =
      [&](const std::string& tag,
          const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
        const std::string d = test::temp_dir(tag);
        files::write_atomic(d + "/config.json", json::dump(config));
        std::vector<std::pair<std::string, at::Tensor>> t = tensors;
        edit(t);
        save_safetensors(d + "/model.safetensors", t);
        ModelConfig dc = load_model_config(d);
        auto m = std::make_shared<CausalLM>(dc, at::TensorOptions(), false);
        std::string message;
        try {
          load_weights(*m, *checkpoint_source(d));
        } catch (const IoError& e) {
          message = e.what();
        }
        return message;
      };
  const std::string first = want.begin()->first;
  CHECK_THAT(
      damaged("mxfp4_missing",
              [&](auto& t) {
                t.erase(std::remove_if(t.begin(), t.end(),
                                       [&](const auto& x) { return x.first == first + "_scales"; }),
                        t.end());
              }),
      Catch::Contains(first + "_scales") && Catch::Contains("lacks"));
  CHECK_THAT(damaged("mxfp4_dtype",
                     [&](auto& t) {
                       for (auto& x : t)
                         if (x.first == first + "_blocks") x.second = x.second.to(at::kFloat);
                     }),
             Catch::Contains(first + "_blocks") && Catch::Contains("U8"));
  CHECK_THAT(damaged("mxfp4_shape",
                     [&](auto& t) {
                       for (auto& x : t)
                         if (x.first == first + "_scales")
                           x.second = x.second.narrow(1, 0, 1).contiguous();
                     }),
             Catch::Contains(first + "_scales") && Catch::Contains("shape"));
  // E8M0's NaN (255) whatever the codes, and 254 with codes of 6 (past fp32's range).
  for (const std::pair<int, int>& bad :
       {std::pair{255, 0x77}, std::pair{254, 0x77}, std::pair{255, 0x00}}) {
    const int scale = bad.first, code = bad.second;
    INFO("scale " << scale << " codes " << code);
    CHECK_THAT(damaged("mxfp4_range",
                       [&](auto& t) {
                         for (auto& x : t) {
                           if (x.first == first + "_scales") {
                             x.second = x.second.clone();
                             x.second.view({-1})[3] = scale;
                           }
                           if (x.first == first + "_blocks") {  // that group's codes
                             x.second = x.second.clone();
                             x.second.view({-1, 16})[3].fill_(code);
                           }
                         }
                       }),
               Catch::Contains(first + "_scales") && Catch::Contains("out of range"));
  }
  rapidjson::Document other;
  other.CopyFrom(config, other.GetAllocator());
  other["quantization_config"]["quant_method"].SetString("fp8");
  CHECK_THROWS_WITH(parse_model_config(json::dump(other)),
                    Catch::Contains("quant_method") && Catch::Contains("fp8"));
}

TEST_CASE("a gpt-oss MXFP4 folder made by transformers gives its dequantized experts and logits",
          "[model][moe][parity]") {
  // transformers 5.17 loaded this folder with Mxfp4Config(dequantize=True), as LLaMA-Factory and
  // TRL load gpt-oss for training; expected.safetensors holds the experts it made and its logits.
  const std::string dir = fixture("models/gpt_oss_mxfp4");
  ModelConfig c = load_model_config(dir);
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions(), false);
  load_weights(*model, *checkpoint_source(dir));
  SafetensorsFile expected(dir + "/expected.safetensors");
  const auto params = model->named_parameters();
  int experts = 0;
  for (const std::string& name : expected.names()) {
    if (!params.contains(name)) continue;
    INFO(name);
    CHECK(at::equal(params[name], expected.load(name)));
    ++experts;
  }
  CHECK(experts == 4);  // two layers' gate_up_proj and down_proj
  const at::Tensor mask = expected.load("attention_mask");
  const at::Tensor logits = model->logits(expected.load("input_ids"), mask);
  CHECK(max_abs_real(logits, expected.load("logits"), mask) < 2e-5);
}

namespace {

// `from`'s model folder with its experts' tensors stored as gpt-oss's are released: random
// MXFP4 blocks and scales, quantization_config mxfp4 in config.json.
void write_as_mxfp4(const std::string& from, const std::string& to, uint64_t seed) {
  fs::create_directories(to);
  rapidjson::Document config;
  config.Parse(files::read_text(from + "/config.json").c_str());
  rapidjson::Document q(&config.GetAllocator());
  q.Parse(R"({"quant_method": "mxfp4"})");
  config.AddMember("quantization_config", q, config.GetAllocator());
  files::write_atomic(to + "/config.json", json::dump(config));
  SafetensorsCheckpoint dense(from);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (const std::string& name : dense.names()) {
    const bool experts =
        name.find(".experts.") != std::string::npos && name.find("_bias") == std::string::npos;
    if (!experts) {
      tensors.emplace_back(name, dense.load(name));
      continue;
    }
    const std::vector<int64_t> shape = dense.info(name).shape;  // [E, in, out]
    tensors.emplace_back(name + "_blocks",
                         at::randint(0, 256, {shape[0], shape[2], shape[1] / 32, 16}, gen,
                                     at::TensorOptions().dtype(at::kInt))
                             .to(at::kByte));
    tensors.emplace_back(name + "_scales",
                         at::randint(120, 127, {shape[0], shape[2], shape[1] / 32}, gen,
                                     at::TensorOptions().dtype(at::kInt))
                             .to(at::kByte));
  }
  save_safetensors(to + "/model.safetensors", tensors);
}

}  // namespace

TEST_CASE("LoRA on gpt-oss's MXFP4 experts trains, also over a 4-bit base, and merges",
          "[model][moe][peft][trainer]") {
  // The seams of the released format: LoRA on the dequantized experts (and the attention),
  // plain and with 4-bit projections; `zerotrain merge` writes floating-point experts and a
  // config.json without quantization_config that reads back as the adapted model.
  for (const bool four_bit : {false, true}) {
    INFO("quantization_bit 4: " << four_bit);
    const std::string dir = test::temp_dir(four_bit ? "mxfp4_qlora" : "mxfp4_lora");
    test::write_data(dir, "train.jsonl", 16, 9);
    rapidjson::Document config;
    config.Parse(files::read_text(fixture("models/gpt_oss/config.json")).c_str());
    config["vocab_size"].SetInt(300);
    test::write_model_folder(dir + "/dense", json::dump(config), 31);
    write_as_mxfp4(dir + "/dense", dir + "/base", 32);
    std::vector<std::string> run{"--max_steps",
                                 "3",
                                 "--save_steps",
                                 "3",
                                 "--finetuning_type",
                                 "lora",
                                 "--lora_r",
                                 "4",
                                 "--lora_target",
                                 "q_proj",
                                 "--lora_target_parameters",
                                 "experts.gate_up_proj,experts.down_proj"};
    if (four_bit) run.insert(run.end(), {"--quantization_bit", "4"});
    const std::vector<double> losses = test::train_on_base(dir, run);
    REQUIRE(losses.size() == 3);
    for (double l : losses) CHECK(std::isfinite(l));
    const MergedRun merged = merge_run(dir, load_model_config(dir + "/base"));
    const std::string merged_config = files::read_text(dir + "/merged/config.json");
    CHECK(merged_config.find("quantization_config") == std::string::npos);
    SafetensorsCheckpoint merged_file(dir + "/merged");
    CHECK(merged_file.contains("model.layers.0.mlp.experts.gate_up_proj"));
    CHECK_FALSE(merged_file.contains("model.layers.0.mlp.experts.gate_up_proj_blocks"));
    at::NoGradGuard no_grad;
    const auto merged_params = merged.merged->named_parameters(),
               plain_params = merged.plain->named_parameters();
    for (const char* name :
         {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}) {
      INFO(name);
      CHECK(max_abs(merged_params[name], plain_params[name]) > 0);  // the adapter folded in
    }
    if (four_bit) continue;  // merged into the dequantized 4-bit projections, as PEFT merges
    const at::Tensor ids = at::randint(3, 250, {2, 12}, at::kLong);
    const at::Tensor want = merged.with_adapter->logits(ids);
    CHECK(max_abs(merged.merged->logits(ids), want) < 1e-4);
    CHECK(max_abs(merged.plain->logits(ids), want) > 1e-4);
  }
}
