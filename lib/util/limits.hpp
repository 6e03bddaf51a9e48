// Upper ends shared by options and files: far beyond any real run, low enough that nothing
// derived from them (tokens per step, steps × batch, deadlines in nanoseconds) overflows.
#pragma once

#include <cstdint>

namespace zt::limits {

/// Steps (optimizer, micro, logging intervals) in options, checkpoints and trainer state: 2^40.
constexpr int64_t kMaxSteps = int64_t{1} << 40;

}  // namespace zt::limits
