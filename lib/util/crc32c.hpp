// CRC-32C (Castagnoli), as TFRecord framing (TensorBoard event files) and checkpoint checksums
// use it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zt::crc32c {

/// Extends `crc` (0 to start) by `size` bytes at `data`.
uint32_t extend(uint32_t crc, const void* data, size_t size);
inline uint32_t of(const void* data, size_t size) {
  return extend(0, data, size);
}

/// TFRecord's masked CRC: rotated right by 15 bits plus a constant, so that a CRC stored next to
/// the data it covers is not itself the CRC of a run of those bytes.
inline uint32_t masked(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace zt::crc32c
