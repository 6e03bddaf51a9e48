// The output folder a run writes into: what it may hold before the run starts (checkpoints of
// this or another run, a previous run's outputs, links and FIFOs, the model's own folder), the
// checkpoint a resume starts from, and the lock that keeps a second run out.
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "train/reporting.hpp"
#include "train/trainer_impl.hpp"
#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"

namespace zt {

namespace fs = std::filesystem;

namespace {

bool is_true_text(const std::string& s) {
  return s == "True" || s == "true" || s == "1";
}
bool is_false_text(const std::string& s) {
  return s.empty() || s == "False" || s == "false" || s == "0";
}

}  // namespace

// 64 random bits as hex: which run wrote a checkpoint (TrainerState::run_id).
std::string train::new_run_id() {
  std::random_device device;
  const uint64_t high = device(), low = device();
  return fmt::format("{:016x}", (high << 32) ^ low ^ static_cast<uint64_t>(::getpid()));
}

void Trainer::Impl::check_output_dir() {
  const std::string& out = args.output_dir;
  if (out.empty()) {
    throw ConfigError(
        "output_dir is empty: give the folder for checkpoints, logs and the model (--output_dir "
        "DIR)");
  }
  std::error_code ec;
  const fs::path where = fs::weakly_canonical(fs::absolute(out), ec);
  if (!ec && where == where.root_path()) {
    throw ConfigError(fmt::format(
        "output_dir '{}' is the root of the file system; give the run a folder of its own", out));
  }
  if (fs::exists(out, ec) && !fs::is_directory(out, ec)) {
    throw ConfigError(
        fmt::format("output_dir '{}' exists and is not a folder; choose another output_dir", out));
  }
  // The run writes its final model into output_dir: never into (or inside) the folder it reads
  // the model or adapter from.
  for (const auto& [what, source] :
       {std::pair<const char*, const std::string*>{"model_name_or_path", &args.model_name_or_path},
        {"adapter_name_or_path", &args.adapter_name_or_path}}) {
    if (source->empty() || !fs::is_directory(*source, ec)) continue;
    const fs::path from = fs::weakly_canonical(fs::absolute(*source), ec);
    const fs::path rel = where.lexically_relative(from);
    if (!rel.empty() && *rel.begin() != "..") {
      throw ConfigError(fmt::format(
          "output_dir '{}' is {} the {} folder '{}': the run would write its model over what it "
          "reads; choose another output_dir",
          out, rel == "." ? "" : "inside", what, *source));
    }
  }
  // Names the run writes: none may be a link, FIFO or device placed there (a write would leave
  // the folder or wait forever).
  for (const char* name :
       {"trainer_log.jsonl", "trainer_state.json", "latest", "loss.svg", "training_args.json",
        "config.json", "model.safetensors", "model.safetensors.index.json",
        "adapter_model.safetensors", "adapter_config.json", "zerotrain_template.json"}) {
    const fs::path p = fs::path(out) / name;
    const fs::file_status st = fs::symlink_status(p, ec);
    if (ec || !fs::exists(st) || fs::is_regular_file(st)) continue;
    throw ConfigError(fmt::format(
        "output_dir '{}': '{}' is {}, not a file the run made; remove or rename it", out, name,
        fs::is_symlink(st)     ? "a symbolic link"
        : fs::is_directory(st) ? "a folder"
                               : "a special file"));
  }
  const std::string& r = args.resume_from_checkpoint;
  const bool from_latest = is_true_text(r);
  if (from_latest) {
    run_dir.resume = latest_checkpoint(args.output_dir);
    if (!run_dir.resume) {
      throw ConfigError(
          fmt::format("resume_from_checkpoint True: '{}' holds no checkpoint to resume from; "
                      "start without it or name a checkpoint folder",
                      args.output_dir));
    }
  } else if (!is_false_text(r)) {
    if (!fs::is_directory(r)) {
      throw IoError(fmt::format(
          "resume_from_checkpoint '{}' is not a folder; name a checkpoint-<step> folder "
          "or pass True for the newest in output_dir",
          r));
    }
    fs::path dir = fs::path(r).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();  // "checkpoint-4/"
    run_dir.resume = dir.string();
  }
  if (run_dir.resume) {
    // Checkpoints after the one resumed from would be overwritten step by step. Those of the
    // same run (a save killed after its folder was renamed into place, complete, but before it
    // updated `latest`) are resumed from; another run's are never removed without
    // --overwrite_output_dir on this command.
    const train::TrainerState at = train::read_trainer_state(*run_dir.resume);
    int64_t from = at.global_step;
    std::vector<CheckpointInfo> same, other;
    for (const CheckpointInfo& c : list_checkpoints(args.output_dir)) {
      std::error_code ec;
      if (c.step <= from || fs::equivalent(c.path, *run_dir.resume, ec)) continue;
      std::string id;
      try {
        id = train::read_trainer_state(c.path).run_id;
      } catch (const std::exception&) {  // not readable as a checkpoint of a run: not ours
      }
      (from_latest && !at.run_id.empty() && id == at.run_id ? same : other).push_back(c);
    }
    if (!same.empty()) {
      if (rank == 0) {
        log::info(
            "'{}/latest' names {}, but {} of the same run is complete and newer (its save "
            "was stopped before it updated latest): resuming from it",
            out, fs::path(*run_dir.resume).filename().string(),
            fs::path(same.back().path).filename().string());
      }
      run_dir.resume = same.back().path;
      from = train::read_trainer_state(*run_dir.resume).global_step;
      other.erase(std::remove_if(other.begin(), other.end(),
                                 [&](const CheckpointInfo& c) { return c.step <= from; }),
                  other.end());
    }
    if (!other.empty() && !args.overwrite_output_dir) {
      std::vector<std::string> names;
      for (const CheckpointInfo& c : other) names.push_back(fs::path(c.path).filename().string());
      throw ConfigError(fmt::format(
          "resume_from_checkpoint {}: '{}' is step {}, but output_dir '{}' holds newer "
          "checkpoint(s) {}{} that this run would overwrite; move them away, pass "
          "--overwrite_output_dir to remove them and continue from step {}{}",
          from_latest ? "True" : "'" + r + "'", *run_dir.resume, from, args.output_dir,
          fmt::join(names, ", "), from_latest ? " written by another run" : "", from,
          from_latest ? "" : ", or resume from the newest (--resume_from_checkpoint True)"));
    }
    run_dir.superseded.clear();
    for (const CheckpointInfo& c : other) run_dir.superseded.push_back(c.path);
  }
  if (!run_dir.resume && !args.overwrite_output_dir) {
    std::vector<CheckpointInfo> existing = list_checkpoints(args.output_dir);
    if (!existing.empty()) {
      throw ConfigError(fmt::format(
          "output_dir '{}' already holds {} checkpoint(s) (newest: {}); pass "
          "--resume_from_checkpoint True to "
          "continue that run, --overwrite_output_dir to start anew there, or choose another "
          "output_dir",
          args.output_dir, existing.size(), fs::path(existing.back().path).filename().string()));
    }
    // HF Trainer's rule: a folder holding a previous run's outputs is not taken over silently.
    for (const char* name : {"trainer_state.json", "trainer_log.jsonl", "model.safetensors",
                             "model.safetensors.index.json", "adapter_model.safetensors"}) {
      if (fs::exists(fs::path(out) / name, ec)) {
        throw ConfigError(
            fmt::format("output_dir '{}' holds a previous run's outputs ({}); pass "
                        "--overwrite_output_dir to replace them, or choose another output_dir",
                        out, name));
      }
    }
  }
  if (args.packing && (args.finetuning_type == "ptuning" || args.finetuning_type == "prefix" ||
                       args.finetuning_type == "ptuning_v2")) {
    throw ConfigError(
        fmt::format("packing cannot be combined with finetuning_type {} (virtual tokens would "
                    "cross documents); drop --packing",
                    args.finetuning_type));
  }
}

void Trainer::Impl::lock_output_dir() {
  const std::string& out = args.output_dir;
  std::error_code ec;
  run_dir.created = !fs::exists(out, ec);
  fs::create_directories(out, ec);
  if (ec) throw IoError(fmt::format("cannot create output_dir '{}': {}", out, ec.message()));
  if (::access(out.c_str(), W_OK | X_OK) != 0) {
    throw IoError(fmt::format("output_dir '{}' is not writable: {}", out, std::strerror(errno)));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const std::string lock_path = out + "/.zerotrain.lock";
  run_dir.lock = files::FileLock::try_lock(lock_path, /*exclusive=*/true,
                                           fmt::format("pid {} on {} since {}", ::getpid(), host,
                                                       static_cast<long long>(std::time(nullptr))));
  if (!run_dir.lock) {
    const std::string holder = files::FileLock::holder_of(lock_path);
    throw ConfigError(
        fmt::format("output_dir '{}' is in use by another run ({}); wait for it to end or choose "
                    "another output_dir (--overwrite_output_dir does not take a folder from a "
                    "running job)",
                    out, holder.empty() ? "its lock file " + lock_path : holder));
  }
}

void Trainer::Impl::abandon_output_dir() noexcept {
  if (!run_dir.lock) return;
  try {
    run_dir.lock->unlink_and_release(args.output_dir + "/.zerotrain.lock");
    run_dir.lock.reset();
    if (run_dir.created) files::remove_tree(args.output_dir);
  } catch (const std::exception& e) {
    log::warn("cleaning up output_dir '{}' after the failed start: {}", args.output_dir, e.what());
  }
}

}  // namespace zt
