// See exchange.hpp.
#include "model/exchange.hpp"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "util/log.hpp"

namespace zt::model {

// One exchange's sizes and its transfers in flight: the forward's (issued by start_rows, waited
// for by finish_rows) and the gradients' (issued by finish_rows's backward, waited for by
// start_rows's). Shared by the two autograd nodes.
struct Flight {
  std::shared_ptr<Communicator> comm;
  std::vector<int64_t> recv, send;  // elements from / to each rank
  WorkHandle forward, backward;
  at::Tensor arrived;  // the gradients' exchange's output, complete once `backward` is waited

  ~Flight() {
    settle(forward);
    settle(backward);
  }

  static void settle(WorkHandle& work) {
    if (!work) return;
    try {
      work->wait();
    } catch (const std::exception& e) {  // the error already surfaced, or will at the next call
      log::debug("an exchange dropped in flight: {}", e.what());
    }
  }
};

namespace {

// Issues `rows` to the other ranks (sizes in elements); `out` is filled once `work` is waited.
WorkHandle issue(Communicator& comm, at::Tensor& out, const at::Tensor& rows,
                 const std::vector<int64_t>& recv, const std::vector<int64_t>& send) {
  int64_t total = 0;
  for (int64_t n : recv) total += n;
  const int64_t width = rows.size(1);
  out = at::empty({width > 0 ? total / width : 0, width}, rows.options());
  return comm.all_to_all(out, rows.contiguous(), recv, send);
}

// The flight travels between the two nodes in a capsule of their saved data.
struct Holder : torch::CustomClassHolder {
  explicit Holder(std::shared_ptr<Flight> f) : flight(std::move(f)) {}
  std::shared_ptr<Flight> flight;
};

c10::IValue capsule(const std::shared_ptr<Flight>& flight) {
  return c10::IValue::make_capsule(c10::make_intrusive<Holder>(flight));
}

std::shared_ptr<Flight> flight_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Holder>(ctx->saved_data["flight"].toCapsule())->flight;
}

class StartFunction : public torch::autograd::Function<StartFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const std::shared_ptr<Flight>& flight) {
    ctx->saved_data["flight"] = capsule(flight);
    at::Tensor out;
    flight->forward = issue(*flight->comm, out, rows, flight->recv, flight->send);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list /*grads*/) {
    // The gradient passed on is finish_rows's own (in flight as the exchange's input): the
    // rows' gradient is what that exchange brings.
    const std::shared_ptr<Flight> flight = flight_of(ctx);
    flight->backward->wait();
    flight->backward.reset();
    return {std::exchange(flight->arrived, at::Tensor()), at::Tensor()};
  }
};

class FinishFunction : public torch::autograd::Function<FinishFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& started,
                            const std::shared_ptr<Flight>& flight) {
    ctx->saved_data["flight"] = capsule(flight);
    flight->forward->wait();
    flight->forward.reset();
    return started;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::shared_ptr<Flight> flight = flight_of(ctx);
    flight->backward = issue(*flight->comm, flight->arrived, grads[0], flight->send, flight->recv);
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

RowsInFlight start_rows(const std::shared_ptr<Communicator>& comm, const at::Tensor& rows,
                        const std::vector<int64_t>& recv_rows,
                        const std::vector<int64_t>& send_rows) {
  auto flight = std::make_shared<Flight>();
  flight->comm = comm;
  const int64_t width = rows.size(1);
  for (size_t q = 0; q < recv_rows.size(); ++q) {
    flight->recv.push_back(recv_rows[q] * width);
    flight->send.push_back(send_rows[q] * width);
  }
  RowsInFlight r;
  r.rows = StartFunction::apply(rows, flight);
  r.flight = std::move(flight);
  return r;
}

at::Tensor finish_rows(RowsInFlight&& started) {
  return FinishFunction::apply(started.rows, started.flight);
}

at::Tensor exchange_rows(const std::shared_ptr<Communicator>& comm, const at::Tensor& rows,
                         const std::vector<int64_t>& recv_rows,
                         const std::vector<int64_t>& send_rows) {
  return finish_rows(start_rows(comm, rows, recv_rows, send_rows));
}

}  // namespace zt::model
