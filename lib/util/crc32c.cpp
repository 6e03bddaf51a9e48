// CRC-32C: the SSE4.2 crc32 instruction where the CPU has it (x86-64 since 2008: ~10 GB/s a
// core, so checking a checkpoint costs less than reading it), else slicing-by-8 tables.
#include "util/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the slicing loads assume a little-endian host");

namespace zt::crc32c {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78u;  // reflected 0x1EDC6F41

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPolynomial : 0u);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
    }
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t extend_sse42(uint32_t crc, const unsigned char* p,
                                                        size_t size) {
  uint64_t c = ~crc;
  while (size >= 8) {
    uint64_t word = 0;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    size -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (size-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t extend(uint32_t crc, const void* data, size_t size) {
#if defined(__x86_64__)
  if (have_sse42()) return extend_sse42(crc, static_cast<const unsigned char*>(data), size);
#endif
  const auto& t = tables().t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    uint32_t lo = 0, hi = 0;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts (x86-64, aarch64)
    c = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xffu] ^ t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xffu];
  return ~c;
}

}  // namespace zt::crc32c
