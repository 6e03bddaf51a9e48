// Rows to other ranks and back, with autograd: the all-to-all that expert parallelism (a
// mixture's rows to their experts' ranks) and Ulysses sequence parallelism (positions swapped
// for heads around attention) share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "zerotrain/comm.hpp"

namespace zt::model {

/// Rows [n, width] to other ranks: send_rows[q] rows (in rank order) go to rank q and
/// recv_rows[q] rows come from it, returned [Σ recv_rows, width] in rank order; a count may be
/// 0 (ranks outside a group exchange nothing). Backward sends the gradients back the other way,
/// so it is a collective too: every rank runs the same forwards and backwards in one order.
/// `comm` must outlive every backward of the result (the model that calls it owns it).
at::Tensor exchange_rows(const std::shared_ptr<Communicator>& comm, const at::Tensor& rows,
                         const std::vector<int64_t>& recv_rows,
                         const std::vector<int64_t>& send_rows);

}  // namespace zt::model
