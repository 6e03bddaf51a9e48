// Formatting front-end of the log sink for library code: zt::log::info("x = {}", x).
#pragma once

#include <fmt/format.h>

#include "zerotrain/log.hpp"

namespace zt::log {

template <typename... Args>
void write(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (static_cast<int>(level) < static_cast<int>(log_level())) return;
  log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
void debug(fmt::format_string<Args...> format, Args&&... args) {
  write(LogLevel::kDebug, format, std::forward<Args>(args)...);
}
template <typename... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  write(LogLevel::kInfo, format, std::forward<Args>(args)...);
}
template <typename... Args>
void warn(fmt::format_string<Args...> format, Args&&... args) {
  write(LogLevel::kWarning, format, std::forward<Args>(args)...);
}
template <typename... Args>
void error(fmt::format_string<Args...> format, Args&&... args) {
  write(LogLevel::kError, format, std::forward<Args>(args)...);
}

}  // namespace zt::log
