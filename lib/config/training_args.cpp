// TrainingArguments from `--name value` flags or a JSON or YAML object, through one option table.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "config/finalize_args.hpp"
#include "config/hf_compat.hpp"
#include "config/training_options.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/spelling.hpp"
#include "util/yaml.hpp"
#include "zerotrain/config.hpp"

namespace zt::config {

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

}  // namespace zt::config

namespace zt {
namespace {

using config::parse_double_text;

using config::Member;
using config::Option;
using Args = TrainingArguments;
using config::finalize;
using config::find_option;
using config::options;
using config::validate;

std::string suggestion(std::string_view name) {
  // The peers' spellings of options zerotrain names otherwise (LLaMA-Factory, FastChat-style
  // scripts, Alpaca's train.py).
  static const std::pair<const char*, const char*> kPeers[] = {
      {"data_path", "train_file"},
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

void assign_value(Args& args, const Option& o, const RawValue& v, const std::string& where) {
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
      } else if (v.json && v.json->IsArray() && std::string_view(o.name) == "stop_strings") {
        s = json::dump(*v.json);  // a list, as on the command line
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

// The options one source (the command line, or one options file) gave, by member: two names
// of one option (an alias and its option: --beta and --pref_beta) given different values in
// the same source contradict each other. A later source overrides an earlier one, and the same
// name given twice keeps the last value, as HF's parser does.
class AliasCheck {
 public:
  explicit AliasCheck(std::string where) : where_(std::move(where)) {}
  void assign(Args& args, const Option& o, const RawValue& v) {
    for (const auto& [name, value] : seen_) {
      const Option* other = find_option(name);
      if (name == o.name || other == nullptr || !(other->member == o.member)) continue;
      const std::string before = value_of(args, o.member);
      assign_value(args, o, v, where_);
      const std::string after = value_of(args, o.member);
      if (before != after) {
        const bool flags = where_ == "--";
        throw ConfigError(fmt::format(
            "{}{}{} {} and {}{} {} name the same option with different values; give one of them",
            flags ? "" : where_, flags ? "--" : "", name, value, flags ? "--" : "", o.name,
            shown(v)));
      }
      seen_.emplace_back(o.name, shown(v));
      return;
    }
    assign_value(args, o, v, where_);
    seen_.emplace_back(o.name, shown(v));
  }

 private:
  // A value as the user wrote it: the flag's text, or the JSON value.
  static std::string shown(const RawValue& v) { return v.json ? json::render(*v.json) : v.text; }
  static std::string value_of(const Args& a, const Member& member) {
    return std::visit(
        [&](auto m) -> std::string {
          const auto& x = a.*m;
          using V = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<V, std::string>) {
            return x;
          } else if constexpr (std::is_same_v<V, bool> || std::is_same_v<V, int64_t> ||
                               std::is_same_v<V, double>) {
            return fmt::format("{}", x);
          } else {
            return x ? fmt::format("{}", *x) : "none";
          }
        },
        member);
  }
  std::string where_;
  std::vector<std::pair<std::string, std::string>> seen_;
};

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

// HF's parallelism_config (Accelerate's ParallelismConfig, as JSON): its sp_size is
// sequence_parallel_size (sp_backend deepspeed: ALST's Ulysses). Applied after the other
// options, so that a sequence_parallel_size given beside it anywhere must agree with it.
void apply_parallelism_config(Args& args, const std::string& text, const std::string& where) {
  const std::string canonical = config::canonical_value(text);
  if (canonical.empty() || canonical == "none" || canonical == "{}") return;
  const std::string name = where + "parallelism_config";
  rapidjson::Document doc = json::parse(text, name);
  if (!doc.IsObject()) {
    throw ConfigError(fmt::format("{}: give an object such as {{\"sp_size\": 2}}", name));
  }
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    const std::string key(it->name.GetString(), it->name.GetStringLength());
    const rapidjson::Value& v = it->value;
    const bool size_key = key == "sp_size" || key == "tp_size" || key == "cp_size" ||
                          key == "dp_replicate_size" || key == "dp_shard_size";
    if (size_key &&
        !(v.IsInt64() && (v.GetInt64() >= 1 || (key == "dp_shard_size" && v.GetInt64() == -1)))) {
      throw ConfigError(
          fmt::format("{}.{}: {} is not a degree (an integer ≥ 1)", name, key, json::render(v)));
    }
    if (key == "sp_size") {
      const int64_t size = v.GetInt64();
      const bool given = args.is_given("sequence_parallel_size") ||
                         args.is_given("ds_sequence_parallel_size") ||
                         args.sequence_parallel_size != 1;
      if (given && args.sequence_parallel_size != size) {
        throw ConfigError(fmt::format(
            "{}.sp_size {} and sequence_parallel_size {} name the same option with different "
            "values; give one of them",
            name, size, args.sequence_parallel_size));
      }
      args.sequence_parallel_size = size;
      args.given.insert("sequence_parallel_size");
    } else if (key == "sp_backend") {
      if (!v.IsString() || std::string(v.GetString()) != "deepspeed") {
        throw ConfigError(fmt::format(
            "{}.sp_backend {}: zerotrain's sequence parallelism is DeepSpeed's Ulysses; give "
            "\"deepspeed\" or leave it out",
            name, json::render(v)));
      }
    } else if (key == "tp_size" || key == "cp_size") {
      if (v.GetInt64() != 1) {
        throw ConfigError(fmt::format(
            "{}.{} {}: zerotrain has no {} parallelism; use sp_size (Ulysses) for long sequences",
            name, key, v.GetInt64(), key == "tp_size" ? "tensor" : "context (ring attention)"));
      }
    } else if (key == "dp_replicate_size" || key == "dp_shard_size" || key == "sp_handler") {
      // The data-parallel ranks are every sequence group's (ZeRO shards over the whole job);
      // sp_handler's sequence length and padding are read from each batch.
    } else {
      throw ConfigError(fmt::format(
          "{}: unknown key '{}' (known: sp_size, sp_backend, sp_handler, tp_size, cp_size, "
          "dp_replicate_size, dp_shard_size)",
          name, key));
    }
  }
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
  AliasCheck aliases("--");
  std::optional<std::string> parallelism;  // HF's parallelism_config, applied last
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
        // An empty parallelism_config is without effect (HF's default); another is read below.
        if (name == "parallelism_config" &&
            !config::is_neutral(*f, config::canonical_value(value))) {
          parallelism = value;
          continue;
        }
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
    aliases.assign(args, *o, v);
  }
  if (parallelism) apply_parallelism_config(args, *parallelism, "--");
  finalize(args, "");
  return positional;
}

namespace {

// The options of one object (an options file, JSON or YAML), `source` naming it.
void apply_training_object(TrainingArguments& args, const rapidjson::Value& doc,
                           const std::string& source) {
  std::string where = source + ": ";
  AliasCheck aliases(where);
  std::optional<std::string> parallelism;  // HF's parallelism_config, applied last
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    std::string name(it->name.GetString(), it->name.GetStringLength());
    if (is_local_rank_flag(name)) continue;
    const Option* o = find_option(name);
    if (o == nullptr) {
      if (const config::ForeignOption* f = config::find_foreign_option(name)) {
        if (name == "parallelism_config" && !config::is_neutral(*f, canonical_json(it->value))) {
          parallelism = it->value.IsString()
                            ? std::string(it->value.GetString(), it->value.GetStringLength())
                            : json::dump(it->value);
          continue;
        }
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
    aliases.assign(args, *o, v);
  }
  if (parallelism) apply_parallelism_config(args, *parallelism, where);
  finalize(args, where);
}

}  // namespace

void apply_training_json(TrainingArguments& args, std::string_view text,
                         const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  if (!doc.IsObject()) {
    throw ConfigError(fmt::format("{}: expected a JSON object of options, found {}", source,
                                  json::type_name(doc)));
  }
  apply_training_object(args, doc, source);
}

void apply_training_yaml(TrainingArguments& args, std::string_view text,
                         const std::string& source) {
  rapidjson::Document doc = yaml::parse(text, source);
  if (doc.IsNull()) doc.SetObject();  // an empty file: no options
  if (!doc.IsObject()) {
    throw ConfigError(fmt::format(
        "{}: expected a YAML mapping of options (name: value) at the top level, found {}", source,
        json::type_name(doc)));
  }
  apply_training_object(args, doc, source);
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

bool is_yaml_path(const std::string& path) {
  const size_t dot = path.rfind('.');
  const std::string ext = dot == std::string::npos ? "" : path.substr(dot);
  return ext == ".yaml" || ext == ".yml";
}

void apply_training_file(TrainingArguments& args, const std::string& path) {
  const std::string text = files::read_text(path, "options file");
  if (is_yaml_path(path)) {
    apply_training_yaml(args, text, path);
  } else {
    apply_training_json(args, text, path);
  }
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
