// The random state of a device's default generator, read and restored under its lock (dropout
// masks repeat in recomputed units; checkpoints resume the same stream).
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <mutex>

namespace zt::rng {

inline at::Tensor state(const at::Device& device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void set_state(const at::Device& device, const at::Tensor& value) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(value);
}

}  // namespace zt::rng
