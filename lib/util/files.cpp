// File helpers.
#include "util/files.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::files {

int open_regular(const std::string& path, const char* what, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer;
  // the descriptor's own fstat then tells what it is (no race with a path swapped meanwhile).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0)
    throw IoError(fmt::format("cannot open {} '{}': {}", what, path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(fmt::format("cannot stat {} '{}': {}", what, path, std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISDIR(st.st_mode)    ? "a folder"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw IoError(fmt::format("{} '{}' is {}, not a regular file; give the path of the file itself",
                              what, path, kind));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw IoError(
        fmt::format("{} '{}' has {} bytes, more than the {} a {} can have; is it the right file?",
                    what, path, static_cast<uint64_t>(st.st_size), max_bytes, what));
  }
  // Reads block normally from here (on a regular file O_NONBLOCK has no effect anyway).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::string read_text(const std::string& path, const char* what, uint64_t max_bytes) {
  const int fd = open_regular(path, what, max_bytes);
  std::string out;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("cannot read {} '{}': {}", what, path, std::strerror(err)));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) {  // grew while being read
      ::close(fd);
      throw IoError(fmt::format("{} '{}' is larger than the {} bytes a {} can have", what, path,
                                max_bytes, what));
    }
  }
  ::close(fd);
  return out;
}

namespace {

bool plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

std::string child(const std::string& dir, const std::string& name, const std::string& source) {
  if (!plain_name(name)) {
    throw IoError(fmt::format(
        "{}: \"{}\" is not a plain file name (no '/', '..' or absolute path: what a file "
        "names must stay inside '{}')",
        source, name, dir));
  }
  return dir + "/" + name;
}

std::string descendant(const std::string& dir, const std::string& relative,
                       const std::string& source) {
  bool ok = !relative.empty() && relative.front() != '/';
  for (size_t start = 0; ok && start <= relative.size();) {
    const size_t slash = std::min(relative.find('/', start), relative.size());
    ok = plain_name(relative.substr(start, slash - start));
    start = slash + 1;
  }
  if (!ok) {
    throw IoError(fmt::format(
        "{}: \"{}\" is not a path inside '{}' (an absolute path, '..' or an empty part)", source,
        relative, dir));
  }
  return dir + "/" + relative;
}

void write_atomic(const std::string& path, const std::string& content) {
  std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
  // A fresh file of its own: whatever sits at the temporary name (a stale file, a link placed
  // there) is removed, never written through.
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("cannot create '{}': {}", tmp, std::strerror(errno)));
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(fmt::format("cannot write '{}': {}", tmp, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("cannot flush '{}': {}", tmp, std::strerror(err)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(err)));
  }
}

void append_text(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(),
                        O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    const char* why = err == ELOOP   ? "it is a symbolic link"
                      : err == ENXIO ? "it is a FIFO"
                                     : std::strerror(err);
    throw IoError(
        fmt::format("cannot append to '{}': {}; a run writes only regular files of its "
                    "own folder: remove or rename it",
                    path, why));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(
        fmt::format("cannot append to '{}': it is not a regular file (a FIFO, device "
                    "or folder); remove or rename it",
                    path));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("cannot append to '{}': {}", path, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

namespace {

thread_local std::string remove_error;  // nftw's callback cannot capture

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  if (::remove(path) != 0 && errno != ENOENT) {
    remove_error = fmt::format("cannot remove '{}': {}", path, std::strerror(errno));
    return 1;
  }
  return 0;
}

}  // namespace

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw IoError(fmt::format("cannot remove '{}': {}", path, std::strerror(errno)));
  }
  remove_error.clear();
  // Depth first, so every folder is empty when its turn comes; FTW_PHYS: links are removed,
  // never followed.
  if (::nftw(path.c_str(), remove_entry, 32, FTW_DEPTH | FTW_PHYS) != 0) {
    throw IoError(remove_error.empty()
                      ? fmt::format("cannot remove '{}': {}", path, std::strerror(errno))
                      : remove_error);
  }
}

std::optional<uint64_t> free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return std::nullopt;
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

std::optional<FileLock> FileLock::try_lock(const std::string& path, bool exclusive,
                                           const std::string& holder) {
  // A holder may unlink the file while it holds the lock (unlink_and_release): a lock taken on
  // the unlinked file is no lock, so it is taken again on whatever the path names now.
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
      throw IoError(fmt::format("cannot open the lock file '{}': {}", path, std::strerror(errno)));
    if (::flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return std::nullopt;
      throw IoError(fmt::format("cannot lock '{}': {}", path, std::strerror(err)));
    }
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
      if (exclusive && !holder.empty() && ::ftruncate(fd, 0) == 0) {
        const ssize_t ignored =
            ::pwrite(fd, holder.data(), holder.size(), 0);  // for others' messages only
        (void)ignored;
      }
      return FileLock(fd);
    }
    ::close(fd);
    if (attempt == 8) {
      throw IoError(
          fmt::format("cannot lock '{}': it is replaced faster than it can be locked", path));
    }
  }
}

void FileLock::unlink_and_release(const std::string& path) {
  if (fd_ < 0) return;
  ::unlink(path.c_str());  // while held: no one else can hold the file being removed
  ::close(fd_);
  fd_ = -1;
}

std::string FileLock::holder_of(const std::string& path) {
  try {
    std::string text = read_text(path, "lock file", 4096);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  } catch (const IoError&) {
    return "";
  }
}

FileLock::FileLock(FileLock&& other) noexcept : fd_(other.fd_) {
  other.fd_ = -1;
}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace zt::files
