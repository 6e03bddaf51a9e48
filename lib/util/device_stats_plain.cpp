// device_stats without a CUDA LibTorch: there is no device memory to count.
#include "util/device_stats.hpp"

namespace zt::device_stats {

int64_t peak_allocated(int) {
  return 0;
}
int64_t allocated(int) {
  return 0;
}
int64_t peak_reserved(int) {
  return 0;
}
int64_t usable_memory(int) {
  return 0;
}
void reset_peak(int) {}
int64_t total_memory(int) {
  return 0;
}
void cap_memory(int, int64_t) {}
void set_sync_errors(bool) {}

}  // namespace zt::device_stats
