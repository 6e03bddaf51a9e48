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

/// One option: `name` sets `member`.
struct Option {
  const char* name;
  Member member;
  std::vector<std::string> choices = {};  // for strings; empty = free text
  double min = -1e308;                    // for numbers
  const char* help = "";
};

/// Every option, in help order.
const std::vector<Option>& options();
/// The option called `name`, or null.
const Option* find_option(std::string_view name);

}  // namespace zt::config
