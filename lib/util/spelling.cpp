#include "util/spelling.hpp"

#include <algorithm>

namespace zt {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string nearest_name(std::string_view name, const std::vector<std::string>& known,
                         size_t max_distance) {
  const std::string* best = nullptr;
  size_t best_d = max_distance + 1;
  for (const std::string& k : known) {
    const size_t d = edit_distance(name, k);
    if (d < best_d) {
      best_d = d;
      best = &k;
    }
  }
  return best ? *best : std::string();
}

}  // namespace zt
