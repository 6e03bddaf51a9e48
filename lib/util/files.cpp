// File helpers.
#include "util/files.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt::files {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw IoError(fmt::format("cannot open {} '{}': {}", what, path, std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(fmt::format("cannot read {} '{}'", what, path));
  return ss.str();
}

void write_atomic(const std::string& path, const std::string& content) {
  std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
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

}  // namespace zt::files
