#include "util/pattern.hpp"

#include <re2/re2.h>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt {

namespace {

std::string shortened(const std::string& text) {
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

}  // namespace

Pattern::Pattern(const std::string& text, const std::string& what) {
  RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(int64_t{32} << 20);  // a compiled program of at most 32 MiB
  re_ = std::make_unique<re2::RE2>(text, options);
  if (!re_->ok()) {
    const bool unsupported = re_->error_code() == RE2::ErrorBadPerlOp ||
                             re_->error_code() == RE2::ErrorBadNamedCapture ||
                             re_->error_code() == RE2::ErrorBadEscape;
    throw ConfigError(fmt::format(
        "{}: \"{}\" is not a pattern zerotrain takes: {}{}", what, shortened(text), re_->error(),
        unsupported ? " (RE2 syntax: no backreferences or lookaround; docs/peft.md)" : ""));
  }
}

Pattern::~Pattern() = default;
Pattern::Pattern(Pattern&&) noexcept = default;
Pattern& Pattern::operator=(Pattern&&) noexcept = default;

bool Pattern::full_match(std::string_view subject) const {
  return RE2::FullMatch(re2::StringPiece(subject.data(), subject.size()), *re_);
}

bool Pattern::prefix_match(std::string_view subject) const {
  const re2::StringPiece text(subject.data(), subject.size());
  return re_->Match(text, 0, text.size(), RE2::ANCHOR_START, nullptr, 0);
}

}  // namespace zt
