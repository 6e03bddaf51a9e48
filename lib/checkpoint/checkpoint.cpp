// The engine's optimizer state in a checkpoint, in a world-size-independent layout (the
// checkpoint folders themselves: folders.cpp).
#include "zerotrain/checkpoint.hpp"

#include <algorithm>
#include <charconv>
#include <exception>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "checkpoint/parse_count.hpp"
#include "comm/agreement.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/limits.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {

using checkpoint::parse_count;
using comm::failed_ranks;
using comm::rank_list;
namespace fs = std::filesystem;

namespace checkpoint {

// A non-negative decimal count that fits int64 ("42"); nullopt for anything else.
std::optional<int64_t> parse_count(const std::string& text) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < 0 || text.empty())
    return std::nullopt;
  return v;
}

}  // namespace checkpoint

namespace {

constexpr const char* kLayout = "layout.json";
// Metadata keys of the shard files' checksums (written by the safetensors writer itself).
constexpr const char* kChecksumPrefix = "crc32c:";
// The metadata key (and layout.json key) of the save a shard file belongs to.
constexpr const char* kSaveIdKey = "zerotrain_save_id";

constexpr const char* kFormat = "zerotrain-optimizer-state";
constexpr int kVersion = 1;

std::string rank_file(int rank, int world) {
  return fmt::format("optimizer/rank-{:05d}-of-{:05d}.safetensors", rank, world);
}

// layout.json, parsed.
struct Layout {
  int world = 0;
  int stage = 0;
  std::vector<std::string> kinds;
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameters;
  std::vector<std::string> files;
  EngineState engine;
  std::string save_id;  ///< "" in checkpoints written before save ids
};

Layout read_layout(const std::string& dir) {
  const std::string path = dir + "/" + kLayout;
  rapidjson::Document doc = json::parse(files::read_text(path, "checkpoint layout"), path);
  json::ObjectReader r(doc, "", path);
  Layout l;
  if (r.string("format").value_or("") != kFormat) r.fail("format", fmt::format("\"{}\"", kFormat));
  if (r.integer("version").value_or(0) != kVersion) {
    r.fail_value("version", fmt::format("this zerotrain reads version {}", kVersion));
  }
  l.world = static_cast<int>(r.integer("world_size", 1, 1 << 20).value_or(0));
  l.save_id = r.string("save_id").value_or("");
  l.stage = static_cast<int>(r.integer("stage", 0, 3).value_or(0));
  auto strings = [&](const char* key) {
    std::vector<std::string> out;
    const rapidjson::Value* v = r.find(key);
    if (v == nullptr || !v->IsArray()) r.fail(key, "an array of strings");
    for (const auto& x : v->GetArray()) {
      if (!x.IsString()) r.fail(key, "an array of strings");
      out.emplace_back(json::text(x));
    }
    return out;
  };
  l.kinds = strings("kinds");
  if (l.kinds.empty()) r.fail_value("kinds", "names no state kind (master, exp_avg, ...)");
  l.files = strings("files");
  if (static_cast<int>(l.files.size()) != l.world) r.fail_value("files", "needs one file per rank");
  for (size_t k = 0; k < l.files.size(); ++k) {  // paths inside the checkpoint folder only
    l.files[k] = files::descendant(dir, l.files[k], fmt::format("'{}': files[{}]", path, k));
  }
  const rapidjson::Value* params = r.find("parameters");
  if (params == nullptr || !params->IsArray()) r.fail("parameters", "an array");
  for (const auto& p : params->GetArray()) {
    json::ObjectReader pr(p, "parameters[]", path);
    std::optional<std::string> name = pr.string("name");
    const rapidjson::Value* shape = pr.find("shape");
    if (!name || shape == nullptr || !shape->IsArray()) pr.fail("name", "a name and a shape");
    std::vector<int64_t> dims;
    for (const auto& d : shape->GetArray()) {
      std::optional<int64_t> v = json::as_integer(d);
      if (!v || *v < 0) pr.fail("shape", "non-negative integers");
      dims.push_back(*v);
    }
    l.parameters.emplace_back(*name, std::move(dims));
  }
  std::optional<json::ObjectReader> e = r.object("engine");
  if (!e) r.fail("engine", "an object of counters");
  l.engine.global_steps = e->integer("global_steps", 0, limits::kMaxSteps).value_or(0);
  l.engine.applied_steps = e->integer("applied_steps", 0, limits::kMaxSteps).value_or(0);
  l.engine.micro_steps = e->integer("micro_steps", 0, limits::kMaxSteps).value_or(0);
  l.engine.optimizer_steps = e->integer("optimizer_steps", 0, limits::kMaxSteps).value_or(0);
  l.engine.loss_scale = e->number("loss_scale", 0.0).value_or(1.0);
  l.engine.scaler_iter = e->integer("scaler_iter", 0, limits::kMaxSteps).value_or(0);
  l.engine.scaler_last_overflow_iter =
      e->integer("scaler_last_overflow_iter", -1, limits::kMaxSteps).value_or(-1);
  l.engine.scaler_hysteresis = e->integer("scaler_hysteresis", 0, limits::kMaxSteps).value_or(1);
  return l;
}

std::string layout_json(const Engine& engine, int world, const std::string& save_id) {
  rapidjson::StringBuffer buf;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(buf);
  w.SetIndent(' ', 1);
  w.StartObject();
  w.Key("format");
  w.String(kFormat);
  w.Key("version");
  w.Int(kVersion);
  w.Key("world_size");
  w.Int(world);
  w.Key("save_id");
  w.String(save_id.c_str());
  w.Key("stage");
  w.Int(engine.stage());
  w.Key("kinds");
  w.StartArray();
  for (const std::string& k : engine.state_kinds()) w.String(k.c_str());
  w.EndArray();
  w.Key("files");
  w.StartArray();
  for (int r = 0; r < world; ++r) w.String(rank_file(r, world).c_str());
  w.EndArray();
  w.Key("parameters");
  w.StartArray();
  for (const auto& [name, shape] : engine.trainable_parameters()) {
    w.StartObject();
    w.Key("name");
    w.String(name.c_str());
    w.Key("shape");
    w.StartArray();
    for (int64_t d : shape) w.Int64(d);
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  const EngineState s = engine.state();
  w.Key("engine");
  w.StartObject();
  w.Key("global_steps");
  w.Int64(s.global_steps);
  w.Key("applied_steps");
  w.Int64(s.applied_steps);
  w.Key("micro_steps");
  w.Int64(s.micro_steps);
  w.Key("optimizer_steps");
  w.Int64(s.optimizer_steps);
  w.Key("loss_scale");
  w.Double(s.loss_scale);
  w.Key("scaler_iter");
  w.Int64(s.scaler_iter);
  w.Key("scaler_last_overflow_iter");
  w.Int64(s.scaler_last_overflow_iter);
  w.Key("scaler_hysteresis");
  w.Int64(s.scaler_hysteresis);
  w.EndObject();
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize()) + "\n";
}

// The pieces of every rank's shard file, by parameter name: which file holds which elements.
class StoredState {
 public:
  explicit StoredState(const std::string& dir) : dir_(dir), layout_(read_layout(dir)) {
    for (size_t f = 0; f < layout_.files.size(); ++f) {
      files_.push_back(std::make_unique<SafetensorsFile>(layout_.files[f]));
      const SafetensorsFile& file = *files_.back();
      check_save_id(file);
      for (const auto& [name, begin] : file.metadata()) {
        if (name == "format" || name == kSaveIdKey || name.rfind(kChecksumPrefix, 0) == 0) continue;
        const std::string key = layout_.kinds.front() + "/" + name;
        if (!file.contains(key)) {
          throw IoError(fmt::format(
              "checkpoint file '{}' lists '{}' in its metadata but holds no '{}'; the file is "
              "damaged",
              file.path(), name, key));
        }
        std::optional<int64_t> first = parse_count(begin);
        if (!first) {
          throw IoError(fmt::format(
              "checkpoint file '{}': the metadata of '{}' is \"{}\", not an element offset; "
              "the file is damaged",
              file.path(), name, begin));
        }
        runs_[name].push_back(Run{f, *first, file.info(key).numel});
      }
    }
    check_pieces();
  }

