// See exchange.hpp.
#include "model/exchange.hpp"

#include <torch/csrc/autograd/custom_function.h>

namespace zt::model {

namespace {

at::Tensor exchange(Communicator& comm, const at::Tensor& rows,
                    const std::vector<int64_t>& recv_rows, const std::vector<int64_t>& send_rows) {
  const int64_t width = rows.size(1);
  std::vector<int64_t> recv, send;
  int64_t total = 0;
  for (size_t q = 0; q < recv_rows.size(); ++q) {
    recv.push_back(recv_rows[q] * width);
    send.push_back(send_rows[q] * width);
    total += recv_rows[q];
  }
  at::Tensor out = at::empty({total, width}, rows.options());
  comm.all_to_all(out, rows.contiguous(), recv, send)->wait();
  return out;
}

class ExchangeFunction : public torch::autograd::Function<ExchangeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const std::shared_ptr<Communicator>& comm,
                            const std::vector<int64_t>& recv_rows,
                            const std::vector<int64_t>& send_rows) {
    ctx->saved_data["recv"] = recv_rows;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm.get()));
    return exchange(*comm, rows, recv_rows, send_rows);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The caller's model owns the communicator past every backward of its forwards.
    auto* comm =
        reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    return {exchange(*comm, grads[0], ctx->saved_data["send"].toIntVector(),
                     ctx->saved_data["recv"].toIntVector()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor exchange_rows(const std::shared_ptr<Communicator>& comm, const at::Tensor& rows,
                         const std::vector<int64_t>& recv_rows,
                         const std::vector<int64_t>& send_rows) {
  return ExchangeFunction::apply(rows, comm, recv_rows, send_rows);
}

}  // namespace zt::model
