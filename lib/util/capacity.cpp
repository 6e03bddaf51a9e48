// See capacity.hpp.
#include "util/capacity.hpp"

#include <unistd.h>

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

}  // namespace zt::capacity
