// LLaMA-Factory's datasets: the names of `dataset` looked up in dataset_dir/dataset_info.json,
// their records read through its formatting, columns and tags into zerotrain's own layouts,
// concatenated, cut to max_samples and split by val_size into the JSONL files train_file and
// eval_file then name (docs/data.md, "LLaMA-Factory's datasets").
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "data/records.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

namespace fs = std::filesystem;

// What the run's stage reads (LLaMA-Factory: sft takes plain datasets, dpo ranking ones, kto
// those with a kto_tag column).
enum class Kind { kSft, kPairs, kKto };

// One dataset: its files and how to read their records. A column or tag left empty is None.
struct Source {
  std::string name;  // as `dataset` names it
  std::vector<std::string> files;
  std::string formatting = "alpaca";  // alpaca | sharegpt | openai | zerotrain (a file as it is)
  bool ranking = false;
  std::optional<int64_t> num_samples;
  std::string prompt = "instruction", query = "input", response = "output", history,
              messages = "conversations", system, tools, chosen, rejected, kto_tag;
  std::string role_tag = "from", content_tag = "value", user_tag = "human", assistant_tag = "gpt",
              observation_tag = "observation", function_tag = "function_call",
              system_tag = "system";
};

// The records of a dataset, in order: each one's JSON text and where it is.
struct RawRecord {
  std::string text;
  std::string where;
};

std::vector<std::string> split_names(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string name = list.substr(start, comma - start);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) out.push_back(name);
    start = comma + 1;
  }
  return out;
}

std::string extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  if (!ext.empty()) ext.erase(0, 1);
  return ext;
}

// The data files of `path`: the file itself, or every file of the folder (names sorted), all of
// one type; zerotrain reads JSON and JSONL.
std::vector<std::string> data_files(const std::string& path, const std::string& what) {
  std::error_code ec;
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
      const std::string file_name = e.path().filename().string();
      if (!file_name.empty() && file_name[0] != '.' && e.is_regular_file(ec)) {
        files.push_back(e.path().string());
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) throw IoError(fmt::format("{}: the folder '{}' holds no file", what, path));
  } else if (fs::exists(path, ec)) {
    files.push_back(path);
  } else {
    throw IoError(fmt::format("{}: '{}' not found", what, path));
  }
  for (const std::string& f : files) {
    const std::string ext = extension(f);
    if (ext != extension(files[0])) {
      throw ConfigError(
          fmt::format("{}: '{}' and '{}' are files of different types; a dataset "
                      "folder holds files of one type",
                      what, files[0], f));
    }
    if (ext != "json" && ext != "jsonl") {
      throw ConfigError(fmt::format(
          "{}: '{}' is a{} {} file; zerotrain reads JSON and JSONL data: convert it (with "
          "Python's datasets: load_dataset(\"{}\", "
          "data_files=...)[\"train\"].to_json(\"data.jsonl\"))",
          what, f, ext == "arrow" ? "n" : "", ext.empty() ? "extensionless" : ext,
          ext == "txt" ? "text" : ext));
    }
  }
  return files;
}

// How to download a Hub dataset, for the message refusing it.
std::string download_advice(const std::string& hub, const std::string& id,
                            const std::string& dataset_dir) {
  const std::string local = dataset_dir + "/" + id.substr(id.rfind('/') + 1);
  if (hub == "hf_hub_url") {
    return fmt::format("huggingface-cli download --repo-type dataset {} --local-dir {}", id, local);
  }
  if (hub == "ms_hub_url")
    return fmt::format("modelscope download --dataset {} --local_dir {}", id, local);
  return fmt::format("download {} from Modelers (openmind) into {}", id, local);
}