  const Layout& layout() const { return layout_; }

  // Copies elements [begin, begin + out.numel()) of `kind` of `name` into `out`.
  void read(const std::string& kind, const std::string& name, int64_t begin,
            const at::Tensor& out) const {
    const int64_t end = begin + out.numel();
    int64_t covered = 0;
    auto it = runs_.find(name);
    if (it != runs_.end()) {
      for (const Run& run : it->second) {
        const int64_t a = std::max(begin, run.begin), e = std::min(end, run.begin + run.length);
        if (a >= e) continue;
        files_[run.file]->read_range(kind + "/" + name, a - run.begin,
                                     out.narrow(0, a - begin, e - a));
        covered += e - a;
      }
    }
    if (covered != end - begin) {
      throw IoError(
          fmt::format("checkpoint '{}' lacks elements [{}, {}) of '{}' ({}): a shard file is "
                      "missing or from another save",
                      dir_, begin, end, name, kind));
    }
  }

 private:
  struct Run {
    size_t file;
    int64_t begin;
    int64_t length;
  };

  // Every shard file carries the id of the save that wrote layout.json: a file copied in from
  // another save (another step, another run) is refused, naming it.
  void check_save_id(const SafetensorsFile& file) const {
    if (layout_.save_id.empty()) return;  // written before save ids
    const auto& meta = file.metadata();
    auto it = meta.find(kSaveIdKey);
    const std::string found = it == meta.end() ? std::string("none") : it->second;
    if (found != layout_.save_id) {
      throw IoError(fmt::format(
          "checkpoint file '{}' belongs to save {}, but '{}/{}' to save {}: the checkpoint mixes "
          "pieces of different saves; resume from (or merge) an intact checkpoint",
          file.path(), found, dir_, kLayout, layout_.save_id));
    }
  }

