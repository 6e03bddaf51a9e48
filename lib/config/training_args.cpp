// TrainingArguments from `--name value` flags or a JSON object, through one option table.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <set>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "config/hf_compat.hpp"
#include "config/training_options.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/spelling.hpp"
#include "zerotrain/config.hpp"

namespace zt {
namespace {

using config::Member;
using config::Option;
using Args = TrainingArguments;
using config::find_option;
using config::options;

std::string suggestion(std::string_view name) {
  // The peers' spellings of options zerotrain names otherwise (LLaMA-Factory, FastChat-style
  // scripts, Alpaca's train.py).
  static const std::pair<const char*, const char*> kPeers[] = {
      {"data_path", "train_file"},
      {"dataset", "train_file"},
      {"train_data", "train_file"},
      {"eval_data_path", "eval_file"},
      {"model_path", "model_name_or_path"},
      {"model", "model_name_or_path"},
      {"output_path", "output_dir"},
      {"epochs", "num_train_epochs"},
      {"lr", "learning_rate"},
      {"batch_size", "per_device_train_batch_size"}};
  for (const auto& [peer, ours] : kPeers) {
    if (name == peer) return fmt::format(" (did you mean '{}'?)", ours);
  }
  const Option* best = nullptr;
  size_t best_d = 4;
  for (const Option& o : options()) {
    size_t d = edit_distance(name, o.name);
    if (d < best_d) {
      best_d = d;
      best = &o;
    }
  }
  return best ? fmt::format(" (did you mean '{}'?)", best->name) : "";
}

constexpr const char* kBooleanWords = "true or false (True, False, true, false, 1, 0, yes, no)";

std::optional<bool> parse_bool_text(std::string_view s) {
  if (s == "true" || s == "True" || s == "TRUE" || s == "1" || s == "yes") return true;
  if (s == "false" || s == "False" || s == "FALSE" || s == "0" || s == "no") return false;
  return std::nullopt;
}

// Decimal text only, as Python's float() and int() read flags: digits with an optional sign,
// point and exponent. Hexadecimal (0x10), inf, nan and digit separators are refused; leading
// zeros are decimal (010 is ten), as in Python.
bool is_decimal_text(std::string_view s) {
  size_t i = 0;
  auto digits = [&] {
    const size_t from = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    return i - from;
  };
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t mantissa = digits();
  if (i < s.size() && s[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == s.size();
}

std::optional<double> parse_double_text(const std::string& s) {
  if (!is_decimal_text(s)) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(d)) return std::nullopt;
  return d;
}

std::optional<int64_t> parse_int_text(const std::string& s) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc() && p == s.data() + s.size()) return v;
  // Integral floats such as 2e8, as users write sizes.
  std::optional<double> d = parse_double_text(s);
  if (d && std::floor(*d) == *d && std::fabs(*d) < 9.2e18) return static_cast<int64_t>(*d);
  return std::nullopt;
}

// The options HF reads as a step count or, below 1, a fraction of the run.
bool is_step_interval(std::string_view name) {
  return name == "logging_steps" || name == "save_steps" || name == "eval_steps" ||
         name == "warmup_steps" || name == "show_loss_step" || name == "save_model_step";
}

// A number as HF's training_args.json shows it: step counts as integers.
void set_number(rapidjson::Value& value, std::string_view name, double v) {
  if (is_step_interval(name) && v >= 1 && std::floor(v) == v && v < 9e15) {
    value.SetInt64(static_cast<int64_t>(v));
  } else {
    value.SetDouble(v);
  }
}

// A value as it arrived: command-line text, or a JSON value.
struct RawValue {
  std::string text;
  const rapidjson::Value* json = nullptr;
  std::string shown() const { return json ? json::render(*json) : fmt::format("\"{}\"", text); }
};

[[noreturn]] void bad_value(const std::string& where, const Option& o, const RawValue& v,
                            const std::string& expected) {
  throw ConfigError(fmt::format("{}{}: expected {}, found {}", where, o.name, expected, v.shown()));
}

void assign(Args& args, const Option& o, const RawValue& v, const std::string& where) {
  struct Visitor {
    Args& args;
    const Option& o;
    const RawValue& v;
    const std::string& where;

    void operator()(bool Args::*m) const { args.*m = boolean(); }
    void operator()(std::optional<bool> Args::*m) const {
      if ((v.json && v.json->IsNull()) || (!v.json && (v.text == "None" || v.text == "null"))) {
        (args.*m).reset();
        return;
      }
      args.*m = boolean();
    }
    bool boolean() const {
      std::optional<bool> b;
      if (v.json && v.json->IsBool()) b = v.json->GetBool();
      if (!v.json || v.json->IsString()) {
        b = parse_bool_text(v.json ? json::text(*v.json) : v.text);
      }
      if (!b) bad_value(where, o, v, kBooleanWords);
      return *b;
    }
    void operator()(int64_t Args::*m) const { args.*m = integer(); }
    void operator()(std::optional<int64_t> Args::*m) const {
      if ((v.json && v.json->IsNull()) || (!v.json && (v.text == "None" || v.text == "null"))) {
        (args.*m).reset();
        return;
      }
      args.*m = integer();
    }
    void operator()(double Args::*m) const { args.*m = number(); }
    void operator()(std::optional<double> Args::*m) const {
      if ((v.json && v.json->IsNull()) || (!v.json && (v.text == "None" || v.text == "null"))) {
        (args.*m).reset();
        return;
      }
      args.*m = number();
    }
    double number() const {
      std::optional<double> d;
      if (v.json && v.json->IsNumber()) d = v.json->GetDouble();
      if (!v.json) d = parse_double_text(v.text);
      if (!d || !o.range.contains(*d)) bad_value(where, o, v, o.range.describe(false));
      if (is_step_interval(o.name) && *d >= 1 && std::floor(*d) != *d) {
        bad_value(where, o, v,
                  "a whole number of steps from 1 up, or a fraction of all steps below 1");
      }
      return *d;
    }
    void operator()(std::string Args::*m) const {
      std::string s;
      if (v.json && v.json->IsString()) {
        s.assign(v.json->GetString(), v.json->GetStringLength());
      } else if (v.json && v.json->IsObject() &&
                 (std::string_view(o.name) == "deepspeed" ||
                  std::string_view(o.name) == "model_config")) {
        s = json::dump(*v.json);  // an inline DeepSpeed config or model config
      } else if (v.json && v.json->IsNumber() &&
                 std::string_view(o.name) == "gradient_checkpointing_keep") {
        s = json::dump(*v.json);  // GiB, as on the command line
      } else if (v.json && v.json->IsArray() && std::string_view(o.name) == "report_to") {
        for (const auto& item : v.json->GetArray()) {  // HF's list form
          if (!item.IsString()) bad_value(where, o, v, "a string or a list of strings");
          s += (s.empty() ? "" : ",") + json::text(item);
        }
      } else if (v.json) {
        bad_value(where, o, v, "a string");
      } else {
        s = v.text;
      }
      if (!o.choices.empty() &&
          std::find(o.choices.begin(), o.choices.end(), s) == o.choices.end()) {
        std::string list;
        for (const std::string& c : o.choices) list += (list.empty() ? "" : ", ") + c;
        bad_value(where, o, v, "one of " + list);
      }
      args.*m = s;
    }
    int64_t integer() const {
      std::optional<int64_t> i;
      if (v.json && v.json->IsNumber()) i = json::as_integer(*v.json);
      if (!v.json) i = parse_int_text(v.text);
      if (!i || !o.range.contains(static_cast<double>(*i))) {
        bad_value(where, o, v, o.range.describe(true));
      }
      return *i;
    }
  };
  std::visit(Visitor{args, o, v, where}, o.member);
  args.given.insert(o.name);
}

void validate(const Args& a, const std::string& where);

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

// An HF field zerotrain does not use: a warning to give once, or an error when the value given
// would change results.
void note_foreign(Args& args, const config::ForeignOption& f, const std::string& canonical,
                  const std::string& shown, const std::string& where) {
  if (!config::is_neutral(f, canonical)) {
    throw ConfigError(fmt::format("{}{} {}: zerotrain cannot honour it ({}); drop it", where,
                                  f.name, shown, f.note));
  }
  args.ignored[f.name] = fmt::format("{} has no effect in zerotrain: {}", f.name, f.note);
}

// A JSON value's canonical text (config::canonical_value's rules).
std::string canonical_json(const rapidjson::Value& v) {
  if (v.IsNull()) return "none";
  if (v.IsBool()) return v.GetBool() ? "true" : "false";
  if (v.IsNumber()) return fmt::format("{:g}", v.GetDouble());
  if (v.IsString())
    return config::canonical_value(std::string_view(v.GetString(), v.GetStringLength()));
  if (v.IsArray() && v.Empty()) return "[]";
  if (v.IsObject() && v.ObjectEmpty()) return "{}";
  return json::dump(v);
}

bool is_local_rank_flag(std::string_view name) {
  return name == "local_rank" || name == "local-rank";
}

}  // namespace