// The entry `name` of dataset_info.json, read into a Source.
Source read_entry(const rapidjson::Value& info, const std::string& name, const std::string& dir,
                  const std::string& info_path) {
  Source s;
  s.name = name;
  json::ObjectReader r(info[name.c_str()], name, info_path);
  const std::optional<std::string> file = r.string("file_name");
  for (const char* hub : {"hf_hub_url", "ms_hub_url", "om_hub_url"}) {
    const std::optional<std::string> id = r.string(hub);
    if (!id || file) continue;
    throw ConfigError(fmt::format(
        "dataset '{}': {} names it on a hub ({}: {}); zerotrain reads local files only: download "
        "it ({}) and give its entry a file_name (the file or folder, relative to dataset_dir "
        "'{}') in place of {}",
        name, info_path, hub, *id, download_advice(hub, *id, dir), dir, hub));
  }
  for (const char* remote : {"script_url", "cloud_file_name"}) {
    if (r.has(remote) && !file) {
      throw ConfigError(fmt::format(
          "dataset '{}': {} gives it by {}; zerotrain reads local JSON / JSONL files only: fetch "
          "the data, save it as JSONL and give the entry a file_name",
          name, info_path, remote));
    }
  }
  if (!file) r.fail("file_name", "the data file or folder, relative to dataset_dir");
  r.known({"hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name", "subset",
           "folder"});  // the hub's; a local file_name wins over them
  s.files = data_files(dir + "/" + *file, fmt::format("dataset '{}' ({})", name, info_path));
  s.formatting = r.choice("formatting", {"alpaca", "sharegpt", "openai"}).value_or("alpaca");
  s.ranking = r.boolean("ranking").value_or(false);
  if (const std::optional<std::string> split = r.string("split"); split && *split != "train") {
    r.fail_value("split", fmt::format("\"{}\": a local file is one split, \"train\"", *split));
  }
  s.num_samples = r.integer("num_samples", 1, INT64_MAX / 2);
  if (std::optional<json::ObjectReader> c = r.object("columns")) {
    // Given, the columns replace the defaults: one left out is None, as LLaMA-Factory reads it.
    std::string* const slots[] = {&s.prompt, &s.query, &s.response, &s.history,  &s.messages,
                                  &s.system, &s.tools, &s.chosen,   &s.rejected, &s.kto_tag};
    const char* const names[] = {"prompt", "query", "response", "history",  "messages",
                                 "system", "tools", "chosen",   "rejected", "kto_tag"};
    for (size_t k = 0; k < std::size(names); ++k) *slots[k] = c->string(names[k]).value_or("");
    for (const char* media : {"images", "videos", "audios"}) {
      if (c->string(media)) {
        c->fail_value(media, "multimodal data is not supported: zerotrain trains text models");
      }
    }
    c->reject_unknown("the columns are those of LLaMA-Factory's data/README.md");
  }
  if (std::optional<json::ObjectReader> t = r.object("tags")) {
    std::string* const slots[] = {&s.role_tag,      &s.content_tag,     &s.user_tag,
                                  &s.assistant_tag, &s.observation_tag, &s.function_tag,
                                  &s.system_tag};
    const char* const names[] = {"role_tag",        "content_tag",  "user_tag",  "assistant_tag",
                                 "observation_tag", "function_tag", "system_tag"};
    for (size_t k = 0; k < std::size(names); ++k) *slots[k] = t->string(names[k]).value_or("");
    t->reject_unknown("the tags are those of LLaMA-Factory's data/README.md");
  }
  r.reject_unknown(
      "the keys of a dataset_info.json entry are those of LLaMA-Factory's "
      "data/README.md");
  return s;
}

// A data file (or folder) read as it is: zerotrain's layouts.
Source file_source(const std::string& name, const std::string& path, const std::string& what) {
  Source s;
  s.name = name;
  s.formatting = "zerotrain";
  s.files = data_files(path, what);
  return s;
}

