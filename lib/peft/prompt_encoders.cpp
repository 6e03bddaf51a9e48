// Prompt-learning adapters.
#include "peft/prompt_encoders.hpp"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

namespace zt::peft {

PTuningEncoder::PTuningEncoder(const ModelConfig& model, const PromptOptions& o)
    : n_(o.num_virtual_tokens), lstm_(o.reparameterization == "LSTM") {
  const int64_t dim = model.hidden_size;
  const int64_t hidden = o.encoder_hidden_size > 0 ? o.encoder_hidden_size : dim;
  embedding = register_module("embedding", torch::nn::Embedding(n_, dim));
  if (lstm_) {
    lstm_head = register_module("lstm_head", torch::nn::LSTM(torch::nn::LSTMOptions(dim, hidden)
                                                                 .num_layers(o.encoder_num_layers)
                                                                 .bidirectional(true)
                                                                 .batch_first(true)));
    mlp_head = register_module(
        "mlp_head", torch::nn::Sequential(torch::nn::Linear(2 * hidden, 2 * hidden),
                                          torch::nn::ReLU(), torch::nn::Linear(2 * hidden, dim)));
  } else {
    mlp_head = register_module(
        "mlp_head", torch::nn::Sequential(torch::nn::Linear(dim, hidden), torch::nn::ReLU(),
                                          torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                          torch::nn::Linear(hidden, dim)));
  }
}

at::Tensor PTuningEncoder::virtual_embeddings() {
  at::Tensor idx =
      at::arange(n_, at::TensorOptions().dtype(at::kLong).device(embedding->weight.device()));
  at::Tensor e = embedding->forward(idx).unsqueeze(0);
  if (lstm_) e = std::get<0>(lstm_head->forward(e));
  return mlp_head->forward(e).squeeze(0);
}

PrefixEncoder::PrefixEncoder(const ModelConfig& model, const PromptOptions& o)
    : model_(model),
      n_(o.num_virtual_tokens),
      projection_(o.prefix_projection),
      style_(model::family_of(model).prefix) {
  const int64_t kv = model.kv_dim();
  const int64_t out = model.num_hidden_layers * 2 * kv;
  if (projection_) {
    const int64_t hidden = o.encoder_hidden_size > 0 ? o.encoder_hidden_size : model.hidden_size;
    const int64_t in = style_.embed_at_output_width ? out : kv;
    embedding = register_module("embedding", torch::nn::Embedding(n_, in));
    transform =
        register_module(std::string(style_.transform),
                        torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(),
                                              torch::nn::Linear(hidden, out)));
  } else {
    embedding = register_module("embedding", torch::nn::Embedding(n_, out));
  }
}

at::Tensor PrefixEncoder::encode() {
  at::Tensor idx =
      at::arange(n_, at::TensorOptions().dtype(at::kLong).device(embedding->weight.device()));
  at::Tensor e = embedding->forward(idx);
  return projection_ ? transform->forward(e) : e;
}

std::vector<std::pair<at::Tensor, at::Tensor>> PrefixEncoder::layer_prefixes() {
  at::Tensor table = encode();
  if (style_.train_dropout > 0.0 && is_training()) {
    table = at::dropout(table, style_.train_dropout, true);
  }
  return split_prefixes(model_, table);
}

FixedPrompt::FixedPrompt(const ModelConfig& model, at::Tensor table, bool prefix)
    : model_(model), prefix_(prefix) {
  table_ = register_parameter("prompt_embeddings", std::move(table));
}

std::vector<std::pair<at::Tensor, at::Tensor>> FixedPrompt::layer_prefixes() {
  if (!prefix_) return {};
  return split_prefixes(model_, table_);
}

std::vector<std::pair<at::Tensor, at::Tensor>> split_prefixes(const ModelConfig& m,
                                                              const at::Tensor& table) {
  const int64_t n = table.size(0);
  // [n, L·2, kv_heads, head_dim] → [L·2, kv_heads, n, head_dim]
  at::Tensor t = table.view({n, m.num_hidden_layers * 2, m.num_key_value_heads, m.head_dim})
                     .permute({1, 2, 0, 3});
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) out.emplace_back(t[2 * l], t[2 * l + 1]);
  return out;
}

}  // namespace zt::peft
