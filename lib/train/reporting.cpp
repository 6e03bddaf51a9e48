// trainer_state.json, trainer_log.jsonl records and loss.svg.
#include "train/reporting.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "util/files.hpp"
#include "util/json.hpp"
#include "util/limits.hpp"

namespace zt {

namespace {

template <typename Writer>
void write_record(Writer& w, const LogRecord& r) {
  auto number = [&](const char* key, const std::optional<double>& v) {
    if (!v) return;
    w.Key(key);
    if (std::isfinite(*v)) {
      w.Double(*v);
    } else {
      w.Null();  // JSON has no inf/nan (an fp16 overflow step has no norm)
    }
  };
  w.StartObject();
  w.Key("step");
  w.Int64(r.step);
  w.Key("epoch");
  w.Double(r.epoch);
  number("loss", r.loss);
  number("learning_rate", r.learning_rate);
  number("grad_norm", r.grad_norm);
  number("tokens_per_second", r.tokens_per_second);
  number("loss_scale", r.loss_scale);
  number("peak_memory_gib", r.peak_memory_gib);
  number("eval_loss", r.eval_loss);
  number("train_loss", r.train_loss);
  number("train_runtime", r.train_runtime);
  for (const auto& [key, value] : r.metrics) number(key.c_str(), value);
  w.EndObject();
}

}  // namespace

std::string LogRecord::json() const {
  rapidjson::StringBuffer buf;
  rapidjson::Writer<rapidjson::StringBuffer> w(buf);
  write_record(w, *this);
  return std::string(buf.GetString(), buf.GetSize());
}

namespace train {

std::string trainer_state_json(const TrainerState& s) {
  // HF's TrainerState.load_from_json is `TrainerState(**json)`: every key must be one of its
  // fields (transformers 4.40-5.x), so zerotrain's own state lives in zerotrain_state.json.
  rapidjson::StringBuffer buf;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buf);
  w.SetIndent(' ', 2);
  auto optional_int = [&](const char* key, const std::optional<int64_t>& v) {
    w.Key(key);
    v ? w.Int64(*v) : w.Null();
  };
  w.StartObject();
  optional_int("best_global_step", s.best_global_step);
  w.Key("best_metric");
  s.best_metric ? w.Double(*s.best_metric) : w.Null();
  w.Key("best_model_checkpoint");
  s.best_model_checkpoint ? w.String(s.best_model_checkpoint->c_str()) : w.Null();
  w.Key("epoch");
  w.Double(s.epoch);
  w.Key("eval_steps");
  w.Int64(s.eval_steps);
  w.Key("global_step");
  w.Int64(s.global_step);
  w.Key("is_hyper_param_search");
  w.Bool(false);
  w.Key("is_local_process_zero");
  w.Bool(true);
  w.Key("is_world_process_zero");
  w.Bool(true);
  w.Key("log_history");
  w.StartArray();
  for (const LogRecord& r : s.log_history) write_record(w, r);
  w.EndArray();
  w.Key("logging_steps");
  w.Int64(s.logging_steps);
  w.Key("max_steps");
  w.Int64(s.max_steps);
  w.Key("num_input_tokens_seen");
  w.Int64(s.tokens_seen);
  w.Key("num_train_epochs");
  w.Int64(static_cast<int64_t>(std::ceil(s.num_train_epochs)));  // HF keeps whole epochs here
  w.Key("save_steps");
  w.Int64(s.save_steps);
  w.Key("stateful_callbacks");
  w.StartObject();
  w.EndObject();
  w.Key("total_flos");
  w.Double(s.total_flos);
  w.Key("train_batch_size");
  w.Int64(s.train_batch_size);
  w.Key("trial_name");
  w.Null();
  w.Key("trial_params");
  w.Null();
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize()) + "\n";
}

std::string zerotrain_state_json(const TrainerState& s) {
  rapidjson::StringBuffer buf;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buf);
  w.SetIndent(' ', 2);
  w.StartObject();
  w.Key("format");
  w.String("zerotrain-trainer-state");
  w.Key("version");
  w.Int(1);
  w.Key("world_size");
  w.Int(s.world_size);
  w.Key("global_batch_size");
  w.Int64(s.global_batch_size);
  w.Key("gradient_accumulation_steps");
  w.Int64(s.gradient_accumulation_steps);
  w.Key("epoch_index");
  w.Int64(s.epoch_index);
  w.Key("steps_in_epoch");
  w.Int64(s.steps_in_epoch);
  w.Key("data_seed");
  w.Int64(s.data_seed);
  w.Key("tokens_seen");
  w.Int64(s.tokens_seen);
  w.Key("train_loss_sum");
  std::isfinite(s.train_loss_sum) ? w.Double(s.train_loss_sum) : w.Null();
  w.Key("train_loss_steps");
  w.Int64(s.train_loss_steps);
  w.Key("finetuning_type");
  w.String(s.finetuning_type.c_str());
  if (!s.run_id.empty()) {
    w.Key("run_id");
    w.String(s.run_id.c_str());
  }
  if (!s.save_id.empty()) {
    w.Key("save_id");
    w.String(s.save_id.c_str());
  }
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize()) + "\n";
}

