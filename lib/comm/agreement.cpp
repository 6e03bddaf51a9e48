// Agreement between ranks: one all-reduce of a few fp64 values, on the communicator's device.
#include "comm/agreement.hpp"

#include <exception>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "zerotrain/error.hpp"

namespace zt::comm {

std::vector<double> reduce_scalars(Communicator& comm, const std::vector<double>& values,
                                   ReduceOp op) {
  if (values.empty()) return {};
  at::Tensor t = at::tensor(values, at::kDouble).to(comm.device());
  comm.all_reduce(t, op)->wait();
  const at::Tensor host = t.cpu();
  comm.raise_if_failed();  // an aborted collective's values are garbage
  const double* p = host.data_ptr<double>();
  return std::vector<double>(p, p + host.numel());
}

std::vector<int> failed_ranks(Communicator& comm, bool ok) {
  std::vector<double> flags(static_cast<size_t>(comm.world_size()), 0.0);
  if (!ok) flags[static_cast<size_t>(comm.rank())] = 1.0;
  flags = reduce_scalars(comm, flags);
  std::vector<int> failed;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] != 0.0) failed.push_back(static_cast<int>(r));
  }
  return failed;
}

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{}", fmt::join(ranks, ", "));
}

void on_every_rank(Communicator& comm, const std::string& what, const std::function<void()>& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  const std::vector<int> failed = failed_ranks(comm, error == nullptr);
  if (error) std::rethrow_exception(error);
  if (!failed.empty()) {
    throw DistributedError(
        fmt::format("{} failed on rank(s) {}; see the error there", what, rank_list(failed)));
  }
}

}  // namespace zt::comm
