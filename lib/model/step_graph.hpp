// One decoding step recorded once and replayed: a CUDA graph of every kernel the step launches,
// so that a step of a batch costs one launch instead of the thousands its layers make. With a
// CUDA LibTorch (step_graph_cuda.cpp) on a CUDA device; elsewhere (step_graph_plain.cpp) the
// step simply runs each time.
//
// The step must be a pure function of tensors whose storage stays put between replays (the
// caller's fixed buffers, the model's parameters): inputs are written into them before a
// replay, outputs read from them after. It may not read host values that change, synchronize
// with the host, or copy from host memory. Not thread-safe; one device.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace zt::model {

class StepGraph {
 public:
  /// Whether steps on `device` are recorded: a CUDA device, a CUDA LibTorch, and the
  /// environment variable ZT_CUDA_GRAPHS not "0".
  static bool records(const at::Device& device);

  /// `step`: the work of one step, kept for the replays.
  StepGraph(at::Device device, std::function<void()> step);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  /// Runs one step. The first run executes the step and then records it; later runs replay the
  /// recording. When recording fails (an operation of the step cannot be recorded) the failure
  /// is logged as a warning and every later run executes the step directly.
  void run();

  /// Whether run() replays a recording.
  bool recorded() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt::model
