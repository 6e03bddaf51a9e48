// zerotrain merge CHECKPOINT OUT [--dtype ..] [--base_model DIR] [--as glm]: a checkpoint's
// shards consolidated into an HF model folder (DeepSpeed's zero_to_fp32.py job, LoRA folded in).
#include <cstdio>

#include "commands.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"

namespace zt::cli {

namespace {

constexpr const char* kUsage =
    "usage: zerotrain merge FOLDER OUT [--dtype bf16|fp16|fp32] [--base_model DIR] [--as glm]\n\n"
    "Consolidates FOLDER into an HF model folder OUT (which must not exist or be empty). FOLDER is "
    "a\n"
    "checkpoint-<step> folder (its sharded fp32 masters) or a run's output_dir (its adapter or "
    "model).\n"
    "LoRA adapters are folded into their base model's weights.\n"
    "  --dtype D          the output dtype [default: the model's own]\n"
    "  --base_model DIR   the base model folder [default: the adapter's base_model_name_or_path]\n"
    "  --as LAYOUT        chatglm models only: glm writes transformers' glm layout\n"
    "                     (GlmForCausalLM) [default: the model's own layout]\n";

}  // namespace

int cmd_merge(const Args& in) {
  if (wants_help(in)) {
    std::printf("%s", kUsage);
    return 0;
  }
  Args args = in;
  MergeOptions options;
  if (auto base = take_option(args, "base_model")) options.base_model = *base;
  if (auto dtype = take_option(args, "dtype")) {
    if (*dtype == "bf16" || *dtype == "bfloat16") {
      options.dtype = at::kBFloat16;
    } else if (*dtype == "fp16" || *dtype == "float16") {
      options.dtype = at::kHalf;
    } else if (*dtype == "fp32" || *dtype == "float32") {
      options.dtype = at::kFloat;
    } else {
      throw ConfigError("--dtype: expected bf16, fp16 or fp32, found \"" + *dtype + "\"");
    }
  }
  if (auto layout = take_option(args, "as")) {
    if (*layout != "glm" && *layout != "own") {
      throw ConfigError("--as: expected glm (or own, the model's layout), found \"" + *layout +
                        "\"");
    }
    options.as_glm = *layout == "glm";
  }
  if (args.size() != 2 || args[0].rfind("--", 0) == 0 || args[1].rfind("--", 0) == 0) {
    throw ConfigError(
        "usage: zerotrain merge FOLDER OUT [--dtype bf16|fp16|fp32] [--base_model DIR] [--as "
        "glm]");
  }
  MergeReport report = merge_checkpoint(args[0], args[1], options);
  std::printf("merged %lld tensors into %s (%zu files)\n", static_cast<long long>(report.tensors),
              args[1].c_str(), report.files.size());
  return 0;
}

}  // namespace zt::cli
