// Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention (no biases, an optional
// sliding window) with a sparse mixture of num_local_experts experts of intermediate_size in
// every layer's MLP place; each token takes its num_experts_per_tok experts by softmax score,
// renormalized. transformers 5 names the block `mlp` (4.x: `block_sparse_moe`, whose files
// model/weights.cpp reads).
#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/families/decoder.hpp"
#include "model/families/moe.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.rope_theta = 1'000'000.0;  // MixtralConfig's defaults for keys a config.json leaves out
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 131072;
  decoder::read_common(r, c);
  decoder::read_sliding_window(r, c);
  auto s = moe::read(r, c, "num_local_experts", "num_experts", 8, 2, c.intermediate_size);
  s->spec.normalize_top_k = true;
  // Noise on the router's input in training draws random numbers transformers' run and ours
  // cannot share; none of the released configs sets it.
  if (auto v = r.number("router_jitter_noise", 0.0); v && *v > 0.0) {
    r.fail_value("router_jitter_noise",
                 "noise on the router's input is not supported; set it to 0 (the released "
                 "Mixtral configs do)");
  }
  r.known({"attention_dropout"});
  c.family_settings = std::move(s);
}

DecoderSpec compose(const ModelConfig& c) {
  DecoderSpec d = shared_decoder(c);
  moe::compose(moe::settings_of(c), d);
  return d;
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  const moe::Settings& s = moe::settings_of(c);
  decoder::write_common(doc, c, "MixtralForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "sliding_window", decoder::token_value(c.sliding_window), alloc);
  decoder::set_member(doc, "num_local_experts", rapidjson::Value(s.spec.experts), alloc);
  decoder::set_member(doc, "router_jitter_noise", rapidjson::Value(0.0), alloc);
  moe::write(doc, s);
  decoder::write_token_ids(doc, c);
}

}  // namespace

extern const Family kMixtral{"mixtral", read, write, compose};

}  // namespace zt::model
