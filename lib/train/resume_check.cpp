// A resumed run's arguments against those its checkpoint recorded (resume_check.hpp).
#include "train/resume_check.hpp"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <type_traits>
#include <variant>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "config/quantization.hpp"
#include "config/training_options.hpp"
#include "peft/pissa.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/peft.hpp"

namespace zt::train {
namespace {

namespace fs = std::filesystem;
using config::Member;
using config::Option;
using Args = TrainingArguments;

// Where the run's output goes and how it gets there: none of it changes the model trained or
// the examples it sees (the data order is restored by samples consumed, docs/checkpoints.md).
const std::vector<std::string> kMayChange = {
    // where things are written, and how the run reports
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "run_name", "report_to",
    "disable_tqdm", "logging_dir", "logging_steps", "logging_strategy", "logging_first_step",
    // saving and evaluation
    "save_strategy", "save_steps", "save_total_limit", "pissa_convert", "eval_file", "eval_dataset",
    "do_train", "do_eval", "eval_strategy", "eval_steps", "eval_delay", "eval_on_start",
    "per_device_eval_batch_size", "load_best_model_at_end", "metric_for_best_model",
    "greater_is_better",
    // how long, how fast, with what step sizes
    "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
    "warmup_ratio", "warmup_min_lr_ratio", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "max_grad_norm",
    // batches, ranks and the machine (checkpoints resume at any world size)
    "per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_drop_last",
    "deepspeed", "device", "use_cpu", "tf32", "torch_dtype", "fp16", "bf16",
    "bnb_4bit_compute_dtype", "ddp_timeout", "rendezvous_timeout", "expert_parallel_size",
    "sequence_parallel_size",
    // memory and speed, not results
    "gradient_checkpointing", "gradient_checkpointing_keep", "use_unsloth_gc",
    "recompute_num_layers", "activations_checkpoint_num_layers", "update_in_backward", "tiled_mlp",
    "tiled_mlp_num_shards", "precompute_ref_log_probs",
    // the data's order and which bad lines stop the run (not what a good example becomes);
    // where the data file is (the same data moved or copied: what it becomes — template,
    // lengths, layout options — is compared)
    "seed", "data_seed", "ignore_data_skip", "group_by_length", "train_sampling_strategy",
    "skip_bad_lines", "train_file", "dataset_dir", "cache_dir",
    // a spelling whose meaning is compared as finetuning_type
    "train_type"};

// Options compared by what they mean together rather than one by one.
const std::vector<std::string> kQuantization = {"quantization_bit",
                                                "quantization_type",
                                                "double_quantization",
                                                "load_in_4bit",
                                                "load_in_8bit",
                                                "bnb_4bit_quant_type",
                                                "bnb_4bit_use_double_quant",
                                                "bnb_4bit_quant_storage"};
const std::vector<std::string> kAdapterStart = {"pissa_init", "pissa_iter", "init_lora_weights"};
// Paths: the same file under another spelling is the same.
const std::set<std::string> kPaths = {"model_name_or_path", "adapter_name_or_path", "model_config"};

const Member& member_of(const std::string& name) {
  const Option* o = config::find_option(name);
  if (o == nullptr) throw InvalidArgument("resume check: no option " + name);
  return o->member;
}

// One compared setting: its name in messages, the options that spell it, and its value.
struct Setting {
  std::string name;
  std::vector<std::string> options;
  std::function<std::string(const Args&)> value;
};

std::string json_value(const Args& a, const Member& member) {
  return std::visit(
      [&](auto m) -> std::string {
        const auto& v = a.*m;
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<V, std::string>) {
          return "\"" + v + "\"";
        } else if constexpr (std::is_same_v<V, int64_t> || std::is_same_v<V, double>) {
          return fmt::format("{}", v);
        } else {
          return v ? fmt::format("{}", *v) : "none";
        }
      },
      member);
}

std::string quantization_value(const Args& a) {
  Args plain = a;
  plain.bnb_4bit_compute_dtype.clear();  // the run's compute dtype, which may change
  const std::optional<QuantizationConfig> q = config::quantization_of(plain, at::kFloat);
  if (!q) return "none (a full-precision base)";
  return fmt::format("4-bit {}{}, blocks of {}", q->quant_type,
                     q->double_quant ? " with double quantization" : "", q->blocksize);
}

// How a LoRA adapter starts, as peft_config_for spells it (without its checks across options,
// which the run's own set-up makes).
std::string adapter_start_value(const Args& a) {
  if (!a.init_lora_weights.empty()) {
    return peft::canonical_init(a.init_lora_weights).value_or(a.init_lora_weights);
  }
  if (!a.pissa_init) return "true";
  return a.pissa_iter == -1 ? "pissa" : fmt::format("pissa_niter_{}", a.pissa_iter);
}

std::vector<Setting> compared_settings() {
  std::vector<Setting> out;
  std::vector<const Member*> seen;
  auto grouped = [](const std::string& name) {
    return std::find(kQuantization.begin(), kQuantization.end(), name) != kQuantization.end() ||
           std::find(kAdapterStart.begin(), kAdapterStart.end(), name) != kAdapterStart.end();
  };
  for (const Option& o : config::options()) {
    if (std::any_of(seen.begin(), seen.end(), [&](const Member* m) { return *m == o.member; }))
      continue;  // an alias: compared under its first name
    seen.push_back(&o.member);
    const std::string name = o.name;
    if (grouped(name) ||
        std::find(kMayChange.begin(), kMayChange.end(), name) != kMayChange.end()) {
      continue;
    }
    const Member member = o.member;
    out.push_back({name, {name}, [member](const Args& a) { return json_value(a, member); }});
  }
  out.push_back({"quantization", kQuantization, quantization_value});
  out.push_back({"init_lora_weights", kAdapterStart, adapter_start_value});
  return out;
}

// The recorded arguments as TrainingArguments: each recorded member set as it was (the file
// holds finished arguments, so nothing is derived again).
Args recorded_arguments(const rapidjson::Value& recorded, const std::string& path) {
  Args a;
  if (!recorded.IsObject()) {
    throw IoError(
        fmt::format("'{}': training_arguments is not an object; the checkpoint's record "
                    "of its run is damaged",
                    path));
  }
  for (auto it = recorded.MemberBegin(); it != recorded.MemberEnd(); ++it) {
    const std::string name(it->name.GetString(), it->name.GetStringLength());
    const Option* o = config::find_option(name);
    if (o == nullptr) continue;  // an option of another version: nothing to compare it with
    const rapidjson::Value& v = it->value;
    const bool ok = std::visit(
        [&](auto m) {
          auto& dst = a.*m;
          using V = std::decay_t<decltype(dst)>;
          constexpr bool optional = std::is_same_v<V, std::optional<bool>> ||
                                    std::is_same_v<V, std::optional<int64_t>> ||
                                    std::is_same_v<V, std::optional<double>>;
          if (v.IsNull()) {  // an optional option left unset: the file writes null
            if constexpr (optional) dst = V();
            return optional;
          }
          if constexpr (std::is_same_v<V, bool> || std::is_same_v<V, std::optional<bool>>) {
            if (!v.IsBool()) return false;
            dst = v.GetBool();
          } else if constexpr (std::is_same_v<V, std::string>) {
            if (!v.IsString()) return false;
            dst.assign(v.GetString(), v.GetStringLength());
          } else if constexpr (std::is_same_v<V, int64_t> ||
                               std::is_same_v<V, std::optional<int64_t>>) {
            if (!v.IsInt64()) return false;
            dst = v.GetInt64();
          } else {
            if (!v.IsNumber()) return false;
            dst = v.GetDouble();
          }
          return true;
        },
        o->member);
    if (!ok) {
      throw IoError(
          fmt::format("'{}': training_arguments.{} is {}, not a value of that option; "
                      "the checkpoint's record of its run is damaged",
                      path, name, json::type_name(v)));
    }
  }
  return a;
}

bool same_path(const std::string& a, const std::string& b) {
  if (a == b) return true;
  std::error_code ec;
  return !a.empty() && !b.empty() && fs::exists(a, ec) && fs::equivalent(a, b, ec);
}

bool given(const Args& a, const std::vector<std::string>& options) {
  for (const std::string& name : options) {
    const Member& member = member_of(name);
    for (const Option& o : config::options()) {
      if (o.member == member && a.is_given(o.name)) return true;
    }
  }
  return false;
}

}  // namespace