// The datasets `list` names: entries of dataset_dir/dataset_info.json, or data files read as
// they are (zerotrain's layouts).
std::vector<Source> sources(const std::string& list, const std::string& dir, Kind kind,
                            const char* option) {
  const std::string info_path = dir + "/dataset_info.json";
  std::error_code ec;
  std::optional<rapidjson::Document> info;
  if (fs::exists(info_path, ec)) {
    info = json::parse(files::read_text(info_path, "dataset_info.json"), info_path);
    if (!info->IsObject()) {
      throw ConfigError(fmt::format("{}: expected an object of dataset entries, found {}",
                                    info_path, json::type_name(*info)));
    }
  }
  std::vector<Source> out;
  for (const std::string& name : split_names(list)) {
    if (info && info->HasMember(name.c_str())) {
      out.push_back(read_entry(*info, name, dir, info_path));
    } else if (fs::is_regular_file(name, ec) || fs::is_regular_file(dir + "/" + name, ec)) {
      out.push_back(file_source(name, fs::is_regular_file(name, ec) ? name : dir + "/" + name,
                                fmt::format("{} '{}'", option, name)));
      continue;
    } else {
      throw ConfigError(fmt::format(
          "{} '{}': not an entry of {}{} and not a data file; a dataset on a hub (Hugging Face, "
          "ModelScope) is not downloaded by zerotrain: download it (huggingface-cli download "
          "--repo-type dataset {} --local-dir {}/{}), then add an entry with its file_name to "
          "dataset_info.json, or name the file itself",
          option, name, info_path, info ? "" : " (there is no such file: set dataset_dir)", name,
          dir, name.substr(name.rfind('/') + 1)));
    }
    const Source& s = out.back();
    // LLaMA-Factory's rule: pairs for DPO only, and not elsewhere.
    if (kind == Kind::kPairs && !s.ranking) {
      throw ConfigError(fmt::format(
          "dataset '{}' is not a preference dataset (its entry has no \"ranking\": true); stage "
          "dpo trains on pairs",
          name));
    }
    if (kind != Kind::kPairs && s.ranking) {
      throw ConfigError(fmt::format(
          "dataset '{}' is a preference dataset (\"ranking\": true); it trains with stage dpo",
          name));
    }
    if (kind == Kind::kPairs && (s.chosen.empty() || s.rejected.empty())) {
      throw ConfigError(fmt::format(
          "dataset '{}': a ranking dataset needs columns \"chosen\" and \"rejected\"", name));
    }
    if (kind != Kind::kPairs && s.formatting == "alpaca" && s.response.empty()) {
      throw ConfigError(fmt::format(
          "dataset '{}': no \"response\" column (its columns leave it out): there is no answer "
          "to train on",
          name));
    }
    if (kind == Kind::kKto && s.kto_tag.empty()) {
      throw ConfigError(fmt::format(
          "dataset '{}': stage kto needs a \"kto_tag\" column (whether each answer is desirable)",
          name));
    }
    if (s.formatting != "alpaca" &&
        (s.messages.empty() || s.role_tag.empty() || s.content_tag.empty())) {
      throw ConfigError(
          fmt::format("dataset '{}': {} needs the column \"messages\" and the tags "
                      "\"role_tag\" and \"content_tag\"",
                      name, s.formatting));
    }
  }
  return out;
}

// ---- one record ----------------------------------------------------------------------------

using Alloc = rapidjson::Document::AllocatorType;

rapidjson::Value text_value(const std::string& s, Alloc& a) {
  return rapidjson::Value(s.data(), static_cast<rapidjson::SizeType>(s.size()), a);
}

// The text in `column`: "" when the column is None, absent or null (falsy, as LLaMA-Factory
// reads it).
std::string text_or_empty(json::ObjectReader& r, const std::string& column) {
  if (column.empty()) return "";
  const rapidjson::Value* v = r.find(column.c_str());
  if (v == nullptr || v->IsNull()) return "";
  if (!v->IsString()) r.fail(column, "a string");
  return json::text(*v);
}

