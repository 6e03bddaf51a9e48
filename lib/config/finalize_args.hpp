// finalize and validate (finalize_args.cpp): the last steps of reading TrainingArguments.
#pragma once

#include <string>

#include "zerotrain/config.hpp"

namespace zt::config {

// Settings derived from others (torch_dtype, use_cpu, report_to), then the checks that span
// several options. Idempotent: the options file and the flags each end with it.
void finalize(TrainingArguments& a, const std::string& where);

// Every number inside its option's range (for arguments set in code, which the parser did not
// see), then the checks that span several options.
void validate(const TrainingArguments& a, const std::string& where);

}  // namespace zt::config