const std::vector<std::string>& options_resume_may_change() {
  return kMayChange;
}

std::vector<std::string> reconcile_resumed_arguments(Args& args, const std::string& checkpoint_dir,
                                                     ResumeDifferences mode) {
  const std::string path = checkpoint_dir + "/training_args.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    return {fmt::format(
        "resume: '{}' has no training_args.json (a checkpoint of an older zerotrain): the "
        "options that say what the model and the data are cannot be compared with its run's",
        checkpoint_dir)};
  }
  const rapidjson::Document doc = json::parse(files::read_text(path, "run settings"), path);
  if (!doc.IsObject() || !doc.HasMember("training_arguments")) {
    throw IoError(
        fmt::format("'{}' has no training_arguments object; the checkpoint's record of "
                    "its run is damaged: resume from an intact checkpoint",
                    path));
  }
  const Args recorded = recorded_arguments(doc["training_arguments"], path);
  std::vector<std::string> taken;
  for (const Setting& s : compared_settings()) {
    const std::string now = s.value(args);
    const std::string then = s.value(recorded);
    if (now == then) continue;
    if (kPaths.count(s.name) &&
        same_path(now.substr(1, now.size() - 2), then.substr(1, then.size() - 2))) {
      continue;
    }
    if (mode == ResumeDifferences::kRefuse || given(args, s.options)) {
      throw ConfigError(fmt::format(
          "resume from '{}': {} is {} here but {} in the run that wrote it ({}); a resumed run "
          "keeps what the model and the data are: {}",
          checkpoint_dir, s.name, now, then, path,
          mode == ResumeDifferences::kRefuse
              ? "load the checkpoint into a trainer built with the recorded value"
              : fmt::format("drop --{} (the recorded value is then taken), or start a new run "
                            "in another output_dir",
                            s.options.front())));
    }
    for (const std::string& name : s.options) {
      std::visit([&](auto m) { args.*m = recorded.*m; }, member_of(name));
    }
    taken.push_back(fmt::format("resume: {} {}, as the run that wrote '{}' had it", s.name, then,
                                checkpoint_dir));
  }
  return taken;
}

}  // namespace zt::train
