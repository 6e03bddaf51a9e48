// Integers from environment variables, read strictly: the launchers' rank counts and the
// engine's ranks per node share one rule.
#pragma once

#include <string_view>

namespace zt {

/// The integer `text` (the value of environment variable `name`) holds, from `min` to `max`:
/// decimal digits and nothing else ("2x", "0x10", " 4", "+4" and out-of-range values are never
/// read as another number). Anything else is a ConfigError naming the variable, its value and
/// `what` was expected ("an integer", "a count of ranks").
int parse_env_int(const char* name, std::string_view text, int min, int max, std::string_view what);

}  // namespace zt
