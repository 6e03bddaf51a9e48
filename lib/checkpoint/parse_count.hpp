// parse_count, shared by the optimizer state (checkpoint.cpp) and the folder names (folders.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace zt::checkpoint {

// A non-negative decimal count that fits int64 ("42"); nullopt for anything else.
std::optional<int64_t> parse_count(const std::string& text);

}  // namespace zt::checkpoint
