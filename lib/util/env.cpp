#include "util/env.hpp"

#include <charconv>
#include <limits>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt {

int parse_env_int(const char* name, std::string_view text, int min, int max,
                  std::string_view what) {
  int out = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec == std::errc() && end == text.data() + text.size() && out >= min && out <= max) return out;
  const std::string range = max == std::numeric_limits<int>::max()
                                ? fmt::format(">= {}", min)
                                : fmt::format("{} to {}", min, max);
  throw ConfigError(fmt::format("environment variable {}={}: expected {} {}, found \"{}\"", name,
                                text, what, range, text));
}

}  // namespace zt
