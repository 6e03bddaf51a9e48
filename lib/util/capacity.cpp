// See capacity.hpp.
#include "util/capacity.hpp"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "util/device_stats.hpp"
#include "zerotrain/error.hpp"

namespace zt::capacity {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
}  // namespace

double machine_bytes(int cuda_device) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  double bytes =
      pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
  if (cuda_device >= 0) bytes += static_cast<double>(device_stats::total_memory(cuda_device));
  return bytes;
}

void check_fits(double bytes, int cuda_device, const std::string& what, const std::string& fix) {
  const double have = machine_bytes(cuda_device);
  if (have <= 0 || bytes <= have) return;
  throw ConfigError(fmt::format(
      "{} needs {:.1f} GiB, more than this machine's {:.1f} GiB of "
      "memory ({}); {}",
      what, bytes / kGiB, have / kGiB, cuda_device >= 0 ? "host and GPU together" : "host", fix));
}

void check_free(double bytes, double free_bytes, const std::string& device, const std::string& what,
                const std::string& fix) {
  if (free_bytes <= 0 || bytes <= free_bytes) return;
  throw OutOfMemoryError(fmt::format("{} needs {:.1f} GiB on {}, which has {:.1f} GiB free; {}",
                                     what, bytes / kGiB, device, free_bytes / kGiB, fix));
}

double host_available_bytes() {
  if (const char* fake = std::getenv("ZT_TEST_HOST_AVAILABLE_BYTES"))
    return std::strtod(fake, nullptr);  // tests
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024.0;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');  // the unit
  }
  return 0.0;
}

void throw_if_host_allocation_failed(const std::string& message, const std::string& what,
                                     const std::string& fix) {
  if (message.find("DefaultCPUAllocator: can't allocate memory") == std::string::npos) return;
  const std::string tried = "you tried to allocate ";
  const size_t at = message.find(tried);
  const double bytes =
      at == std::string::npos ? 0.0 : std::strtod(message.c_str() + at + tried.size(), nullptr);
  const double available = host_available_bytes();
  throw OutOfMemoryError(fmt::format(
      "{}: the host could not allocate {}{}; {}", what,
      bytes > 0 ? fmt::format("{:.1f} GiB more", bytes / kGiB) : std::string("more memory"),
      available > 0 ? fmt::format(" ({:.1f} GiB available)", available / kGiB) : std::string(),
      fix));
}

}  // namespace zt::capacity
