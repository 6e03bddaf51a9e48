#include "support/collectives.hpp"

#include "support/catch.hpp"

#include "comm/groups.hpp"
#include "zerotrain/error.hpp"

#include <fmt/format.h>

namespace zt::test {
namespace {

// A host tensor of doubles → the communicator's dtype and device.
at::Tensor make(const std::vector<double>& values, at::ScalarType dtype, at::Device device) {
  at::Tensor host = at::tensor(values, at::TensorOptions().dtype(at::kDouble));
  return host.to(dtype).to(device).contiguous();
}

std::vector<double> read(const at::Tensor& t) {
  at::Tensor host = t.to(at::kCPU).to(at::kDouble).contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

// Rank r's i-th input value: small integers so every sum over ≤ 8 ranks is exact in bf16.
double value(int r, int64_t i) {
  return static_cast<double>((r + 1) * ((i % 5) + 1) % 13);
}

}  // namespace

void check_collectives(Communicator& comm, at::ScalarType dtype) {
  const int r = comm.rank();
  const int w = comm.world_size();
  const at::Device dev = comm.device();
  const bool floating = at::isFloatingType(dtype);
  INFO("rank " << r << " of " << w << ", dtype " << c10::toString(dtype) << ", " << dev.str());
  const int64_t n = 11;  // odd on purpose

  // all_reduce: sum, max and (floating) average.
  std::vector<ReduceOp> ops{ReduceOp::kSum, ReduceOp::kMax};
  if (floating) ops.push_back(ReduceOp::kAvg);
  for (ReduceOp op : ops) {
    std::vector<double> mine(n), expected(n);
    for (int64_t i = 0; i < n; ++i) {
      mine[i] = value(r, i);
      double acc = op == ReduceOp::kMax ? -1e300 : 0.0;
      for (int q = 0; q < w; ++q)
        acc = op == ReduceOp::kMax ? std::max(acc, value(q, i)) : acc + value(q, i);
      expected[i] = op == ReduceOp::kAvg ? acc / w : acc;
    }
    at::Tensor t = make(mine, dtype, dev);
    comm.all_reduce(t, op)->wait();
    std::vector<double> got = read(t);
    if (op == ReduceOp::kAvg) {
      // Averages of small integers are exact in fp32; bf16/fp16 round them.
      for (int64_t i = 0; i < n; ++i) CHECK(got[i] == Approx(expected[i]).epsilon(1e-2));
    } else {
      CHECK(got == expected);
    }
  }

  // reduce_scatter: rank r keeps the reduction of chunk r.
  for (ReduceOp op : ops) {
    std::vector<double> input(static_cast<size_t>(n * w)), expected(n);
    for (int64_t j = 0; j < n * w; ++j) input[j] = value(r, j + 3);
    for (int64_t k = 0; k < n; ++k) {
      double acc = op == ReduceOp::kMax ? -1e300 : 0.0;
      for (int q = 0; q < w; ++q) {
        double v = value(q, r * n + k + 3);
        acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
      }
      expected[k] = op == ReduceOp::kAvg ? acc / w : acc;
    }
    at::Tensor in = make(input, dtype, dev);
    at::Tensor in_copy = in.clone();
    at::Tensor out = make(std::vector<double>(n, -7.0), dtype, dev);
    comm.reduce_scatter(out, in, op)->wait();
    std::vector<double> got = read(out);
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < n; ++i) CHECK(got[i] == Approx(expected[i]).epsilon(1e-2));
    } else {
      CHECK(got == expected);
    }
    CHECK(read(in) == read(in_copy));  // the input is left alone
  }

  // all_gather: rank q's block lands at [q·n, (q+1)·n).
  {
    std::vector<double> mine(n), expected;
    for (int64_t i = 0; i < n; ++i) mine[i] = value(r, i + 1);
    for (int q = 0; q < w; ++q) {
      for (int64_t i = 0; i < n; ++i) expected.push_back(value(q, i + 1));
    }
    at::Tensor out = make(std::vector<double>(static_cast<size_t>(n * w), -1.0), dtype, dev);
    comm.all_gather(out, make(mine, dtype, dev))->wait();
    CHECK(read(out) == expected);
  }

  // Uneven all_gather: rank q contributes (q % 3) elements — rank 0 none at all.
  {
    std::vector<int64_t> counts;
    for (int q = 0; q < w; ++q) counts.push_back(q % 3 == 0 && w > 1 ? 0 : q % 3 + 2);
    std::vector<double> mine, expected;
    for (int q = 0; q < w; ++q) {
      for (int64_t i = 0; i < counts[static_cast<size_t>(q)]; ++i) {
        expected.push_back(value(q, i + 2));
        if (q == r) mine.push_back(value(q, i + 2));
      }
    }
    at::Tensor in = mine.empty() ? at::empty({0}, at::TensorOptions().dtype(dtype).device(dev))
                                 : make(mine, dtype, dev);
    at::Tensor out = at::full({static_cast<int64_t>(expected.size())}, -3.0,
                              at::TensorOptions().dtype(dtype).device(dev));
    comm.all_gather_uneven(out, in, counts)->wait();
    CHECK(read(out) == expected);
  }

