// What Gemma 2 and Gemma 3 share (gemma2.cpp, gemma3.cpp): GeGLU MLPs, (1 + w) norms — four per
// layer and one per head of q and k in Gemma 3 —, embeddings × √hidden, the scores' scale from
// query_pre_attn_scalar, soft-caps, and sliding-window layers among global ones, Gemma 3's with
// a RoPE of their own.
#pragma once

#include <optional>
#include <vector>

#include "model/blocks.hpp"
#include "model/family.hpp"

namespace zt::model::gemma {

/// A Gemma config's own members (ModelConfig::family_settings).
struct Settings : FamilySettings {
  double query_pre_attn_scalar = 256.0;
  std::optional<double> attn_softcap, final_softcap;
  int64_t window = 4096;
  std::vector<bool> sliding;  ///< per layer: attends within `window`
  bool qk_norm = false;       ///< Gemma 3
  /// Gemma 3's sliding layers' RoPE (rope_local_base_freq, or rope_parameters'
  /// sliding_attention block); the global layers' is the config's own.
  double local_theta = 10000.0;
  RopeScaling local_scaling;
};

/// What the family decides for a config read from its file; `gemma3` picks Gemma 3's defaults
/// (no soft-caps, 5 local : 1 global, q/k norms, a local RoPE).
void read(json::ObjectReader& r, ModelConfig& c, bool gemma3);
/// The blocks of a Gemma decoder of `c`.
DecoderSpec compose(const ModelConfig& c);
/// Gemma 3's 5.x rope_parameters: one block per layer type, full_attention (the config's own
/// RoPE) and sliding_attention (the local one), as transformers 5 saves them.
rapidjson::Value rope_parameters(const ModelConfig& c, rapidjson::Document::AllocatorType& alloc);
/// config.json for `c` as transformers saves it (Gemma2ForCausalLM, Gemma3ForCausalLM).
void write(rapidjson::Document& doc, const ModelConfig& c, const char* architecture);

}  // namespace zt::model::gemma
