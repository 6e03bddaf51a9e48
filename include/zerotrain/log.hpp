// The one logging sink of libzerotrain. The library never writes to stdout/stderr except
// through this sink; hosts replace it to route messages into their own logging.
#pragma once

#include <functional>
#include <string>

namespace zt {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

/// Receives one complete message (no trailing newline). May be called from any thread that
/// runs zerotrain code, so it must be thread-safe; calls are serialized by the library.
using LogSink = std::function<void(LogLevel level, const std::string& message)>;

/// Replaces the process-wide sink. An empty function restores the default sink, which writes
/// `[zerotrain LEVEL] message` lines to stderr. Thread-safe.
void set_log_sink(LogSink sink);

/// Messages below `level` are dropped before formatting. Default: kInfo, or the value of the
/// environment variable ZT_LOG_LEVEL (debug|info|warning|error) when set. Thread-safe.
void set_log_level(LogLevel level);
LogLevel log_level();

/// Sends a message through the sink (used by the library and its programs).
void log_message(LogLevel level, const std::string& message);

const char* log_level_name(LogLevel level);

}  // namespace zt
