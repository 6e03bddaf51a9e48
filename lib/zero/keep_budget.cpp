// The budget for what recomputed units keep beyond need (see keep_budget.hpp).
#include "zero/keep_budget.hpp"

#include <algorithm>

namespace zt::zero {

int64_t KeepBudget::limit(int64_t rows, int64_t step) {
  if (!memory) return fixed;
  if (first_step_ < 0) first_step_ = step;
  if (step == first_step_) {
    if (resident_ < 0) resident_ = memory().allocated;
    first_rows_ = std::max(first_rows_, rows);
    return 0;
  }
  if (!measured_) {
    measured_ = true;
    after_ = memory();
  }
  if (first_rows_ <= 0) return 0;
  const int64_t activations = std::max<int64_t>(0, after_.peak_reserved - resident_);
  const double growth = rows > first_rows_ ? static_cast<double>(rows - first_rows_) /
                                                 static_cast<double>(first_rows_)
                                           : 0.0;
  const double room =
      static_cast<double>(after_.usable - after_.usable / 10 - after_.peak_reserved) -
      static_cast<double>(activations) * growth;
  return room > 0 ? static_cast<int64_t>(room) : 0;
}

}  // namespace zt::zero