  // all_to_all of different sizes: rank r sends (r + q) % 3 elements to rank q (none to some,
  // itself included), receiving (q + r) % 3 from each; a first one of 0 elements everywhere at
  // world 1 too.
  {
    std::vector<int64_t> send, recv;
    std::vector<double> mine, expected;
    for (int q = 0; q < w; ++q) {
      const int64_t out = (r + q) % 3, in = (q + r) % 3;
      send.push_back(out);
      recv.push_back(in);
      for (int64_t i = 0; i < out; ++i) mine.push_back(value(r, q * 10 + i));
      for (int64_t i = 0; i < in; ++i) expected.push_back(value(q, r * 10 + i));
    }
    const auto options = at::TensorOptions().dtype(dtype).device(dev);
    at::Tensor in = mine.empty() ? at::empty({0}, options) : make(mine, dtype, dev);
    at::Tensor out = at::full({static_cast<int64_t>(expected.size())}, -5.0, options);
    comm.all_to_all(out, in, recv, send)->wait();
    CHECK(read(out) == expected);
    const std::vector<int64_t> none(static_cast<size_t>(w), 0);
    at::Tensor empty = at::empty({0}, options);
    comm.all_to_all(empty, empty, none, none)->wait();
    if (w > 1) {
      CHECK_THROWS_AS(comm.all_to_all(out, in, send, std::vector<int64_t>(1, 0)), InvalidArgument);
    }
    CHECK_THROWS_AS(comm.all_to_all(at::empty({static_cast<int64_t>(expected.size()) + 1}, options),
                                    in, recv, send),
                    InvalidArgument);
  }

  // Group collectives over all_to_all (comm/groups.hpp): sums over the ranks of one residue
  // modulo `stride` (expert parallelism's peers), and gathers over runs of `stride` consecutive
  // ranks (its holders of a whole); an odd size, so the sum's chunks are padded.
  for (int stride : {1, 2}) {
    if (w % stride != 0) continue;
    INFO("groups of stride " << stride);
    std::vector<int> peers, run;
    for (int q = r % stride; q < w; q += stride) peers.push_back(q);
    for (int q = r - r % stride; q < r - r % stride + stride; ++q) run.push_back(q);
    std::vector<double> mine(n), summed(n, 0.0), gathered;
    for (int64_t i = 0; i < n; ++i) {
      mine[i] = value(r, i + 4);
      for (int q : peers) summed[i] += value(q, i + 4);
    }
    for (int q : run) {
      for (int64_t i = 0; i < n; ++i) gathered.push_back(value(q, i + 4));
    }
    at::Tensor t = make(mine, dtype, dev);
    comm::group_all_reduce(comm, t, peers)->wait();
    CHECK(read(t) == summed);
    at::Tensor out = make(std::vector<double>(gathered.size(), -2.0), dtype, dev);
    comm::group_all_gather(comm, out, make(mine, dtype, dev), run)->wait();
    CHECK(read(out) == gathered);
  }
  if (w > 1) {
    at::Tensor t = make(std::vector<double>(n, 1.0), dtype, dev);
    CHECK_THROWS_AS(comm::group_all_reduce(comm, t, {(r + 1) % w}), InvalidArgument);
  }

  // broadcast from the last rank.
  {
    const double half = floating ? 0.5 : 0.0;
    std::vector<double> mine(n), expected(n);
    for (int64_t i = 0; i < n; ++i) {
      mine[i] = value(r, i) + half;
      expected[i] = value(w - 1, i) + half;
    }
    at::Tensor t = make(mine, dtype, dev);
    comm.broadcast(t, w - 1)->wait();
    CHECK(read(t) == expected);
  }

  // Several collectives in flight at once, waited on in reverse order.
  {
    std::vector<at::Tensor> ts;
    std::vector<WorkHandle> works;
    for (int k = 0; k < 4; ++k) {
      ts.push_back(make(std::vector<double>(static_cast<size_t>(n), r + k), dtype, dev));
      works.push_back(comm.all_reduce(ts.back(), ReduceOp::kSum));
    }
    for (int k = 3; k >= 0; --k) {
      works[static_cast<size_t>(k)]->wait();
      double expected = w * k + w * (w - 1) / 2.0;
      CHECK(read(ts[static_cast<size_t>(k)]) ==
            std::vector<double>(static_cast<size_t>(n), expected));
    }
  }

  comm.barrier();
}

}  // namespace zt::test