// A KTO tag: true or false.
bool kto_label(json::ObjectReader& r, const std::string& column) {
  const std::optional<bool> label = r.boolean(column.c_str());
  if (!label) r.fail(column, "true or false (the kto_tag: whether the answer is desirable)");
  return *label;
}

void alpaca(json::ObjectReader& r, const Source& s, Kind kind, rapidjson::Document& out) {
  Alloc& a = out.GetAllocator();
  std::string instruction = text_or_empty(r, s.prompt), input = text_or_empty(r, s.query);
  if (instruction.empty()) std::swap(instruction, input);  // the user's text is "prompt\nquery"
  out.AddMember("instruction", text_value(instruction, a), a);
  out.AddMember("input", text_value(input, a), a);
  if (const std::string system = text_or_empty(r, s.system); !system.empty()) {
    out.AddMember("system", text_value(system, a), a);
  }
  if (!s.history.empty()) {
    if (const rapidjson::Value* h = r.find(s.history.c_str()); h != nullptr && !h->IsNull()) {
      out.AddMember("history", rapidjson::Value(*h, a), a);
    }
  }
  if (kind == Kind::kPairs) {
    out.AddMember("chosen", text_value(r.required_string(s.chosen.c_str()), a), a);
    out.AddMember("rejected", text_value(r.required_string(s.rejected.c_str()), a), a);
    return;
  }
  out.AddMember("output", text_value(r.required_string(s.response.c_str()), a), a);
  if (kind == Kind::kKto) out.AddMember("label", kto_label(r, s.kto_tag), a);
}

// A message of the dataset's own tags as ShareGPT's {"from", "value"}; `want_user` says which
// side of the exchange its position is (users and tool results odd, replies even).
rapidjson::Value message(const rapidjson::Value& m, const std::string& path, const Source& s,
                         bool want_user, const std::string& where, Alloc& a) {
  json::ObjectReader r(m, path, where);
  const std::string role = r.required_string(s.role_tag.c_str());
  const rapidjson::Value* content = r.find(s.content_tag.c_str());
  if (content == nullptr || !(content->IsString() || content->IsArray())) {
    r.fail(s.content_tag, "the message's text");
  }
  const char* from = nullptr;
  if (!s.user_tag.empty() && role == s.user_tag) {
    from = "human";
  } else if (!s.assistant_tag.empty() && role == s.assistant_tag) {
    from = "gpt";
  } else if ((!s.observation_tag.empty() && role == s.observation_tag) ||
             (!s.function_tag.empty() && role == s.function_tag)) {
    r.fail_value(s.role_tag, fmt::format("\"{}\": tool calls and their results are not trained "
                                         "by zerotrain (its templates render user and assistant "
                                         "turns)",
                                         role));
  } else {
    r.fail_value(
        s.role_tag,
        fmt::format("\"{}\" is none of the dataset's tags (user_tag \"{}\", "
                    "assistant_tag \"{}\"{})",
                    role, s.user_tag, s.assistant_tag,
                    s.system_tag.empty()
                        ? ""
                        : fmt::format(", system_tag \"{}\" as the first message", s.system_tag)));
  }
  if ((from[0] == 'h') != want_user) {
    r.fail_value(s.role_tag, fmt::format("\"{}\" out of turn: users ({}) and the assistant ({}) "
                                         "alternate, starting with the user",
                                         role, s.user_tag, s.assistant_tag));
  }
  rapidjson::Value out(rapidjson::kObjectType);
  out.AddMember("from", rapidjson::StringRef(from), a);
  out.AddMember("value", rapidjson::Value(*content, a), a);
  return out;
}

