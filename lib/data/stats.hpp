// What a tokenized file's DatasetStats say, in the data's own units (examples, preference pairs,
// KTO examples) and with every drop under its cause: one wording for the tokenizers' warnings
// and errors, the cache's note and the trainer's data summary.
#pragma once

#include <string>

#include "zerotrain/data.hpp"

namespace zt::data {

/// The rows kept, in samples: "12 examples", "6 pairs (12 sequences)", "6 KTO examples (12
/// sequences: each with its KL sequence)"; then the tokens.
std::string kept_summary(const DatasetStats& s, const DataOptions& o);

/// The records dropped, each under its cause (only causes that occurred), e.g. "1 without a
/// trained token, 2 left without one by truncation to max_length 512" or "1 with identical
/// chosen and rejected answers, 1 whose answers max_length 64 cuts to the same sequence";
/// "" when none was dropped.
std::string drop_causes(const DatasetStats& s, const DataOptions& o);

/// How many records were dropped, in the data's units: "3 examples", "2 pairs", "2 KTO records
/// (3 examples)".
std::string dropped_count(const DatasetStats& s, const DataOptions& o);

}  // namespace zt::data
