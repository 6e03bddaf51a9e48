// Shared by the fuzz targets: a private scratch folder (the process works inside it, so nothing
// an input names can land elsewhere) and the input as a file there.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

namespace zt::fuzz {

inline const std::string& scratch() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/zt-fuzz-XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    if (made == nullptr) std::abort();
    if (::chdir(made) != 0) std::abort();
    return std::string(made);
  }();
  return dir;
}

inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

}  // namespace zt::fuzz