void sharegpt(json::ObjectReader& r, const Source& s, Kind kind, const std::string& where,
              rapidjson::Document& out) {
  Alloc& a = out.GetAllocator();
  const rapidjson::Value* list = r.find(s.messages.c_str());
  if (list == nullptr || !list->IsArray() || list->Empty()) {
    r.fail(s.messages, "a non-empty list of messages");
  }
  rapidjson::SizeType first = 0;
  std::string system = text_or_empty(r, s.system);
  const rapidjson::Value& m0 = (*list)[0];
  if (!s.system_tag.empty() && m0.IsObject() && m0.HasMember(s.role_tag.c_str()) &&
      m0[s.role_tag.c_str()].IsString() && json::text(m0[s.role_tag.c_str()]) == s.system_tag) {
    json::ObjectReader m(m0, s.messages + "[0]", where);
    system = m.required_string(s.content_tag.c_str());
    first = 1;
  }
  if (const std::string tools = text_or_empty(r, s.tools); !tools.empty()) {
    r.fail_value(s.tools,
                 "tool descriptions are not supported: zerotrain's templates render no "
                 "tools");
  }
  rapidjson::Value conversation(rapidjson::kArrayType);
  for (rapidjson::SizeType i = first; i < list->Size(); ++i) {
    conversation.PushBack(message((*list)[i], fmt::format("{}[{}]", s.messages, i), s,
                                  (i - first) % 2 == 0, where, a),
                          a);
  }
  // Exchanges end with the assistant's reply; a ranking prompt ends with the user's turn.
  const bool ends_with_user = conversation.Size() % 2 == 1;
  if (ends_with_user != (kind == Kind::kPairs)) {
    r.fail_value(s.messages, kind == Kind::kPairs
                                 ? "must end with the user's turn (the prompt the chosen and "
                                   "rejected answers reply to)"
                                 : "must end with the assistant's reply");
  }
  out.AddMember("conversations", conversation, a);
  if (!system.empty()) out.AddMember("system", text_value(system, a), a);
  if (kind == Kind::kPairs) {
    for (const std::string* column : {&s.chosen, &s.rejected}) {
      const rapidjson::Value* answer = r.find(column->c_str());
      if (answer == nullptr || !answer->IsObject()) r.fail(*column, "a message object");
      out.AddMember(text_value(column == &s.chosen ? "chosen" : "rejected", a),
                    message(*answer, *column, s, false, where, a), a);
    }
  }
  if (kind == Kind::kKto) out.AddMember("label", kto_label(r, s.kto_tag), a);
}

// One record in zerotrain's layout, as one JSONL line.
std::string convert(const RawRecord& raw, const Source& s, Kind kind) {
  rapidjson::Document in = json::parse(raw.text, raw.where);
  if (s.formatting == "zerotrain") return json::dump(in);
  json::ObjectReader r(in, "", raw.where);
  rapidjson::Document out(rapidjson::kObjectType);
  if (s.formatting == "alpaca") {
    alpaca(r, s, kind, out);
  } else {
    sharegpt(r, s, kind, raw.where, out);
  }
  return json::dump(out);
}

// ---- datasets ------------------------------------------------------------------------------

// The records of one dataset, after num_samples and max_samples, converted; malformed ones
// skipped and counted with skip_bad_lines.
std::vector<std::string> read_dataset(const Source& s, Kind kind, const TrainingArguments& args,
                                      int64_t* skipped, std::string* first_error) {
  std::vector<RawRecord> raw;
  for (const std::string& file : s.files) {
    data::RecordReader reader(file);
    for (data::Record record; reader.next(record);) {
      raw.push_back({std::move(record.text), reader.where(record)});
    }
  }
  if (s.num_samples) {  // a seeded choice of records: all of them before any repeats
    std::vector<RawRecord> chosen;
    const auto n = static_cast<int64_t>(raw.size());
    const std::vector<int64_t> order = epoch_order(n, static_cast<uint64_t>(args.seed), 0, true);
    for (int64_t k = 0; n > 0 && k < *s.num_samples; ++k) chosen.push_back(raw[order[k % n]]);
    raw = std::move(chosen);
  }
  if (args.max_samples && static_cast<int64_t>(raw.size()) > *args.max_samples) {
    raw.resize(static_cast<size_t>(*args.max_samples));
  }
  std::vector<std::string> lines;
  lines.reserve(raw.size());
  for (const RawRecord& record : raw) {
    try {
      lines.push_back(convert(record, s, kind));
    } catch (const ConfigError& e) {
      if (!args.skip_bad_lines) {
        throw ConfigError(fmt::format(
            "{} (dataset '{}'; fix the record, or set skip_bad_lines to skip malformed ones)",
            e.what(), s.name));
      }
      if ((*skipped)++ == 0) *first_error = e.what();
    }
  }
  return lines;
}

