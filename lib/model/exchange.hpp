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

struct Flight;

/// An exchange issued by start_rows and not yet finished.
struct RowsInFlight {
  at::Tensor rows;  ///< the output, not to be read before finish_rows
  std::shared_ptr<Flight> flight;
};

/// exchange_rows in two halves, so that work which does not need the result runs beside the
/// transfer (a mixture's shared experts beside its rows' return). `start_rows` issues the
/// exchange; `finish_rows` waits for it (on CUDA the current stream waits, the host does not)
/// and returns the rows complete. In backward the roles swap: finish_rows's node issues the
/// gradients' exchange and start_rows's waits for it, so the backward of what ran between them
/// in forward (created after start_rows) runs beside that transfer too. Collective in forward
/// and backward, as exchange_rows; an exchange never finished is waited for when dropped.
RowsInFlight start_rows(const std::shared_ptr<Communicator>& comm, const at::Tensor& rows,
                        const std::vector<int64_t>& recv_rows,
                        const std::vector<int64_t>& send_rows);
at::Tensor finish_rows(RowsInFlight&& started);

}  // namespace zt::model