std::vector<OptionHelp> training_option_help() {
  const Args defaults;
  std::vector<OptionHelp> out;
  for (const Option& o : options()) {
    OptionHelp h{o.name, "", o.help};
    std::visit(
        [&](auto m) {
          const auto& v = defaults.*m;
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, bool>) {
            h.default_value = v ? "true" : "false";
          } else if constexpr (std::is_same_v<V, std::optional<int64_t>> ||
                               std::is_same_v<V, std::optional<double>>) {
            h.default_value = v ? fmt::format("{}", *v) : "";
          } else if constexpr (std::is_same_v<V, std::optional<bool>>) {
            h.default_value = v ? (*v ? "true" : "false") : "";
          } else if constexpr (std::is_same_v<V, std::string>) {
            h.default_value = v;
          } else {
            h.default_value = fmt::format("{}", v);
          }
        },
        o.member);
    if (!o.choices.empty()) {
      std::string list;
      for (const std::string& c : o.choices) list += (list.empty() ? "" : " | ") + c;
      h.help = h.help.empty() ? list : h.help + " (" + list + ")";
    }
    out.push_back(std::move(h));
  }
  return out;
}

std::vector<std::string> training_option_names() {
  std::vector<std::string> names;
  for (const Option& o : options()) names.emplace_back(o.name);
  return names;
}