struct Loaded {
  std::vector<std::string> lines;
  std::string names;  // for the file name and the log
};

Loaded load(const std::vector<Source>& list, Kind kind, const TrainingArguments& args,
            std::vector<std::string>& log) {
  Loaded out;
  for (const Source& s : list) {
    int64_t skipped = 0;
    std::string first_error;
    std::vector<std::string> lines = read_dataset(s, kind, args, &skipped, &first_error);
    if (skipped > 0) {
      log::warn("dataset '{}': skipped {} malformed record(s) (skip_bad_lines); the first: {}",
                s.name, skipped, first_error);
    }
    log.push_back(fmt::format(
        "dataset '{}' ({}{}, {}): {} records", s.name, s.files[0],
        s.files.size() > 1 ? fmt::format(" and {} more", s.files.size() - 1) : "",
        s.formatting == "zerotrain" ? "zerotrain's layouts" : s.formatting, lines.size()));
    out.lines.insert(out.lines.end(), std::make_move_iterator(lines.begin()),
                     std::make_move_iterator(lines.end()));
    out.names += (out.names.empty() ? "" : "+") + s.name;
  }
  return out;
}

uint64_t fnv1a(const std::string& s, uint64_t h = 0xcbf29ce484222325ULL) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// Writes `lines` as JSONL under `dir`, named by the datasets and the content (the same data
// is the same file, whichever rank or run writes it); returns the path.
std::string write_jsonl(const std::vector<std::string>& lines, const std::string& names,
                        const char* part, const std::string& dir, bool write) {
  std::string content;
  for (const std::string& line : lines) content += line + "\n";
  std::string stem;
  for (char c : names.substr(0, 64)) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '_' || c == '-' || c == '+';
    stem.push_back(plain ? c : '_');
  }
  const std::string path = fmt::format("{}/{}.{}-{:016x}.jsonl", dir, stem, part, fnv1a(content));
  if (write) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw IoError(fmt::format("cannot create '{}': {}", dir, ec.message()));
    files::write_atomic(path, content);
  }
  return path;
}

}  // namespace

