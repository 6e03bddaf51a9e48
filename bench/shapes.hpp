// Model shapes of the peer baseline (shared/bench/hf_baseline.py), as inline HF configs.
#pragma once

#include <stdexcept>
#include <string>

#include "zerotrain/model.hpp"

namespace zt::bench {

inline ModelConfig shape_config(const std::string& shape) {
  std::string json;
  if (shape == "qwen2.5-7b") {
    json = R"({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
      "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
      "vocab_size": 152064, "tie_word_embeddings": false, "rope_theta": 1000000.0,
      "max_position_embeddings": 32768, "rms_norm_eps": 1e-6})";
  } else if (shape == "qwen2.5-1.5b") {
    json = R"({"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
      "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
      "vocab_size": 151936, "tie_word_embeddings": true, "rope_theta": 1000000.0,
      "max_position_embeddings": 32768, "rms_norm_eps": 1e-6})";
  } else if (shape == "llama2-7b") {
    json = R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
      "vocab_size": 32000, "tie_word_embeddings": false, "rope_theta": 10000.0,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})";
  } else if (shape == "llama2-13b") {
    json = R"({"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
      "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
      "vocab_size": 32000, "tie_word_embeddings": false, "rope_theta": 10000.0,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})";
  } else if (shape == "llama2-70b") {
    json = R"({"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
      "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
      "vocab_size": 32000, "tie_word_embeddings": false, "rope_theta": 10000.0,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})";
  } else if (shape == "llama3-8b") {
    json = R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "vocab_size": 128256, "tie_word_embeddings": false, "rope_theta": 500000.0,
      "max_position_embeddings": 8192, "rms_norm_eps": 1e-5})";
  } else if (shape == "glm-4-9b") {  // THUDM/glm-4-9b-chat-hf
    json = R"({"model_type": "glm", "hidden_size": 4096, "intermediate_size": 13696,
      "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
      "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": true,
      "vocab_size": 151552, "tie_word_embeddings": false, "rope_theta": 10000.0,
      "max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07, "pad_token_id": 151329,
      "eos_token_id": [151329, 151336, 151338]})";
  } else if (shape == "qwen3-8b") {  // the families of [1/7], as the peer's SHAPES has them
    json = R"({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
      "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": false,
      "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6})";
  } else if (shape == "qwen3-14b") {
    json = R"({"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
      "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
      "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": false,
      "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6})";
  } else if (shape == "gemma-2-9b") {
    json = R"({"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
      "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 256, "vocab_size": 256000, "query_pre_attn_scalar": 256,
      "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
      "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
      "hidden_activation": "gelu_pytorch_tanh"})";
  } else if (shape == "gemma-3-12b") {
    json = R"({"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
      "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 256, "vocab_size": 262208, "query_pre_attn_scalar": 256,
      "sliding_window": 1024, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
      "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh"})";
  } else if (shape == "phi-4") {
    json = R"({"model_type": "phi3", "hidden_size": 5120, "intermediate_size": 17920,
      "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
      "vocab_size": 100352, "rope_theta": 250000.0, "max_position_embeddings": 16384,
      "original_max_position_embeddings": 16384, "tie_word_embeddings": false,
      "rms_norm_eps": 1e-5})";
  } else if (shape == "qwen3-30b-a3b") {
    json = R"({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
      "norm_topk_prob": true, "num_hidden_layers": 48, "num_attention_heads": 32,
      "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
      "max_position_embeddings": 40960, "tie_word_embeddings": false, "rms_norm_eps": 1e-6})";
  } else if (shape == "glm-4.5-air") {  // zai-org/GLM-4.5-Air's config.json (106B, 12B active)
    json = R"({"model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
      "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
      "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
      "routed_scaling_factor": 1.0, "norm_topk_prob": true, "num_hidden_layers": 46,
      "num_nextn_predict_layers": 1, "num_attention_heads": 96, "num_key_value_heads": 8,
      "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": true,
      "use_qk_norm": false, "vocab_size": 151552, "rope_theta": 1000000,
      "max_position_embeddings": 131072, "tie_word_embeddings": false, "rms_norm_eps": 1e-5})";
  } else if (shape == "gpt-oss-20b") {  // openai/gpt-oss-20b's config.json, experts dequantized
    json = R"({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
      "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
      "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
      "sliding_window": 128, "attention_bias": true, "swiglu_limit": 7.0,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
      "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": false}, "rope_theta": 150000.0,
      "max_position_embeddings": 131072, "tie_word_embeddings": false, "rms_norm_eps": 1e-5})";
  } else if (shape == "tiny") {  // for smoke tests of the tools  // for smoke tests of the tools
    json = R"({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "vocab_size": 256, "tie_word_embeddings": false, "rms_norm_eps": 1e-6})";
  } else {
    throw std::invalid_argument("unknown shape '" + shape +
                                "' (qwen2.5-7b, qwen2.5-1.5b, llama2-7b, llama2-13b, llama2-70b, "
                                "llama3-8b, glm-4-9b, qwen3-8b, qwen3-14b, gemma-2-9b, "
                                "gemma-3-12b, phi-4, qwen3-30b-a3b, gpt-oss-20b, glm-4.5-air)");
  }
  return parse_model_config(json, shape);
}

}  // namespace zt::bench
