// HF TrainingArguments fields (and LLaMA-Factory arguments) that zerotrain has no use for:
// accepted so that an HF command line or a LLaMA-Factory config runs unchanged, with one
// warning each (saying what zerotrain does instead), or refused when the value given would
// change results in a way zerotrain cannot honour.
// data/hf_training_arguments.json lists every field of transformers 4.40–5.x; the tests check
// that each is either a zerotrain option or an entry here.
#pragma once

#include <string>
#include <string_view>

namespace zt::config {

/// How a command line gives the value: a flag (true alone, or followed by its value), one
/// token, or one or more tokens (HF's list fields: `--report_to tensorboard wandb`).
enum class ValueKind { kFlag, kValue, kList };

struct ForeignOption {
  const char* name;
  ValueKind kind;
  /// nullptr: no value changes zerotrain's results (accepted with a warning). Otherwise the
  /// values that match what zerotrain does, '|'-separated canonical texts (see canonical_value);
  /// any other value is a ConfigError.
  const char* neutral;
  const char* note;  ///< what zerotrain does instead, for the warning or the error
};

/// The entry for `name`, or nullptr.
const ForeignOption* find_foreign_option(std::string_view name);

/// A value's canonical text for comparing with ForeignOption::neutral: booleans "true" /
/// "false", numbers as %g, None / null "none", empty lists and objects "[]" / "{}", strings as
/// they are.
std::string canonical_value(std::string_view text);

/// Whether `canonical` is one of `option.neutral` (always true when that is nullptr).
bool is_neutral(const ForeignOption& option, const std::string& canonical);

}  // namespace zt::config