  // The pieces of each parameter lie inside it and do not overlap. Every file already carries
  // layout.json's save id (check_save_id), so two files claiming the same elements are one
  // save's pieces tampered with (a shard copied under another rank's name), not another save's.
  void check_pieces() {
    std::map<std::string, int64_t> numel;
    for (const auto& [name, shape] : layout_.parameters) {
      int64_t n = 1;
      for (int64_t d : shape) n = d != 0 && n > INT64_MAX / d ? INT64_MAX : n * d;
      numel[name] = n;
    }
    for (auto& [name, runs] : runs_) {
      std::sort(runs.begin(), runs.end(),
                [](const Run& a, const Run& b) { return a.begin < b.begin; });
      auto size = numel.find(name);
      for (size_t i = 0; i < runs.size(); ++i) {
        const Run& run = runs[i];
        if (size != numel.end() && run.length > size->second - run.begin) {
          throw IoError(fmt::format(
              "checkpoint file '{}': its piece of '{}' (elements [{}, {})) lies outside the {} "
              "elements layout.json gives it; the checkpoint is damaged",
              files_[run.file]->path(), name, run.begin, run.begin + run.length, size->second));
        }
        if (i > 0 && runs[i - 1].begin + runs[i - 1].length > run.begin) {
          const Run& prev = runs[i - 1];
          throw IoError(fmt::format(
              "checkpoint '{}': '{}' and '{}' hold overlapping pieces of '{}' (elements [{}, {}) "
              "and [{}, {})); a save writes each element once, so the checkpoint is damaged or "
              "its files were copied or renamed; resume from (or merge) an intact checkpoint",
              dir_, files_[prev.file]->path(), files_[run.file]->path(), name, prev.begin,
              prev.begin + prev.length, run.begin, run.begin + run.length));
        }
      }
    }
  }

  std::string dir_;
  Layout layout_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::vector<Run>> runs_;
};

class MasterSource final : public ParameterSource {
 public:
  explicit MasterSource(const std::string& dir) : state_(dir) {
    for (const auto& [name, shape] : state_.layout().parameters) names_.insert(name);
  }
  bool has(const std::string& name) const override { return names_.count(name) != 0; }
  void read(const std::string& name, const std::vector<int64_t>& /*shape*/, int64_t offset,
            const at::Tensor& out) override {
    if (out.is_contiguous()) {
      state_.read("master", name, offset, out.view({-1}));
    } else {
      at::Tensor tmp = at::empty({out.numel()}, at::TensorOptions().dtype(at::kFloat));
      state_.read("master", name, offset, tmp);
      out.copy_(tmp.view(out.sizes()));
    }
  }

 private:
  StoredState state_;
  std::set<std::string> names_;
};

}  // namespace