namespace {

// The keys write_record writes for LogRecord's own fields; any other is a named metric.
const std::set<std::string> kRecordKeys{"step",          "epoch",           "loss",
                                        "learning_rate", "grad_norm",       "tokens_per_second",
                                        "loss_scale",    "peak_memory_gib", "eval_loss",
                                        "train_loss",    "train_runtime"};

int64_t need_int(json::ObjectReader& o, const char* key, int64_t min,
                 int64_t max = limits::kMaxSteps) {
  std::optional<int64_t> v = o.integer(key, min, max);
  if (!v) o.fail(key, "an integer");
  return *v;
}

// The run's loss as a log history tells it, for checkpoints that did not save it: each training
// record's loss is the mean over the steps since the record before (steps after the last record
// are not in it).
void logged_run_loss(TrainerState& s) {
  int64_t last = 0;
  for (const LogRecord& r : s.log_history) {
    if (!r.loss || r.step <= last) continue;
    s.train_loss_sum += *r.loss * static_cast<double>(r.step - last);
    s.train_loss_steps += r.step - last;
    last = r.step;
  }
}

// The resume position, from zerotrain_state.json or the older "zerotrain" object.
void read_position(json::ObjectReader& z, TrainerState& s) {
  s.world_size = static_cast<int>(need_int(z, "world_size", 1, 1 << 20));
  s.global_batch_size = need_int(z, "global_batch_size", 1);
  s.gradient_accumulation_steps = need_int(z, "gradient_accumulation_steps", 1);
  s.epoch_index = need_int(z, "epoch_index", 0);
  s.steps_in_epoch = need_int(z, "steps_in_epoch", 0);
  s.data_seed = need_int(z, "data_seed", 0);
  s.tokens_seen = need_int(z, "tokens_seen", 0, int64_t{1} << 62);
  s.finetuning_type = z.string("finetuning_type").value_or("full");
  s.run_id = z.string("run_id").value_or("");
  s.save_id = z.string("save_id").value_or("");
  if (std::optional<int64_t> steps = z.integer("train_loss_steps", 0, limits::kMaxSteps)) {
    s.train_loss_steps = *steps;
    // null: a loss that was not finite (an fp16 overflow), which the sum keeps
    s.train_loss_sum = z.number("train_loss_sum").value_or(std::nan(""));
  } else {
    logged_run_loss(s);
  }
}

}  // namespace

TrainerState read_trainer_state(const std::string& checkpoint_dir) {
  const std::string path = checkpoint_dir + "/trainer_state.json";
  rapidjson::Document doc = json::parse(files::read_text(path, "trainer state"), path);
  json::ObjectReader r(doc, "", path);
  TrainerState s;
  s.global_step = need_int(r, "global_step", 0, limits::kMaxSteps);
  s.epoch = r.number("epoch", 0.0).value_or(0.0);
  s.max_steps = r.integer("max_steps", -1, limits::kMaxSteps).value_or(0);
  s.logging_steps = r.integer("logging_steps", -1, limits::kMaxSteps).value_or(0);
  s.eval_steps = r.integer("eval_steps", -1, limits::kMaxSteps).value_or(0);
  s.save_steps = r.integer("save_steps", -1, limits::kMaxSteps).value_or(0);
  s.train_batch_size = r.integer("train_batch_size", -1, limits::kMaxSteps).value_or(0);
  s.num_train_epochs = r.number("num_train_epochs").value_or(0.0);
  s.total_flos = r.number("total_flos").value_or(0.0);
  s.best_metric = r.number("best_metric");
  s.best_model_checkpoint = r.string("best_model_checkpoint");
  s.best_global_step = r.integer("best_global_step", 0, limits::kMaxSteps);
  if (const rapidjson::Value* h = r.find("log_history"); h != nullptr) {
    if (!h->IsArray()) r.fail("log_history", "an array");
    for (const auto& item : h->GetArray()) {
      json::ObjectReader e(item, "log_history[]", path);
      // Each record as it was written (a resumed run writes the history again:
      // trainer_log.jsonl), a value that was not finite, written null, included.
      const auto value = [&](const char* key) -> std::optional<double> {
        if (item.IsObject() && item.HasMember(key) && item[key].IsNull()) return std::nan("");
        return e.number(key);
      };
      LogRecord rec;
      rec.step = e.integer("step", 0, limits::kMaxSteps).value_or(0);
      rec.epoch = e.number("epoch").value_or(0.0);
      rec.loss = value("loss");
      rec.learning_rate = value("learning_rate");
      rec.grad_norm = value("grad_norm");
      rec.tokens_per_second = value("tokens_per_second");
      rec.loss_scale = value("loss_scale");
      rec.peak_memory_gib = value("peak_memory_gib");
      rec.eval_loss = value("eval_loss");
      rec.train_loss = value("train_loss");
      rec.train_runtime = value("train_runtime");
      // Named metrics: every other number (TRL's rewards/..., logps/..., kl; eval_ ones in
      // evaluation records).
      for (auto it = item.MemberBegin(); it != item.MemberEnd(); ++it) {
        const std::string key = json::text(it->name);
        if (kRecordKeys.count(key) != 0 || !(it->value.IsNumber() || it->value.IsNull())) {
          continue;
        }
        rec.metrics[key] = it->value.IsNull() ? std::nan("") : it->value.GetDouble();
      }
      s.log_history.push_back(rec);
    }
  }
  if (std::optional<json::ObjectReader> z = r.object("zerotrain")) {
    read_position(*z, s);
    return s;
  }
  const std::string zpath = checkpoint_dir + "/zerotrain_state.json";
  rapidjson::Document zdoc = json::parse(files::read_text(zpath, "zerotrain trainer state"), zpath);
  json::ObjectReader z(zdoc, "", zpath);
  if (z.string("format").value_or("") != "zerotrain-trainer-state") {
    z.fail("format", "\"zerotrain-trainer-state\" (was this checkpoint written by zerotrain?)");
  }
  read_position(z, s);
  return s;
}

