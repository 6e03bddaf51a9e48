#include "util/threads.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include <ATen/Parallel.h>

namespace zt {
namespace {

int positive_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && n > 0 && n < 1 << 16 ? static_cast<int>(n) : 0;
}

}  // namespace

int cpu_worker_threads() {
  if (int n = positive_env("ZT_CPU_THREADS")) return n;
  int cores = 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = std::max(1, CPU_COUNT(&set));
  int local = positive_env("LOCAL_WORLD_SIZE");
  if (local == 0) local = positive_env("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local == 0) local = 1;
  return std::max(at::get_num_threads(), std::max(1, cores / local));
}

}  // namespace zt
