// libFuzzer: JSON configs — a model's config.json, a DeepSpeed config (resolved against
// training arguments), training options (as JSON and as YAML) — through the parsers the CLI and
// the C API use.
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zt::fuzz::scratch();
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    zt::ModelConfig c = zt::parse_model_config(text);
    (void)zt::model_config_json(c);
  } catch (const zt::Error&) {
  }
  try {
    zt::DeepSpeedConfig ds = zt::parse_deepspeed_config(text);
    zt::TrainingArguments args;
    zt::resolve_config(ds, args, zt::ResolveContext{2, int64_t{4096}, int64_t{100}});
    (void)zt::deepspeed_config_json(ds);
  } catch (const zt::Error&) {
  }
  try {
    zt::TrainingArguments args;
    zt::apply_training_json(args, text);
    (void)zt::training_arguments_json(args);
  } catch (const zt::Error&) {
  }
  try {  // the same options as YAML (LLaMA-Factory's configs), through yaml-cpp
    zt::TrainingArguments args;
    zt::apply_training_yaml(args, text);
    (void)zt::training_arguments_json(args);
  } catch (const zt::Error&) {
  }
  return 0;
}
