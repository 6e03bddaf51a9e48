// Small file helpers whose errors name the file (IoError): reading only regular files (never
// blocking on a FIFO or reading a device), size limits per kind, names that stay inside their
// folder, atomic writes, folder removal, free space, and advisory locks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace zt::files {

/// Size limits of what is read whole (docs/checkpoints.md lists them): JSON configs and
/// zerotrain's own metadata; tokenizer files (tokenizer.json can be tens of MB).
constexpr uint64_t kMaxConfigBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxTokenizerBytes = uint64_t{1} << 30;
constexpr uint64_t kNoLimit = UINT64_MAX;

/// Opens `path` for reading and returns the descriptor (the caller closes it). It must be a
/// regular file or a link to one: a FIFO, socket, device or folder is an IoError naming it (the
/// open never waits for a FIFO's writer). A file above `max_bytes` is an IoError naming the
/// limit. `what` names the kind of file in messages ("model config").
int open_regular(const std::string& path, const char* what, uint64_t max_bytes = kNoLimit);

/// Reads a whole regular file of at most `max_bytes` (open_regular's checks). Missing or
/// unreadable files are an IoError naming the path.
std::string read_text(const std::string& path, const char* what = "file",
                      uint64_t max_bytes = kMaxConfigBytes);

/// `dir`/`name` for a `name` read from a file (`source` names it in messages): a plain name —
/// not empty, not "." or "..", no '/' or NUL — so that it stays inside `dir`; else an IoError
/// naming `source` and the entry.
std::string child(const std::string& dir, const std::string& name, const std::string& source);

/// The same for a relative path of plain names ("optimizer/rank-00000-of-00002.safetensors"):
/// not absolute, no empty, "." or ".." component.
std::string descendant(const std::string& dir, const std::string& relative,
                       const std::string& source);

/// Writes `content` to `path` atomically: a temporary file in the same folder, flushed and
/// renamed over `path` only when complete, so a crash never leaves a half-written file (and a
/// link at `path` is replaced, never written through).
void write_atomic(const std::string& path, const std::string& content);

/// Appends `text` to the regular file `path` (created when missing) in one write. A symbolic
/// link, FIFO, device or folder at `path` is an IoError naming it: the write never goes through
/// a link out of the run's folder and never waits for a FIFO's reader.
void append_text(const std::string& path, const std::string& text);

/// Removes `path` and everything under it without following symbolic links; a missing path is
/// no error. A failure is an IoError naming the entry that could not be removed. Used instead of
/// std::filesystem::remove_all, which crashed (SIGSEGV) on the GPU machine's toolchain (g++ 13
/// headers, the system's newer libstdc++) — docs/build.md.
void remove_tree(const std::string& path);

/// Bytes an unprivileged writer may still use on the file system holding `dir` (statvfs);
/// nullopt when it cannot be told.
std::optional<uint64_t> free_bytes(const std::string& dir);

/// An advisory lock (flock) on a file, held while the object lives and released by the kernel
/// when the process ends in any way (kill -9 included). Move-only.
class FileLock {
 public:
  /// Locks `path` (created when missing) exclusively or shared without waiting; nullopt when
  /// another process holds a conflicting lock. An exclusive holder writes `holder` (pid, host,
  /// start time) into the file for others' messages. IoError when the file cannot be opened.
  static std::optional<FileLock> try_lock(const std::string& path, bool exclusive,
                                          const std::string& holder = "");
  /// What the current exclusive holder of `path` wrote about itself ("" when unknown).
  static std::string holder_of(const std::string& path);
  /// Removes the lock file `path` (this lock's) while still holding it, then releases it:
  /// try_lock never counts a lock taken on a file unlinked meanwhile.
  void unlink_and_release(const std::string& path);

  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace zt::files