std::string loss_svg(const std::vector<LogRecord>& history) {
  std::vector<std::pair<double, double>> train, eval;
  for (const LogRecord& r : history) {
    if (r.loss && std::isfinite(*r.loss)) train.emplace_back(static_cast<double>(r.step), *r.loss);
    if (r.eval_loss && std::isfinite(*r.eval_loss))
      eval.emplace_back(static_cast<double>(r.step), *r.eval_loss);
  }
  constexpr double kW = 640, kH = 400, kLeft = 64, kRight = 16, kTop = 32, kBottom = 48;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  bool any = false;
  for (const auto* series : {&train, &eval}) {
    for (const auto& [x, y] : *series) {
      if (!any) {
        x0 = x1 = x;
        y0 = y1 = y;
        any = true;
      }
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  }
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad, y1 += pad;
  auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * (kW - kLeft - kRight); };
  auto py = [&](double y) { return kTop + (y1 - y) / (y1 - y0) * (kH - kTop - kBottom); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} "
      "{1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"20\" font-size=\"14\">loss</text>\n",
      kW, kH, kLeft);
  // Axes with five ticks each.
  svg += fmt::format("<path d=\"M{0} {1} V{2} H{3}\" stroke=\"black\" fill=\"none\"/>\n", kLeft,
                     kTop, kH - kBottom, kW - kRight);
  for (int i = 0; i <= 4; ++i) {
    const double x = x0 + (x1 - x0) * i / 4, y = y0 + (y1 - y0) * i / 4;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n",
                       px(x), kH - kBottom + 18, x);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n",
                       kLeft - 6, py(y) + 4, y);
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{1:.1f}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/>\n",
        kLeft, kW - kRight, py(y));
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">step</text>\n",
                     (kLeft + kW - kRight) / 2, kH - 8);
  if (!train.empty()) {
    std::string points;
    for (const auto& [x, y] : train) points += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
    svg += fmt::format(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        points);
  }
  for (const auto& [x, y] : eval) {
    svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"#ff7f0e\"/>\n", px(x),
                       py(y));
  }
  svg += fmt::format(
      "<text x=\"{0}\" y=\"{1}\" fill=\"#1f77b4\">— training loss</text>\n"
      "<text x=\"{2}\" y=\"{1}\" fill=\"#ff7f0e\">● eval loss</text>\n</svg>\n",
      kW - 260, kTop - 12, kW - 130);
  return svg;
}

std::string describe(const LogRecord& r, int64_t total_steps) {
  std::string line = fmt::format("step {}/{} | epoch {:.2f}", r.step, total_steps, r.epoch);
  if (r.loss) line += fmt::format(" | loss {:.4f}", *r.loss);
  if (r.eval_loss) line += fmt::format(" | eval_loss {:.4f}", *r.eval_loss);
  if (r.learning_rate) line += fmt::format(" | lr {:.3e}", *r.learning_rate);
  if (r.grad_norm) line += fmt::format(" | grad_norm {:.3f}", *r.grad_norm);
  if (r.tokens_per_second) line += fmt::format(" | {:.0f} tokens/s", *r.tokens_per_second);
  if (r.loss_scale && *r.loss_scale != 1.0)
    line += fmt::format(" | loss_scale {:g}", *r.loss_scale);
  if (r.peak_memory_gib) line += fmt::format(" | peak {:.1f} GiB", *r.peak_memory_gib);
  if (r.train_loss) line += fmt::format(" | train_loss {:.4f}", *r.train_loss);
  if (r.train_runtime) line += fmt::format(" | runtime {:.1f} s", *r.train_runtime);
  for (const auto& [key, value] : r.metrics) line += fmt::format(" | {} {:.4f}", key, value);
  return line;
}

}  // namespace train
}  // namespace zt