std::vector<std::string> apply_training_flags(TrainingArguments& args,
                                              const std::vector<std::string>& argv) {
  auto is_flag = [](const std::string& t) { return t.size() >= 3 && t.compare(0, 2, "--") == 0; };
  std::vector<std::string> positional;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& token = argv[i];
    if (!is_flag(token)) {
      positional.push_back(token);
      continue;
    }
    std::string name = token.substr(2);
    std::optional<std::string> inline_value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (is_local_rank_flag(name)) {  // DeepSpeed's launcher passes it; ranks come from the env
      if (!inline_value) ++i;
      continue;
    }
    std::replace(name.begin(), name.end(), '-', '_');
    // The value: `--name=value`; for flags the next token unless it is another option (`--fp16`
    // alone means true); for lists every token up to the next option, as HF's parser reads them.
    auto take = [&](config::ValueKind kind) {
      if (inline_value) return *inline_value;
      if (kind == config::ValueKind::kFlag)
        return i + 1 < argv.size() && !is_flag(argv[i + 1]) ? argv[++i] : "true";
      if (i + 1 >= argv.size() || is_flag(argv[i + 1]))
        throw ConfigError(fmt::format("--{} needs a value", name));
      std::string value = argv[++i];
      while (kind == config::ValueKind::kList && i + 1 < argv.size() && !is_flag(argv[i + 1]))
        value += "," + argv[++i];
      return value;
    };
    const Option* o = find_option(name);
    if (o == nullptr) {
      if (const config::ForeignOption* f = config::find_foreign_option(name)) {
        const std::string value = take(f->kind);
        note_foreign(args, *f, config::canonical_value(value), value, "--");
        continue;
      }
      throw ConfigError(fmt::format("unknown option --{}{}; see 'zerotrain train --help'", name,
                                    suggestion(name)));
    }
    const bool boolean = std::holds_alternative<bool Args::*>(o->member) ||
                         std::holds_alternative<std::optional<bool> Args::*>(o->member);
    RawValue v;
    v.text = take(boolean               ? config::ValueKind::kFlag
                  : name == "report_to" ? config::ValueKind::kList
                                        : config::ValueKind::kValue);
    assign(args, *o, v, "--");
  }
  finalize(args, "");
  return positional;
}