std::vector<std::string> prepare_datasets(TrainingArguments& args, bool write) {
  const bool names = !args.dataset.empty() || !args.eval_dataset.empty();
  if (!names && args.val_size == 0 && !args.max_samples) return {};
  const Kind kind = args.stage == "dpo"   ? Kind::kPairs
                    : args.stage == "kto" ? Kind::kKto
                                          : Kind::kSft;
  if (!args.dataset.empty() && !args.train_file.empty()) {
    throw ConfigError(fmt::format(
        "dataset ({}) and train_file ({}) both name the training data; give one of them",
        args.dataset, args.train_file));
  }
  if (!args.eval_dataset.empty() && !args.eval_file.empty()) {
    throw ConfigError(fmt::format(
        "eval_dataset ({}) and eval_file ({}) both name the evaluation data; give one of them",
        args.eval_dataset, args.eval_file));
  }
  if (args.val_size > 0) {
    if (!args.eval_dataset.empty() || !args.eval_file.empty()) {
      throw ConfigError(fmt::format(
          "val_size {} holds training records out for evaluation, and {} gives evaluation data "
          "too; give one of them",
          args.val_size, args.eval_dataset.empty() ? "eval_file" : "eval_dataset"));
    }
    if (args.val_size >= 1 && std::floor(args.val_size) != args.val_size) {
      throw ConfigError(
          fmt::format("val_size {}: a share of the records below 1, or a whole "
                      "number of records",
                      args.val_size));
    }
    if (args.dataset.empty() && args.train_file.empty()) {
      throw ConfigError("val_size needs training data to split: give dataset or train_file");
    }
  }
  const std::string cache =
      (args.cache_dir.empty() ? args.output_dir + "/.cache" : args.cache_dir) + "/datasets";
  std::vector<std::string> log;
  // The training data: the datasets named, or train_file when max_samples or val_size apply.
  if (!args.dataset.empty() || !args.train_file.empty()) {
    const std::vector<Source> list =
        !args.dataset.empty()
            ? sources(args.dataset, args.dataset_dir, kind, "dataset")
            : std::vector<Source>{file_source(args.train_file, args.train_file, "train_file")};
    Loaded train = load(list, kind, args, log);
    std::vector<std::string> held_out;
    if (args.val_size > 0) {
      const auto n = static_cast<int64_t>(train.lines.size());
      // HF's train_test_split: a share rounds the held-out count up.
      const int64_t eval =
          args.val_size < 1
              ? static_cast<int64_t>(std::ceil(args.val_size * static_cast<double>(n)))
              : static_cast<int64_t>(args.val_size);
      if (eval < 1 || eval >= n) {
        throw ConfigError(fmt::format(
            "val_size {} of {} training records leaves {} for training and {} for evaluation; "
            "each needs at least one",
            args.val_size, n, n - eval, eval));
      }
      // A seeded choice of records; both parts keep the datasets' order.
      const std::vector<int64_t> order = epoch_order(n, static_cast<uint64_t>(args.seed), 0, true);
      std::vector<bool> is_eval(static_cast<size_t>(n), false);
      for (int64_t k = 0; k < eval; ++k) is_eval[static_cast<size_t>(order[k])] = true;
      std::vector<std::string> kept;
      for (int64_t i = 0; i < n; ++i) {
        (is_eval[i] ? held_out : kept).push_back(std::move(train.lines[i]));
      }
      train.lines = std::move(kept);
    }
    if (train.lines.empty()) {
      throw ConfigError(fmt::format("dataset {}: no record to train on", train.names));
    }
    args.train_file = write_jsonl(train.lines, train.names, "train", cache, write);
    args.given.insert("train_file");
    log.push_back(fmt::format("training data: {} records of {} in {}", train.lines.size(),
                              train.names, args.train_file));
    if (!held_out.empty()) {
      args.eval_file = write_jsonl(held_out, train.names, "eval", cache, write);
      args.given.insert("eval_file");
      log.push_back(fmt::format("val_size {}: {} records held out for evaluation in {}",
                                args.val_size, held_out.size(), args.eval_file));
    }
  }
  if (!args.eval_dataset.empty() ||
      (args.max_samples && !args.eval_file.empty() && args.val_size == 0)) {
    const std::vector<Source> list =
        !args.eval_dataset.empty()
            ? sources(args.eval_dataset, args.dataset_dir, kind, "eval_dataset")
            : std::vector<Source>{file_source(args.eval_file, args.eval_file, "eval_file")};
    Loaded eval = load(list, kind, args, log);
    if (eval.lines.empty()) {
      throw ConfigError(fmt::format("eval_dataset {}: no record to evaluate on", eval.names));
    }
    args.eval_file = write_jsonl(eval.lines, eval.names, "eval", cache, write);
    args.given.insert("eval_file");
    log.push_back(fmt::format("evaluation data: {} records of {} in {}", eval.lines.size(),
                              eval.names, args.eval_file));
  }
  return log;
}

}  // namespace zt
