// A program outside the zerotrain tree, built against the installed package.
#include <cstdio>

#include <zerotrain/build_config.hpp>
#include <zerotrain/comm.hpp>
#include <zerotrain/config.hpp>

int main() {
  zt::DeepSpeedConfig ds = zt::parse_deepspeed_config(R"({"zero_optimization": {"stage": 2}})");
  auto comm = zt::create_communicator(zt::LaunchEnv{}, zt::CommOptions{});
  at::Tensor t = at::ones({3});
  comm->all_reduce(t)->wait();
  std::printf("zerotrain %s consumer: stage %d, world %d, sum %.0f\n", ZT_VERSION_STRING,
              ds.zero.stage, comm->world_size(), t.sum().item<float>());
  return ds.zero.stage == 2 && t.sum().item<float>() == 3.0f ? 0 : 1;
}
