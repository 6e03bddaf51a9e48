// What the reader and the writer of safetensors files agree on beyond the format itself.
#pragma once

#include <cstdint>

namespace zt {

/// Bytes of a tensor's data per CRC-32C in the `crc32c:<name>` metadata zerotrain writes (one
/// checksum per chunk, so a read of part of a tensor verifies only the chunks it touches).
constexpr int64_t kChecksumChunk = int64_t{16} << 20;

}  // namespace zt
