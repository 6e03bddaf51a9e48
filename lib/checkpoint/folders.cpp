// Checkpoint folders: listing them, the `latest` pointer, atomic writes with rotation, and the
// lock that keeps a folder being read from rotation.
#include "zerotrain/checkpoint.hpp"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "checkpoint/parse_count.hpp"
#include "comm/agreement.hpp"
#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using checkpoint::parse_count;
using comm::failed_ranks;
using comm::rank_list;
namespace fs = std::filesystem;

namespace {

// The lock file readers hold (shared) inside a folder they read, and rotation tries (exclusive).
constexpr const char* kReadLock = ".zerotrain.lock";

// The digits of a "checkpoint-<digits>" name; "" for any other name.
std::string checkpoint_digits(const std::string& name) {
  constexpr std::string_view kPrefix = "checkpoint-";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return {};
  const std::string digits = name.substr(kPrefix.size());
  for (char c : digits) {
    if (c < '0' || c > '9') return {};
  }
  return digits;
}

}  // namespace

std::vector<CheckpointInfo> list_checkpoints(const std::string& output_dir) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string digits = checkpoint_digits(name);
    // Real folders only: a link named checkpoint-N could lead anywhere.
    if (!entry.is_directory(ec) || entry.is_symlink(ec) || digits.empty()) continue;
    std::optional<int64_t> step = parse_count(digits);
    if (!step) {
      log::warn("'{}': the step in '{}' does not fit a 64-bit integer; ignoring that folder",
                output_dir, name);
      continue;
    }
    out.push_back(CheckpointInfo{entry.path().string(), *step});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::optional<std::string> checkpoint_in(const std::string& output_dir, const std::string& name) {
  std::error_code ec;
  if (checkpoint_digits(name).empty()) return std::nullopt;
  const fs::path dir = fs::path(output_dir) / name;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || !fs::is_directory(st)) return std::nullopt;  // not there, or a link
  return dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  std::error_code ec;
  const std::string pointer = output_dir + "/latest";
  if (fs::exists(pointer, ec)) {
    std::string name;
    try {
      name = files::read_text(pointer, "latest-checkpoint pointer", 4096);
    } catch (const IoError& e) {
      log::warn("{}; using the highest step", e.what());
    }
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
      name.pop_back();
    if (std::optional<std::string> dir = checkpoint_in(output_dir, name)) return dir;
    if (!name.empty()) {
      log::warn(
          "'{}' names '{}', which is not a checkpoint-<step> folder there; using the highest step",
          pointer, name);
    }
  }
  std::vector<CheckpointInfo> all = list_checkpoints(output_dir);
  if (all.empty()) return std::nullopt;
  return all.back().path;
}

CheckpointWriter::CheckpointWriter(Communicator& comm, const std::string& output_dir, int64_t step,
                                   bool replace)
    : CheckpointWriter(comm, output_dir, fmt::format("{}/.tmp-checkpoint-{}", output_dir, step),
                       fmt::format("{}/checkpoint-{}", output_dir, step), replace,
                       /*run_folder=*/true) {}

CheckpointWriter CheckpointWriter::to_folder(Communicator& comm, const std::string& dir,
                                             bool replace) {
  fs::path path = fs::absolute(dir).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();  // "dir/"
  const std::string parent = path.parent_path().string();
  return CheckpointWriter(comm, parent, parent + "/.tmp-" + path.filename().string(), path.string(),
                          replace,
                          /*run_folder=*/false);
}

CheckpointWriter::CheckpointWriter(Communicator& comm, std::string parent, std::string tmp,
                                   std::string final_dir, bool replace, bool run_folder)
    : comm_(comm),
      output_dir_(std::move(parent)),
      tmp_(std::move(tmp)),
      final_(std::move(final_dir)),
      replace_(replace),
      run_folder_(run_folder) {
  std::string error;
  if (comm_.rank() == 0) {
    try {
      std::error_code ec;
      if (!replace_ && fs::exists(final_, ec)) {
        throw IoError(
            fmt::format("'{}' already exists; checkpoints are never overwritten (choose "
                        "another folder or remove it)",
                        final_));
      }
      files::remove_tree(tmp_);  // our own leftover of an interrupted save of this checkpoint
      fs::create_directories(tmp_ + "/optimizer");
    } catch (const Error& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = fmt::format("cannot create '{}': {}", tmp_, e.what());
    }
  }
  if (!failed_ranks(comm_, error.empty()).empty()) {
    throw IoError(error.empty()
                      ? fmt::format("rank 0 could not prepare checkpoint folder '{}'", tmp_)
                      : error);
  }
}

std::string CheckpointWriter::commit(bool ok, std::optional<int64_t> total_limit,
                                     const std::string& keep) {
  std::vector<int> failed = failed_ranks(comm_, ok);
  if (!failed.empty()) {
    if (comm_.rank() == 0) {
      try {
        files::remove_tree(tmp_);
      } catch (const IoError& e) {
        log::warn("{}", e.what());
      }
    }
    throw IoError(
        fmt::format("saving checkpoint '{}' failed on rank(s) {}; earlier checkpoints are "
                    "intact (see those ranks' errors)",
                    final_, rank_list(failed)));
  }
  std::string error;
  if (comm_.rank() == 0) {
    try {
      if (replace_) files::remove_tree(final_);
      fs::rename(tmp_, final_);
      if (run_folder_)
        files::write_atomic(output_dir_ + "/latest", fs::path(final_).filename().string() + "\n");
      if (run_folder_ && total_limit) {
        std::vector<CheckpointInfo> all = list_checkpoints(output_dir_);
        int64_t excess = static_cast<int64_t>(all.size()) - *total_limit;
        for (const CheckpointInfo& c : all) {
          if (excess <= 0) break;
          std::error_code same_ec;
          if (c.path == final_ || (!keep.empty() && fs::equivalent(c.path, keep, same_ec)))
            continue;
          // A checkpoint being read (merge, verify: a shared lock) is kept until the next save.
          std::optional<files::FileLock> held =
              files::FileLock::try_lock(c.path + "/" + kReadLock, true);
          if (!held) {
            log::info("rotation: keeping '{}' for now; it is being read", c.path);
            continue;
          }
          files::remove_tree(c.path);
          --excess;
        }
      }
    } catch (const std::exception& e) {
      error = fmt::format("finishing checkpoint '{}': {}", final_, e.what());
    }
  }
  if (!failed_ranks(comm_, error.empty()).empty()) {
    throw IoError(error.empty() ? fmt::format("rank 0 could not finish checkpoint '{}'", final_)
                                : error);
  }
  return final_;
}

ReadLock::ReadLock(const std::string& folder) {
  const std::string path = folder + "/" + kReadLock;
  std::optional<files::FileLock> lock;
  try {
    lock = files::FileLock::try_lock(path, /*exclusive=*/false);
  } catch (const IoError& e) {
    // A folder this process may not write (a read-only copy): nothing can delete it under us.
    log::debug("{}: read without a lock", e.what());
    return;
  }
  if (!lock) {
    const std::string holder = files::FileLock::holder_of(path);
    throw IoError(fmt::format("'{}' is being written by a run ({}); wait for it to finish", folder,
                              holder.empty() ? path : holder));
  }
  held_ = std::make_shared<files::FileLock>(std::move(*lock));
}

}  // namespace zt
