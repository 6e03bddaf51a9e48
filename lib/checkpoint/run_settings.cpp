// A run's recorded settings (run_settings.hpp).
#include "checkpoint/run_settings.hpp"

#include <filesystem>

#include <rapidjson/document.h>

#include "config/quantization.hpp"
#include "peft/pissa.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/config.hpp"

namespace zt::checkpoint {
namespace fs = std::filesystem;

namespace {

bool is_step_folder(const fs::path& folder) {
  return folder.filename().string().rfind("checkpoint-", 0) == 0;
}

}  // namespace

RunSettings run_settings(const std::string& dir) {
  const fs::path folder(dir);
  const bool step = is_step_folder(folder);
  RunSettings out;
  for (const fs::path& path :
       {folder / "training_args.json", folder.parent_path() / "training_args.json"}) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      if (!step) break;  // only a checkpoint-<step> folder looks in the run's folder above it
      continue;
    }
    const std::string source = path.string();
    rapidjson::Document doc = json::parse(files::read_text(source, "run settings"), source);
    if (!doc.IsObject() || !doc.HasMember("training_arguments")) return out;
    json::ObjectReader r(doc["training_arguments"], "training_arguments", source);
    TrainingArguments args;
    args.finetuning_type = "lora";  // quantization_of's rule: a 4-bit base trains adapters
    args.quantization_bit = r.integer("quantization_bit", 0, 64).value_or(0);
    args.load_in_4bit = r.boolean("load_in_4bit").value_or(false);
    args.quantization_type = r.string("quantization_type").value_or("");
    args.bnb_4bit_quant_type = r.string("bnb_4bit_quant_type").value_or("");
    args.double_quantization = r.boolean("double_quantization");
    args.bnb_4bit_use_double_quant = r.boolean("bnb_4bit_use_double_quant");
    out.recorded = true;
    out.run_dir = path.parent_path().string();
    out.quantization = config::quantization_of(args, at::kFloat);
    out.seed = r.integer("seed", 0).value_or(out.seed);
    out.adapter_name_or_path = r.string("adapter_name_or_path").value_or("");
    return out;
  }
  return out;
}

std::string pissa_start_dir(const std::string& dir) {
  const fs::path folder(dir);
  std::error_code ec;
  for (const fs::path& start :
       {folder / peft::kPissaInitDir, folder.parent_path() / peft::kPissaInitDir}) {
    if (fs::is_regular_file(start / "adapter_model.safetensors", ec)) return start.string();
    if (!is_step_folder(folder)) break;
  }
  return "";
}

}  // namespace zt::checkpoint
