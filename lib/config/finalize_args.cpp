// Finishing TrainingArguments once read: ChatGLM-Finetuning's defaults, the settings derived
// from others, and the checks that span several options.
#include "config/finalize_args.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "config/training_options.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/error.hpp"

namespace zt::config {
namespace {

// The integrations HF's report_to names besides TensorBoard: accepted with a warning.
bool is_other_integration(const std::string& name) {
  static const std::set<std::string> names = {
      "azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive",     "flyte",
      "mlflow",   "neptune", "swanlab",    "trackio",  "wandb",   "tensorboardx"};
  return names.count(name) != 0;
}

// Whether any name of the option `member` was given.
bool member_given(const Args& a, const config::Member& member) {
  for (const Option& o : options()) {
    if (o.member == member && a.is_given(o.name)) return true;
  }
  return false;
}

// ChatGLM-Finetuning's train.py: when any flag only it has is given, what is not given takes
// its defaults and the values it writes into the DeepSpeed config (betas 0.9/0.95, eps 1e-8,
// warmup_min_lr 0.1 × lr), and train_type picks the method. Idempotent.
void finalize_chatglm_finetuning(Args& a, const std::string& where) {
  static const char* const kOwnFlags[] = {"train_path",       "max_len",        "max_src_len",
                                          "is_skip",          "mode",           "train_type",
                                          "ds_file",          "show_loss_step", "lora_dim",
                                          "lora_module_name", "save_model_step"};
  const bool seed = std::any_of(std::begin(kOwnFlags), std::end(kOwnFlags),
                                [&](const char* f) { return a.is_given(f); });
  if (!seed) return;
  auto by_default = [&](auto member, auto value) {
    if (!member_given(a, member)) a.*member = value;
  };
  by_default(&Args::glm_prompt_layout, std::string("glm2"));
  by_default(&Args::train_type, std::string("lora"));
  by_default(&Args::per_device_train_batch_size, int64_t{16});
  by_default(&Args::learning_rate, 1e-3);
  by_default(&Args::weight_decay, 0.1);
  by_default(&Args::adam_beta1, 0.9);
  by_default(&Args::adam_beta2, 0.95);
  by_default(&Args::adam_epsilon, 1e-8);
  by_default(&Args::num_train_epochs, 1.0);
  by_default(&Args::warmup_ratio, 0.1);
  by_default(&Args::warmup_min_lr_ratio, 0.1);
  by_default(&Args::seed, int64_t{1234});
  by_default(&Args::logging_steps, 10.0);
  by_default(&Args::lora_alpha, 30.0);
  by_default(&Args::lora_dropout, 0.1);
  by_default(&Args::lora_target_modules, std::string("query_key_value"));
  by_default(&Args::freeze_module_name, std::string("layers.27."));
  by_default(&Args::pre_seq_len, std::optional<int64_t>(16));
  by_default(&Args::prefix_projection, true);
  // train.py saves the model only at save_model_step and at the end of each epoch.
  if (!member_given(a, &Args::save_steps)) by_default(&Args::save_strategy, std::string("no"));
  if (a.glm_prompt_layout == "glm") {
    throw ConfigError(fmt::format(
        "{}mode glm: ChatGLM-6B (the first generation) is not supported; zerotrain trains "
        "ChatGLM2/3-6B (--mode glm2, glm3) and GLM-4 (model_type glm, glm4)",
        where));
  }
  const std::string method = a.train_type == "ptuning" ? "prefix"
                             : a.train_type == "all"   ? "full"
                                                       : a.train_type;
  if (a.is_given("finetuning_type") && a.finetuning_type != method &&
      !(method == "prefix" && a.finetuning_type == "ptuning_v2")) {
    throw ConfigError(
        fmt::format("{}train_type {} and finetuning_type {} contradict each other; "
                    "give one of them",
                    where, a.train_type, a.finetuning_type));
  }
  a.finetuning_type = method;
}

}  // namespace

// Settings derived from others (torch_dtype, use_cpu, report_to), then the checks that span
// several options. Idempotent: the options file and the flags each end with it.
void finalize(Args& a, const std::string& where) {
  finalize_chatglm_finetuning(a, where);
  if (a.torch_dtype == "bfloat16" || a.torch_dtype == "float16") {
    const bool bf = a.torch_dtype == "bfloat16";
    bool& mine = bf ? a.bf16 : a.fp16;
    bool& other = bf ? a.fp16 : a.bf16;
    const char* other_name = bf ? "fp16" : "bf16";
    if (other && a.is_given(other_name)) {
      throw ConfigError(
          fmt::format("{}torch_dtype {} and {} true contradict each other ({} weights train with "
                      "{}); drop one of them",
                      where, a.torch_dtype, other_name, a.torch_dtype, bf ? "bf16" : "fp16"));
    }
    if (!mine && a.is_given(bf ? "bf16" : "fp16")) {
      throw ConfigError(
          fmt::format("{}torch_dtype {} and {} false contradict each other; drop one of them",
                      where, a.torch_dtype, bf ? "bf16" : "fp16"));
    }
    mine = true;
    other = false;
  }
  if (a.use_cpu) {
    if (a.device == "cuda") {
      throw ConfigError(fmt::format(
          "{}use_cpu (no_cuda) and device cuda contradict each other; drop one of them", where));
    }
    a.device = "cpu";
  }
  std::string reports;
  for (size_t start = 0; start <= a.report_to.size();) {
    const size_t comma = std::min(a.report_to.find(',', start), a.report_to.size());
    std::string r = a.report_to.substr(start, comma - start);
    r.erase(0, r.find_first_not_of(' '));
    r.erase(r.find_last_not_of(' ') + 1);
    start = comma + 1;
    if (r.empty()) continue;
    if (r == "None") r = "none";
    if (r == "none" || r == "all" || r == "tensorboard") {
      reports += (reports.empty() ? "" : ",") + r;
    } else if (is_other_integration(r)) {
      a.ignored["report_to " + r] = fmt::format(
          "report_to {}: zerotrain has no {} integration; metrics go to the log and "
          "trainer_log.jsonl "
          "(and TensorBoard with report_to tensorboard)",
          r, r);
    } else {
      throw ConfigError(
          fmt::format("{}report_to: unknown integration \"{}\"; zerotrain writes none, "
                      "tensorboard or all (= tensorboard)",
                      where, r));
    }
  }
  a.report_to = reports.empty() ? "none" : reports;
  // LLaMA-Factory's spelling of a zerotrain value: the template qwen3_nothink (ChatML without a
  // default system message: zerotrain's chatml, string for string). Its lora_target all stays
  // itself: the names of every linear layer but the output layer, which is PEFT's all-linear
  // except on the mixtures PEFT converts (lib/peft/fused_experts.hpp).
  if (a.template_name == "qwen3_nothink") a.template_name = "chatml";
  if (a.train_sampling_strategy == "group_by_length") a.group_by_length = true;
  if (a.group_by_length && a.train_sampling_strategy == "sequential") {
    throw ConfigError(fmt::format(
        "{}group_by_length and train_sampling_strategy sequential contradict each other "
        "(grouping reorders the examples); drop one of them",
        where));
  }
  try {
    recompute_keep_bytes_for(a);
  } catch (const ConfigError& e) {
    throw ConfigError(where + e.what());
  }
  validate(a, where);
}

// Every number inside its option's range (for arguments set in code, which the parser did not
// see), then the checks that span several options.
void validate(const Args& a, const std::string& where) {
  std::vector<Member> seen;
  for (const Option& o : options()) {
    if (std::find(seen.begin(), seen.end(), o.member) != seen.end()) continue;  // an alias
    seen.push_back(o.member);
    std::visit(
        [&](auto m) {
          using V = std::decay_t<decltype(a.*m)>;
          std::optional<double> value;
          if constexpr (std::is_same_v<V, int64_t> || std::is_same_v<V, double>) {
            value = static_cast<double>(a.*m);
          } else if constexpr (std::is_same_v<V, std::optional<int64_t>> ||
                               std::is_same_v<V, std::optional<double>>) {
            if (a.*m) value = static_cast<double>(*(a.*m));
          }
          if (value && (!std::isfinite(*value) || !o.range.contains(*value))) {
            throw ConfigError(
                fmt::format("{}{}: expected {}, found {}", where, o.name,
                            o.range.describe(std::is_integral_v<V> ||
                                             std::is_same_v<V, std::optional<int64_t>>),
                            *value));
          }
        },
        o.member);
  }
  if (!a.model_name_or_path.empty() && !a.model_config.empty()) {
    throw ConfigError(
        fmt::format("{}model_name_or_path and model_config are both given; give one "
                    "(model_config builds a model with random weights)",
                    where));
  }
  if (a.load_best_model_at_end) {
    // HF TrainingArguments' rule: the best model is chosen among saved checkpoints.
    if (a.eval_strategy == "no" || a.eval_strategy != a.save_strategy) {
      throw ConfigError(
          fmt::format("{}load_best_model_at_end needs eval_strategy and save_strategy "
                      "to be the same and not \"no\" (found {} and {})",
                      where, a.eval_strategy, a.save_strategy));
    }
    // With ratios the rule holds for the ratios (HF compares them, both or neither a ratio).
    const double every = a.eval_steps.value_or(a.logging_steps);
    if (a.eval_strategy == "steps" && (every < 1) != (a.save_steps < 1)) {
      throw ConfigError(
          fmt::format("{}load_best_model_at_end needs save_steps ({}) and eval_steps ({}) both "
                      "as steps or both as fractions of the run",
                      where, a.save_steps, every));
    }
    const double ratio = a.save_steps / every;
    if (a.eval_strategy == "steps" && std::fabs(ratio - std::round(ratio)) > 1e-9 * ratio) {
      throw ConfigError(
          fmt::format("{}load_best_model_at_end needs save_steps ({}) to be a multiple "
                      "of eval_steps ({})",
                      where, a.save_steps, every));
    }
  }
  if (a.fp16 && a.bf16) {
    throw ConfigError(fmt::format("{}fp16 and bf16 are both true; choose one", where));
  }
  // TRL's SFT options: what the loss covers in SFT records (docs/data.md).
  for (const auto& [name, value] : {std::pair{"completion_only_loss", a.completion_only_loss},
                                    std::pair{"assistant_only_loss", a.assistant_only_loss}}) {
    if (a.train_on_prompt && value.value_or(false)) {
      throw ConfigError(
          fmt::format("{}train_on_prompt true and {} true contradict each other (train_on_prompt "
                      "trains the prompt tokens too); drop one of them",
                      where, name));
    }
    if (value && a.stage != "sft") {
      throw ConfigError(
          fmt::format("{}{} is an SFT option (TRL's SFTConfig); stage {} trains the answers of "
                      "preference records only: drop it",
                      where, name, a.stage));
    }
  }
  if (a.dataset_text_field != "text" && a.stage != "sft") {
    throw ConfigError(
        fmt::format("{}dataset_text_field is an SFT option (TRL's SFTConfig); stage {} reads "
                    "preference records: drop it",
                    where, a.stage));
  }
  if (a.pre_seq_len && a.finetuning_type == "ptuning") {
    throw ConfigError(fmt::format(
        "{}pre_seq_len is P-Tuning v2's prefix length, but finetuning_type is ptuning (P-Tuning "
        "v1); use --finetuning_type prefix (alias ptuning_v2), or num_virtual_tokens for ptuning",
        where));
  }
  if (a.freeze_trainable_layers == 0 && a.finetuning_type == "freeze" &&
      a.freeze_module_name.empty()) {
    throw ConfigError(
        fmt::format("{}freeze_trainable_layers: 0 trains nothing; give N > 0 (last N "
                    "layers) or N < 0 (first N)",
                    where));
  }
}

}  // namespace zt::config
