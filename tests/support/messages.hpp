// Test helpers for messages: an exception matcher on message parts, and a log capture.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "zerotrain/log.hpp"

namespace zt::test {

// Matches an exception whose message contains every one of `parts`.
class Has : public Catch::MatcherBase<std::exception> {
 public:
  explicit Has(std::vector<std::string> parts) : parts_(std::move(parts)) {}
  bool match(const std::exception& e) const override {
    const std::string message = e.what();
    return std::all_of(parts_.begin(), parts_.end(), [&](const std::string& part) {
      return message.find(part) != std::string::npos;
    });
  }
  std::string describe() const override {
    std::string out = "has a message containing";
    for (const std::string& part : parts_) out += " \"" + part + "\"";
    return out;
  }

 private:
  std::vector<std::string> parts_;
};

// Collects log messages (at info level and above) while alive.
class LogCapture {
 public:
  LogCapture() : level_(log_level()) {
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel, const std::string& m) { messages_.push_back(m); });
  }
  ~LogCapture() {
    set_log_sink({});
    set_log_level(level_);
  }
  bool contains(const std::string& part) const {
    return std::any_of(messages_.begin(), messages_.end(),
                       [&](const std::string& m) { return m.find(part) != std::string::npos; });
  }

 private:
  LogLevel level_;
  std::vector<std::string> messages_;
};

}  // namespace zt::test
