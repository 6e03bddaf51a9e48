// Small file helpers whose errors name the file (IoError).
#pragma once

#include <string>

namespace zt::files {

/// Reads a whole file. Missing or unreadable files are an IoError naming the path.
std::string read_text(const std::string& path, const char* what = "file");

/// Writes `content` to `path` atomically: a temporary file in the same folder, flushed and
/// renamed over `path` only when complete, so a crash never leaves a half-written file.
void write_atomic(const std::string& path, const std::string& content);

/// Removes `path` and everything under it without following symbolic links; a missing path is
/// no error. A failure is an IoError naming the entry that could not be removed. Used instead of
/// std::filesystem::remove_all, which crashed (SIGSEGV) on the GPU machine's toolchain (g++ 13
/// headers, the system's newer libstdc++) — docs/build.md.
void remove_tree(const std::string& path);

}  // namespace zt::files
