// StepGraph with CUDA LibTorch: the step recorded as a CUDA graph on a pool stream, replayed on
// the current stream.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>
#include <exception>

#include "model/step_graph.hpp"
#include "util/log.hpp"

namespace zt::model {

struct StepGraph::Impl {
  at::Device device;
  std::function<void()> step;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  bool failed = false;
  Impl(at::Device d, std::function<void()> s) : device(d), step(std::move(s)) {}
};

bool StepGraph::records(const at::Device& device) {
  const char* e = std::getenv("ZT_CUDA_GRAPHS");
  return device.is_cuda() && (e == nullptr || std::strcmp(e, "0") != 0);
}

StepGraph::StepGraph(at::Device device, std::function<void()> step)
    : impl_(std::make_unique<Impl>(device, std::move(step))) {}

StepGraph::~StepGraph() = default;

bool StepGraph::recorded() const {
  return impl_->graph != nullptr;
}

void StepGraph::run() {
  Impl& I = *impl_;
  if (I.graph) {
    I.graph->replay();
    return;
  }
  if (I.failed || !records(I.device)) {
    I.step();
    return;
  }
  // The first run: the step executed on a side stream (also the warm-up that recording needs:
  // library handles and workspaces exist before it), then recorded there. Recording executes
  // nothing. The current stream waits for the side stream's work at the end.
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(I.device.index());
  const c10::cuda::CUDAStream side =
      c10::cuda::getStreamFromPool(/*isHighPriority=*/false, I.device.index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    I.step();
    I.graph = std::make_unique<at::cuda::CUDAGraph>();
    I.graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      I.step();
      I.graph->capture_end();
    } catch (const std::exception& e) {
      try {
        I.graph->capture_end();  // ends the capture and the allocator's recording pool
      } catch (const std::exception&) {
      }
      (void)cudaGetLastError();  // the capture's error is not sticky: clear it
      I.graph.reset();
      I.failed = true;
      log::warn(
          "generation: the decoding step could not be recorded as a CUDA graph, so each "
          "step launches its kernels one by one (slower, same results): {}",
          e.what());
    }
  }
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(current);
}

}  // namespace zt::model