void apply_training_json(TrainingArguments& args, std::string_view text,
                         const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  if (!doc.IsObject()) {
    throw ConfigError(fmt::format("{}: expected a JSON object of options, found {}", source,
                                  json::type_name(doc)));
  }
  std::string where = source + ": ";
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    std::string name(it->name.GetString(), it->name.GetStringLength());
    if (is_local_rank_flag(name)) continue;
    const Option* o = find_option(name);
    if (o == nullptr) {
      if (const config::ForeignOption* f = config::find_foreign_option(name)) {
        note_foreign(args, *f, canonical_json(it->value), json::render(it->value), where);
        continue;
      }
      throw ConfigError(fmt::format("{}{}: unknown option{}", where, name, suggestion(name)));
    }
    // null is HF's None: the option's default (optional options are reset to none).
    if (it->value.IsNull() && !std::holds_alternative<std::optional<int64_t> Args::*>(o->member) &&
        !std::holds_alternative<std::optional<bool> Args::*>(o->member) &&
        !std::holds_alternative<std::optional<double> Args::*>(o->member)) {
      continue;
    }
    RawValue v;
    v.json = &it->value;
    assign(args, *o, v, where);
  }
  finalize(args, where);
}

void check_training_arguments(const TrainingArguments& args) {
  validate(args, "");
}

std::string training_arguments_json(const TrainingArguments& args) {
  rapidjson::Document doc(rapidjson::kObjectType);
  auto& alloc = doc.GetAllocator();
  std::vector<Member> seen;
  for (const Option& o : options()) {
    if (std::find(seen.begin(), seen.end(), o.member) != seen.end()) continue;  // an alias
    seen.push_back(o.member);
    rapidjson::Value value;
    std::visit(
        [&](auto m) {
          const auto& v = args.*m;
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, bool>) {
            value.SetBool(v);
          } else if constexpr (std::is_same_v<V, int64_t>) {
            value.SetInt64(v);
          } else if constexpr (std::is_same_v<V, double>) {
            set_number(value, o.name, v);
          } else if constexpr (std::is_same_v<V, std::optional<double>>) {
            if (v) set_number(value, o.name, *v);
          } else if constexpr (std::is_same_v<V, std::optional<int64_t>>) {
            if (v) value.SetInt64(*v);
          } else if constexpr (std::is_same_v<V, std::optional<bool>>) {
            if (v) value.SetBool(*v);
          } else {
            value.SetString(v.c_str(), static_cast<rapidjson::SizeType>(v.size()), alloc);
          }
        },
        o.member);
    doc.AddMember(rapidjson::Value(o.name, alloc), value, alloc);
  }
  return json::dump(doc);
}

void apply_training_file(TrainingArguments& args, const std::string& path) {
  apply_training_json(args, files::read_text(path, "options file"), path);
}

int64_t steps_for(double every, int64_t total_train_steps) {
  if (every >= 1) return static_cast<int64_t>(every);
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(every * static_cast<double>(total_train_steps))));
}

int64_t recompute_keep_bytes_for(const TrainingArguments& args) {
  const std::string& v = args.gradient_checkpointing_keep;
  if (v == "auto") return -1;  // EngineOptions::kAutoKeep
  if (v == "none") return 0;
  double gib = -1;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), gib);
  if (ec != std::errc() || end != v.data() + v.size() || !(gib >= 0) || gib > 1e9) {
    throw ConfigError(fmt::format(
        "gradient_checkpointing_keep: \"{}\" is not auto, none or a size in GiB (a number ≥ 0)",
        v));
  }
  return static_cast<int64_t>(gib * 1073741824.0);
}

int64_t warmup_steps_for(const TrainingArguments& args, int64_t total_train_steps) {
  if (args.warmup_steps > 0) return steps_for(args.warmup_steps, total_train_steps);
  return static_cast<int64_t>(
      std::ceil(args.warmup_ratio * static_cast<double>(total_train_steps)));
}

}  // namespace zt
