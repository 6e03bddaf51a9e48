// The prompt-learning adapters: PEFT's PromptEncoder (P-Tuning, MLP or LSTM), PrefixEncoder
// (prefix tuning, with or without projection), and a fixed prompt table (a loaded PEFT adapter).
// Submodule and parameter names follow PEFT's (embedding, mlp_head.N, lstm_head, transform.N).
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/rnn.h>

#include "model/family.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

namespace zt::peft {

/// P-Tuning: virtual token embeddings [n, hidden] = mlp_head(embedding) or
/// mlp_head(lstm_head(embedding)).
class PTuningEncoder final : public PromptAdapter {
 public:
  PTuningEncoder(const ModelConfig& model, const PromptOptions& options);
  int64_t num_virtual_tokens() const override { return n_; }
  bool prepends_tokens() const override { return true; }
  at::Tensor virtual_embeddings() override;
  std::vector<std::pair<at::Tensor, at::Tensor>> layer_prefixes() override { return {}; }

 private:
  int64_t n_;
  bool lstm_;
  torch::nn::Embedding embedding{nullptr};
  torch::nn::LSTM lstm_head{nullptr};
  torch::nn::Sequential mlp_head{nullptr};
};

/// Prefix tuning: per-layer key/value prefixes from embedding [n, layers·2·kv_dim], or from a
/// projection transform(embedding [n, kv_dim]) — PEFT's PrefixEncoder. A family with its own
/// (model::PrefixTuning: ChatGLM2/3's PrefixEncoder) changes the embedding's width, the
/// projection's name and the dropout in training, as its code does.
class PrefixEncoder final : public PromptAdapter {
 public:
  PrefixEncoder(const ModelConfig& model, const PromptOptions& options);
  /// Whether this is the model's own encoder (ChatGLM's), whose parameters save_adapter also
  /// writes under the model's names (transformer.prefix_encoder.*).
  bool chatglm() const { return style_.model_own; }
  int64_t num_virtual_tokens() const override { return n_; }
  bool prepends_tokens() const override { return false; }
  at::Tensor virtual_embeddings() override { return {}; }
  std::vector<std::pair<at::Tensor, at::Tensor>> layer_prefixes() override;
  /// The encoder's output [n, layers·2·kv_dim] (what PEFT saves as prompt_embeddings).
  at::Tensor encode();

 private:
  ModelConfig model_;
  int64_t n_;
  bool projection_;
  model::PrefixTuning style_;
  torch::nn::Embedding embedding{nullptr};
  torch::nn::Sequential transform{nullptr};
};

/// A fixed table of prompt embeddings, as PEFT uses a loaded P-Tuning or prefix adapter:
/// P-Tuning rows are virtual token embeddings; prefix rows are split into per-layer prefixes.
class FixedPrompt final : public PromptAdapter {
 public:
  FixedPrompt(const ModelConfig& model, at::Tensor table, bool prefix);
  int64_t num_virtual_tokens() const override { return table_.size(0); }
  bool prepends_tokens() const override { return !prefix_; }
  at::Tensor virtual_embeddings() override { return prefix_ ? at::Tensor() : table_; }
  std::vector<std::pair<at::Tensor, at::Tensor>> layer_prefixes() override;

 private:
  ModelConfig model_;
  at::Tensor table_;
  bool prefix_;
};

/// Splits a prefix table [n, layers·2·kv_dim] into per-layer (key, value) [kv_heads, n, head_dim],
/// PEFT's layout: index 2·layer is the key, 2·layer + 1 the value.
std::vector<std::pair<at::Tensor, at::Tensor>> split_prefixes(const ModelConfig& model,
                                                              const at::Tensor& table);

}  // namespace zt::peft
