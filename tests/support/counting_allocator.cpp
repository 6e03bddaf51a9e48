#include "support/counting_allocator.hpp"

#include <c10/core/CPUAllocator.h>

#include "util/torch_compat.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

namespace zt::test {
namespace {

std::atomic<int64_t> g_live{0}, g_peak{0};

// Each block carries its size in a 64-byte header, so data pointer and context are the same
// (LibTorch's raw_allocate insists on that) and the deleter can count what it frees.
constexpr size_t kHeader = 64;

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, block, sizeof(bytes));
  g_live.fetch_sub(bytes);
  std::free(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) ZT_ALLOCATE_CONST override {
    void* block = nullptr;
    if (posix_memalign(&block, kHeader, n + kHeader) != 0) throw std::bad_alloc();
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(block, &bytes, sizeof(bytes));
    void* data = static_cast<char*>(block) + kHeader;
    int64_t now = g_live.fetch_add(bytes) + bytes;
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(data, data, &release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // Required by newer LibTorch (pure virtual there); harmless where it is not.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

void install_counting_allocator() {
  static CountingAllocator* counting = nullptr;
  if (counting != nullptr) return;
  counting = new CountingAllocator();
  c10::SetCPUAllocator(counting, /*priority=*/255);
}

int64_t live_cpu_bytes() {
  return g_live.load();
}
int64_t peak_cpu_bytes() {
  return g_peak.load();
}
void reset_peak_cpu_bytes() {
  g_peak.store(g_live.load());
}

}  // namespace zt::test
