// What the mixture-of-experts families (qwen3_moe.cpp, mixtral.cpp) read and write the same
// way: the experts' count, how many each token takes, their width, the router's options, and
// which layers are sparse.
#pragma once

#include <vector>

#include <rapidjson/document.h>

#include "model/blocks.hpp"
#include "model/family.hpp"
#include "util/json.hpp"

namespace zt::model::moe {

/// A mixture-of-experts config's own members (ModelConfig::family_settings).
struct Settings : FamilySettings {
  MoeSpec spec;
  std::vector<bool> sparse;  ///< per layer: a mixture of experts in the MLP's place
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;  ///< the load-balancing loss is added in training
  // Qwen3-MoE's choice of sparse layers, as read (written back).
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  // GLM-4.5's: its dense first layers, shared experts, q/k norms, and the multi-token-prediction
  // layers its checkpoints hold past num_hidden_layers (not part of the model, not loaded).
  int64_t first_dense = 0, shared_experts = 0, extra_layers = 0;
  bool qk_norm = false;
  /// Whether transformers computes the load-balancing loss for the family (not GLM-4.5).
  bool balance_loss = true;
  // gpt-oss's sliding-window layers (per layer) and their window.
  std::vector<bool> sliding;
  int64_t window = 128;
};

/// The settings of `c` (defaults for a config not read by a mixture-of-experts family).
const Settings& settings_of(const ModelConfig& c);

/// The experts' members: the count (`experts_key`, or transformers' alias of it, default
/// `experts`), num_experts_per_tok (default `top_k`, at most the count), each expert's
/// `intermediate` width, output_router_logits and router_aux_loss_coef (a number ≥ 0); experts
/// whose parameters overflow the library's counts are refused naming the count's key. Every layer
/// is sparse; the caller changes that.
std::shared_ptr<Settings> read(json::ObjectReader& r, const ModelConfig& c, const char* experts_key,
                               const char* alias, int64_t experts, int64_t top_k,
                               int64_t intermediate);

/// `c` with its load-balancing loss on at `coefficient` (LLaMA-Factory's moe_aux_loss_coef:
/// output_router_logits and router_aux_loss_coef). False for a model without a mixture of
/// experts or whose family has no such loss (GLM-4.5), left as it was.
bool set_router_aux(ModelConfig& c, double coefficient);

/// Puts the mixture on the sparse layers of `d`, and the load-balancing loss's coefficient
/// where output_router_logits asks for it.
void compose(const Settings& s, DecoderSpec& d);

/// Writes num_experts_per_tok, output_router_logits and router_aux_loss_coef.
void write(rapidjson::Document& doc, const Settings& s);

}  // namespace zt::model::moe
