// "Did you mean ...?": the nearest known name to a misspelled one.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

/// Levenshtein distance between `a` and `b`.
size_t edit_distance(std::string_view a, std::string_view b);

/// The entry of `known` nearest to `name`, when it is at most `max_distance` edits away (the
/// first of equals); "" otherwise.
std::string nearest_name(std::string_view name, const std::vector<std::string>& known,
                         size_t max_distance);

}  // namespace zt
