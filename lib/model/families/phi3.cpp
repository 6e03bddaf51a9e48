// Phi-3 and Phi-4 (Phi3ForCausalLM): the shared decoder with q, k and v as one `qkv_proj` (query
// heads, then the key and the value groups), gate and up as one `gate_up_proj` (gate first),
// RoPE in halves on part of each head (partial_rotary_factor: Phi-4-mini's 0.75), an optional
// sliding window, and no biases. LongRoPE (Phi-3-*-128k, Phi-4-mini) is RoPE's (layers.cpp).
#include <fmt/format.h>

#include "model/families/decoder.hpp"
#include "model/family.hpp"

namespace zt::model {
namespace {

void read(json::ObjectReader& r, ModelConfig& c) {
  c.rms_norm_eps = 1e-5;  // Phi3Config's defaults for keys a config.json leaves out
  c.max_position_embeddings = 4096;
  decoder::read_common(r, c);
  c.fused_gate_up = true;
  decoder::read_partial_rotary(r, c, 1.0);
  decoder::read_sliding_window(r, c);
  // Dropout in training is not built: a released model sets none.
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"}) {
    if (auto p = r.number(key, 0.0); p && *p > 0.0) {
      r.fail_value(key, fmt::format("{}: dropout inside the decoder is not supported; set it to "
                                    "0 (Phi-3 and Phi-4 releases ship 0)",
                                    *p));
    }
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (auto v = r.boolean(key); v && *v) r.fail_value(key, "Phi-3's projections have no biases");
  }
  r.known({"original_max_position_embeddings", "pad_token_id"});
}

void write(rapidjson::Document& doc, const ModelConfig& c) {
  decoder::write_common(doc, c, "Phi3ForCausalLM");
  decoder::Alloc& alloc = doc.GetAllocator();
  decoder::set_member(doc, "partial_rotary_factor", rapidjson::Value(c.partial_rotary_factor),
                      alloc);
  decoder::set_member(doc, "sliding_window", decoder::token_value(c.sliding_window), alloc);
  if (c.rope_scaling.type == "longrope") {  // where 4.x's Phi-3 reads it
    decoder::set_member(
        doc, "original_max_position_embeddings",
        rapidjson::Value(static_cast<int64_t>(c.rope_scaling.original_max_position_embeddings)),
        alloc);
  }
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
    decoder::set_member(doc, key, rapidjson::Value(0.0), alloc);
  decoder::write_token_ids(doc, c);
}

constexpr ModuleNames kNames = [] {
  ModuleNames n;
  n.fused_qkv = "qkv_proj";
  return n;
}();

}  // namespace

extern const Family kPhi3{"phi3", read, write, /*compose=*/nullptr, /*remote_code=*/false, kNames};

}  // namespace zt::model