std::string save_engine_state(Engine& engine, const std::string& dir) {
  Communicator& comm = engine.communicator();
  const int world = comm.world_size(), rank = comm.rank();
  // One id for this save on every rank: rank 0 draws 52 random bits (exact in the fp64 sum).
  double drawn = 0;
  if (rank == 0) {
    std::random_device device;
    drawn =
        static_cast<double>(((uint64_t{device()} << 32) ^ device()) & ((uint64_t{1} << 52) - 1));
  }
  const std::string save_id =
      fmt::format("{:013x}", static_cast<uint64_t>(comm::reduce_scalars(comm, {drawn})[0]));
  std::string error;
  try {
    const std::vector<std::string> kinds = engine.state_kinds();
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::map<std::string, std::string> metadata{{"format", "pt"}, {kSaveIdKey, save_id}};
    for (auto& [piece, values] : engine.state_pieces()) {
      metadata[piece.name] = std::to_string(piece.begin);
      for (size_t k = 0; k < kinds.size(); ++k)
        tensors.emplace_back(kinds[k] + "/" + piece.name, values[k]);
    }
    fs::create_directories(dir + "/optimizer");
    save_safetensors(dir + "/" + rank_file(rank, world), tensors, metadata);
    if (rank == 0) files::write_atomic(dir + "/" + kLayout, layout_json(engine, world, save_id));
  } catch (const std::exception& e) {
    error = e.what();
    log::error("rank {}: saving optimizer state into '{}': {}", rank, dir, error);
  }
  std::vector<int> failed = failed_ranks(comm, error.empty());
  if (!failed.empty()) {
    throw IoError(error.empty()
                      ? fmt::format("saving optimizer state into '{}' failed on rank(s) {}", dir,
                                    rank_list(failed))
                      : fmt::format("saving optimizer state into '{}': {}", dir, error));
  }
  return save_id;
}

std::string checkpoint_save_id(const std::string& dir) {
  return read_layout(dir).save_id;
}

EngineState read_engine_state(const std::string& dir) {
  return read_layout(dir).engine;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> checkpoint_parameters(
    const std::string& dir) {
  return read_layout(dir).parameters;
}

void load_engine_state(Engine& engine, const std::string& dir) {
  Communicator& comm = engine.communicator();
  std::exception_ptr error;
  std::unique_ptr<StoredState> stored;
  try {
    stored = std::make_unique<StoredState>(dir);
    const Layout& l = stored->layout();
    if (l.kinds != engine.state_kinds()) {
      throw ConfigError(
          fmt::format("checkpoint '{}' holds optimizer state [{}] but this run's optimizer "
                      "keeps [{}]; resume with the optimizer it was saved with",
                      dir, fmt::join(l.kinds, ", "), fmt::join(engine.state_kinds(), ", ")));
    }
    std::map<std::string, std::vector<int64_t>> saved(l.parameters.begin(), l.parameters.end());
    auto ours = engine.trainable_parameters();
    for (const auto& [name, shape] : ours) {
      auto it = saved.find(name);
      if (it == saved.end()) {
        throw ConfigError(
            fmt::format("checkpoint '{}' has no state for trainable parameter '{}': it was "
                        "saved with another model or fine-tuning method",
                        dir, name));
      }
      if (it->second != shape) {
        throw ConfigError(
            fmt::format("checkpoint '{}': '{}' has shape [{}] there but [{}] in this run "
                        "(another model or adapter configuration?)",
                        dir, name, fmt::join(it->second, ", "), fmt::join(shape, ", ")));
      }
    }
    if (saved.size() != ours.size()) {
      std::set<std::string> mine;
      for (const auto& [name, shape] : ours) mine.insert(name);
      for (const auto& [name, shape] : saved) {
        if (!mine.count(name)) {
          throw ConfigError(
              fmt::format("checkpoint '{}' trains '{}', which this run does not; resume with "
                          "the fine-tuning settings it was saved with",
                          dir, name));
        }
      }
    }
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<int> failed = failed_ranks(comm, error == nullptr);
  if (error) std::rethrow_exception(error);
  if (!failed.empty()) {
    throw IoError(
        fmt::format("reading checkpoint '{}' failed on rank(s) {}", dir, rank_list(failed)));
  }
  engine.load_state(
      [&](const std::string& kind, const StatePiece& piece, const at::Tensor& out) {
        stored->read(kind, piece.name, piece.begin, out);
      },
      stored->layout().engine);
}

std::shared_ptr<ParameterSource> checkpoint_master_source(const std::string& dir) {
  return std::make_shared<MasterSource>(dir);
}

}  // namespace zt
