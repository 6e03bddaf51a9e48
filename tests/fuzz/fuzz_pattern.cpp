// libFuzzer: a user-given target pattern (--lora_target_modules, freeze modules, an adapter
// config's target_modules) compiled and matched against module paths of a real model layout,
// as PEFT's re.fullmatch would — linear time and bounded memory whatever the pattern.
#include <cstdint>
#include <string>

#include "util/pattern.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first line is the pattern, the rest a subject (so matching is fuzzed too).
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t newline = input.find('\n');
  const std::string text = input.substr(0, newline);
  const std::string subject =
      newline == std::string::npos ? "model.layers.0.self_attn.q_proj" : input.substr(newline + 1);
  try {
    zt::Pattern p(text, "fuzz");
    (void)p.full_match(subject);
    (void)p.full_match("model.layers.31.mlp.down_proj");
    (void)p.full_match("transformer.encoder.layers.27.self_attention.query_key_value");
  } catch (const zt::Error&) {
  }
  return 0;
}
