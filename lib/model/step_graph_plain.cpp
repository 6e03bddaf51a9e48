// StepGraph without CUDA LibTorch: each run executes the step.
#include "model/step_graph.hpp"

namespace zt::model {

struct StepGraph::Impl {
  std::function<void()> step;
};

bool StepGraph::records(const at::Device&) {
  return false;
}

StepGraph::StepGraph(at::Device, std::function<void()> step)
    : impl_(std::make_unique<Impl>(Impl{std::move(step)})) {}
StepGraph::~StepGraph() = default;

void StepGraph::run() {
  impl_->step();
}

bool StepGraph::recorded() const {
  return false;
}

}  // namespace zt::model
