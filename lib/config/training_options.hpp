// The table of TrainingArguments options: each flag's name, the member it sets, its choices or
// lower bound, and its help line (training_args.cpp reads flags and JSON through it).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "zerotrain/config.hpp"

namespace zt::config {

using Args = TrainingArguments;
using Member = std::variant<bool Args::*, int64_t Args::*, double Args::*, std::string Args::*,
                            std::optional<int64_t> Args::*, std::optional<bool> Args::*,
                            std::optional<double> Args::*>;

/// The values a numeric option takes: from `min` to `max`, each end included unless marked
/// open. A bare number in the table is a lower bound (`min`) with no upper one.
struct Range {
  enum Ends { kClosed, kOpenAbove, kOpenBelow };
  double min = -1e308;
  double max = 1e308;
  Ends ends = kClosed;
  Range() = default;
  Range(double lo) : min(lo) {}  // NOLINT(google-explicit-constructor): the table's shorthand
  Range(double lo, double hi, Ends e = kClosed) : min(lo), max(hi), ends(e) {}
  bool contains(double v) const;
  /// "an integer from 1 to 65536", "a number > 0 and <= 1", ... for messages and help.
  std::string describe(bool integer) const;
};

/// One option: `name` sets `member`.
struct Option {
  const char* name;
  Member member;
  std::vector<std::string> choices = {};  // for strings; empty = free text
  Range range = {};                       // for numbers
  const char* help = "";
};

/// Decimal text only, as Python's float() reads a flag: digits with an optional sign, point and
/// exponent; hexadecimal (0x10), inf, nan and digit separators are refused.
bool is_decimal_text(std::string_view s);
/// Its value, when it is decimal text of a finite number.
std::optional<double> parse_double_text(const std::string& s);

/// Every option, in help order.
const std::vector<Option>& options();
/// The option called `name`, or null.
const Option* find_option(std::string_view name);

}  // namespace zt::config
