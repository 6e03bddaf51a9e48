// The process-wide log sink and level.
#include "zerotrain/log.hpp"

#include "util/log_scope.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace zt {
namespace {

LogLevel level_from_env() {
  const char* v = std::getenv("ZT_LOG_LEVEL");
  if (v == nullptr) return LogLevel::kInfo;
  if (std::strcmp(v, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(v, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(v, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

struct SinkState {
  std::mutex mutex;
  LogSink sink;
  std::atomic<int> level{static_cast<int>(level_from_env())};
};

thread_local int t_floor = static_cast<int>(LogLevel::kDebug);  // see log_scope.hpp

SinkState& state() {
  static SinkState s;  // never destroyed before last use: function-local static
  return s;
}

}  // namespace

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "?";
}

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().sink = std::move(sink);
}

void set_log_level(LogLevel level) {
  state().level.store(static_cast<int>(level));
}

LogLevel log_level() {
  return static_cast<LogLevel>(state().level.load());
}

void log_message(LogLevel level, const std::string& message) {
  if (static_cast<int>(level) < state().level.load() || static_cast<int>(level) < t_floor) return;
  std::lock_guard<std::mutex> lock(state().mutex);
  if (state().sink) {
    state().sink(level, message);
  } else {
    std::fprintf(stderr, "[zerotrain %s] %s\n", log_level_name(level), message.c_str());
    std::fflush(stderr);
  }
}

LogLevel log::set_thread_floor(LogLevel floor) {
  const int previous = t_floor;
  t_floor = static_cast<int>(floor);
  return static_cast<LogLevel>(previous);
}

}  // namespace zt
