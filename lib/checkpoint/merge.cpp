// `zerotrain merge`: a checkpoint's sharded fp32 masters, or a run's final adapter or model
// folder (plus the base model where it holds only part of the weights), streamed into an HF
// model folder.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "checkpoint/run_settings.hpp"
#include "config/quantization.hpp"
#include "model/blocks.hpp"
#include "model/family.hpp"
#include "model/kept_parts.hpp"
#include "model/quantized_weights.hpp"
#include "peft/adapter_io.hpp"
#include "peft/expert_lora.hpp"
#include "peft/fused_experts.hpp"
#include "peft/init_sources.hpp"
#include "peft/linear_adapters.hpp"
#include "peft/pissa.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {
namespace fs = std::filesystem;

namespace {

// Anonymous resident memory of this process (RssAnon: heap and anonymous maps, not the file
// pages mmap'd safetensors occupy), in bytes; 0 where /proc is not there.
int64_t rss_anon_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return 0;
}

}  // namespace

MergeReport merge_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                             const MergeOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(checkpoint_dir, ec)) {
    throw IoError(fmt::format(
        "merge: '{}' {}; name a checkpoint-<step> folder or a run's "
        "output_dir",
        checkpoint_dir, fs::exists(checkpoint_dir, ec) ? "is not a folder" : "does not exist"));
  }
  if (fs::exists(out_dir, ec) && !fs::is_empty(out_dir, ec)) {
    throw ConfigError(fmt::format(
        "merge: '{}' is not empty; choose a new folder (nothing there is overwritten)", out_dir));
  }
  // A run's output folder after ZeRO-3 without 16-bit gathering holds no weights of its own:
  // they are in its newest checkpoint, which is merged instead (saying so).
  const bool has_weights = fs::exists(checkpoint_dir + "/model.safetensors", ec) ||
                           fs::exists(checkpoint_dir + "/model.safetensors.index.json", ec) ||
                           fs::exists(checkpoint_dir + "/adapter_config.json", ec) ||
                           fs::exists(checkpoint_dir + "/layout.json", ec);
  if (!has_weights) {
    if (const std::optional<std::string> newest = latest_checkpoint(checkpoint_dir)) {
      log::info(
          "merge: '{}' holds no weights of its own (ZeRO-3 kept them sharded): merging its "
          "newest checkpoint '{}'",
          checkpoint_dir, *newest);
      return merge_checkpoint(*newest, out_dir, options);
    }
  }
  const ReadLock reading(checkpoint_dir);  // rotation keeps it meanwhile
  // What the folder is: a checkpoint (fp32 masters, sharded) or a run's final output folder (an
  // adapter folder, or an HF model folder); and what it holds: a LoRA adapter over a base
  // model, or (part of) a whole model.
  const bool checkpoint = fs::is_regular_file(checkpoint_dir + "/layout.json", ec);
  const bool adapter = fs::is_regular_file(checkpoint_dir + "/adapter_config.json", ec);
  if (!checkpoint && !adapter && !fs::is_regular_file(checkpoint_dir + "/config.json", ec)) {
    throw IoError(fmt::format(
        "merge: '{}' is neither a zerotrain checkpoint (layout.json), an adapter folder "
        "(adapter_config.json) nor a model folder (config.json); name a checkpoint-<step> "
        "folder or a run's output_dir",
        checkpoint_dir));
  }
  PeftConfig peft;
  if (adapter) {
    // The adapter's kind first: a prompt adapter's tensors have no place in the model.
    peft = load_adapter_config(checkpoint_dir);
    if (peft.type != FinetuningType::kLora) {
      throw ConfigError(
          fmt::format("merge: '{}' holds a P-Tuning / prefix adapter, which adds virtual tokens "
                      "rather than changing weights; load it with PEFT (or zerotrain) instead",
                      checkpoint_dir));
    }
  }
  std::shared_ptr<ParameterSource> masters = checkpoint ? checkpoint_master_source(checkpoint_dir)
                                             : adapter  ? adapter_source(checkpoint_dir)
                                                        : checkpoint_source(checkpoint_dir);
  std::string base_dir = options.base_model;
  ModelConfig config;
  if (adapter) {
    base_dir = adapter_base_model(checkpoint_dir, options.base_model);
    config = load_model_config(base_dir);
    // Tensors are read by the model's names below: one with no place in the model (another
    // base's, a misspelt key) would be dropped from the merge without a word, so it is refused
    // as train refuses it.
    peft::check_adapter_places(config, checkpoint_dir, peft);
  } else {
    if (!fs::is_regular_file(checkpoint_dir + "/config.json", ec)) {
      throw IoError(fmt::format("merge: '{}' has neither adapter_config.json nor config.json",
                                checkpoint_dir));
    }
    config = load_model_config(checkpoint_dir);
  }
  // The base's tensors through checkpoint_source: floating point and exactly the model's shapes —
  // for an adapter trained over a 4-bit base, the values it was trained over (dequantized).
  // A PiSSA adapter was trained over the residual base: the base's targets less their starting
  // factors, decomposed again as the run did (the residual quantized when the run's base was).
  std::shared_ptr<ParameterSource> base;
  if (!base_dir.empty()) {
    if (adapter) {
      const checkpoint::RunSettings run = checkpoint::run_settings(checkpoint_dir);
      model::SourceWrap residual;
      if (peft::pissa_iterations(peft.lora.init_lora_weights)) {
        // The residual the run trained over: its weight less the starting factors it saved
        // (pissa_init/), else decomposed again as the run did (its seed, on the CPU).
        const std::string start = checkpoint::pissa_start_dir(checkpoint_dir);
        residual = [&, start](std::shared_ptr<ParameterSource> dense) {
          auto targets = std::make_shared<CausalLM>(config, at::TensorOptions(), false);
          std::shared_ptr<ParameterSource> out =
              start.empty()
                  ? peft::pissa_source(std::move(dense), *targets, peft.lora,
                                       static_cast<uint64_t>(run.seed), at::kCPU,
                                       /*factors=*/false)
                  : peft::pissa_start_source(std::move(dense), *targets, peft.lora, start);
          return out;
        };
      }
      base = model::merge_base_source(base_dir, config, run.quantization, residual);
    } else {
      base = checkpoint_source(base_dir);
    }
  }
  const at::ScalarType dtype = options.dtype.value_or(config.dtype);

  // The HF tensor names and shapes, from a placeholder model of this config; each output tensor
  // from rows of one model tensor (a ChatGLM folder written as glm splits query_key_value).
  const model::Conversion* conversion = model::family_of(config).conversion;
  if (options.as_glm && (conversion == nullptr || conversion->to != "glm")) {
    throw ConfigError(fmt::format("merge: --as glm converts ChatGLM2/3 folders, but '{}' is {}",
                                  base_dir.empty() ? checkpoint_dir : base_dir, config.model_type));
  }
  const bool to_glm = options.as_glm;
  CausalLM shape_of(config, at::TensorOptions(), /*allocate=*/false);
  // The adapter's options as training applied them (PEFT's conversion for fused experts).
  if (adapter) peft.lora = peft::converted_for_fused_experts(shape_of, peft.lora);
  // gpt-oss keeps its experts' tensors [E, in, out].
  bool experts_transposed = false;
  for (const model::LayerSpec& l : model::decoder_spec(config).layers)
    experts_transposed = experts_transposed || (l.moe && l.moe->transposed);
  std::vector<TensorEntry> plan;
  struct Rows {
    std::string name;  // the model's tensor
    int64_t first = 0, count = -1;
  };
  std::vector<Rows> source_of;
  for (const auto& item : shape_of.named_parameters(true)) {
    const std::vector<int64_t> shape = item.value().sizes().vec();
    if (!to_glm) {
      plan.push_back(TensorEntry{item.key(), dtype, shape});
      source_of.push_back({item.key()});
      continue;
    }
    for (const GlmTensorFrom& g : conversion->tensors(config, item.key())) {
      std::vector<int64_t> rows = shape;
      if (g.rows >= 0) rows[0] = g.rows;
      plan.push_back(TensorEntry{g.glm_name, dtype, rows});
      source_of.push_back({item.key(), g.first_row, g.rows});
    }
  }
  // A multimodal folder's vision tower and projector, not trained: copied from the folder that
  // holds them (the base, or a full fine-tune's checkpoint).
  const model::KeptParts kept = model::kept_parts_of(config, {base_dir, checkpoint_dir});
  kept.plan(plan, dtype);
  std::map<std::string, std::vector<int64_t>> model_shape;
  for (const auto& item : shape_of.named_parameters(true))
    model_shape[item.key()] = item.value().sizes().vec();
  fs::create_directories(out_dir);
  const int64_t rss_start = rss_anon_bytes();
  MergeReport report;
  SafetensorsStreamWriter writer(out_dir, plan, options.max_shard_bytes);
  // The model's tensor, LoRA folded in. A tensor split into several outputs (ChatGLM's
  // query_key_value as q, k, v) is read and folded once for all of them.
  std::string held_name;
  at::Tensor held;
  auto model_tensor = [&](const std::string& name) {
    if (name == held_name) return held;
    held = at::Tensor();  // memory stays near one tensor
    const std::vector<int64_t>& shape = model_shape.at(name);
    at::Tensor value = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
    if (masters->has(name)) {
      masters->read(name, shape, 0, value);
    } else if (base && base->has(name)) {
      base->read(name, shape, 0, value);
    } else {
      throw IoError(fmt::format(
          "merge: '{}' is neither trained in '{}' nor found in a base model{}; a Freeze "
          "checkpoint needs --base_model DIR",
          name, checkpoint_dir, base_dir.empty() ? "" : " ('" + base_dir + "')"));
    }
    const std::string module = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0
                                   ? name.substr(0, name.size() - 7)
                                   : "";
    if (adapter) {
      const auto trained = [&](const std::string& n) { return masters->has(n); };
      const auto read = [&](const std::string& n, at::Tensor& out) {
        masters->read(n, out.sizes().vec(), 0, out);
      };
      if (!module.empty()) peft::fold_trained_adapter(peft.lora, module, value, trained, read);
      peft::fold_trained_expert_adapter(peft.lora, name, experts_transposed, value, trained, read);
    }
    held_name = name;
    held = value;
    return value;
  };
  for (size_t i = 0; i < source_of.size(); ++i) {  // the model's tensors, then the kept parts
    const TensorEntry& e = plan[i];
    const Rows& from = source_of[i];
    at::Tensor value = model_tensor(from.name);
    if (from.count >= 0) value = value.narrow(0, from.first, from.count).contiguous();
    writer.write(e.name, value);
    report.largest_tensor_bytes = std::max(report.largest_tensor_bytes, e.nbytes());
    ++report.tensors;
    report.peak_rss_anon_bytes = std::max(report.peak_rss_anon_bytes, rss_anon_bytes() - rss_start);
  }
  kept.write(writer, dtype);
  report.tensors += static_cast<int64_t>(kept.tensors.size());
  report.files = writer.finish();
  ModelConfig out_config = to_glm ? conversion->config(config) : config;
  out_config.dtype = dtype;
  files::write_atomic(out_dir + "/config.json", model_config_json(out_config) + "\n");
  report.files.push_back(out_dir + "/config.json");
  // Tokenizer and generation settings: the checkpoint's copies, else the base model's.
  if (copy_model_companion_files(checkpoint_dir, out_dir) == 0 && !base_dir.empty()) {
    copy_model_companion_files(base_dir, out_dir);
  }
  // The chat format the run trained with, so that `verify` on the merged model asks in it.
  if (const std::optional<std::string> trained = recorded_template(checkpoint_dir)) {
    record_template(out_dir, *trained);
    report.files.push_back(out_dir + "/zerotrain_template.json");
  }
  log::info("merged '{}' into '{}': {} tensors in {}, largest {:.1f} MiB", checkpoint_dir, out_dir,
            report.tensors, c10::toString(dtype),
            static_cast<double>(report.largest_tensor_bytes) / (1 << 20));
  return report;
}

}  // namespace zt
