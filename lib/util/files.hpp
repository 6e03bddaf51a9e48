// Small file helpers whose errors name the file (IoError).
#pragma once

#include <string>

namespace zt::files {

/// Reads a whole file. Missing or unreadable files are an IoError naming the path.
std::string read_text(const std::string& path, const char* what = "file");

/// Writes `content` to `path` atomically: a temporary file in the same folder, flushed and
/// renamed over `path` only when complete, so a crash never leaves a half-written file.
void write_atomic(const std::string& path, const std::string& content);

}  // namespace zt::files
