// The sharding contract between a model and whatever trains it: the units a model's forward
// runs through, where initial parameter values come from, and whether a unit is being
// recomputed for backward. Models include this header, never the engine's; the engine
// (zt::Engine) implements UnitRunner and attaches itself to the model's gate.
//
// Threading: a gate is used by the thread that runs the model's forward, and by LibTorch's
// autograd threads when the engine recomputes a unit in backward.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zt {

/// The function of one sharding unit: tensors in, tensors out. It may use only its inputs and
/// long-lived state (module pointers, captured *by value*), because with ZeRO-3 or activation
/// checkpointing it runs again during backward, after the caller's stack frame is gone.
using UnitFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// What runs a unit on a gate's behalf: the engine, which gathers the unit's parameters
/// (stage 3), runs it without saving activations, and recomputes it in backward. Not owned by
/// the gate; the runner detaches itself (UnitGate::attach(nullptr)) before it goes away.
class UnitRunner {
 public:
  virtual std::vector<at::Tensor> run_unit(size_t unit, const std::vector<at::Tensor>& inputs,
                                           const UnitFn& fn) = 0;

 protected:
  ~UnitRunner() = default;
};

/// The sharding-unit mechanism. A module that wants ZeRO-3 (or activation checkpointing) holds a
/// UnitGate and routes each unit's computation through it:
///
///     x = gate(2, {x, mask}, [layer = layers[2]](const auto& in) {
///       return std::vector<at::Tensor>{layer->forward(in[0], in[1])};
///     })[0];
///
/// and lists the units' submodules as UnitSpecs (EngineOptions::units), in the order the forward
/// runs them (unit i of the gate is units[i]). With no runner attached the gate simply calls
/// the function. Under an Engine each call becomes an autograd function whose forward gathers
/// the unit's parameters (stage 3), runs without saving activations and releases them; its
/// backward re-gathers, recomputes with gradients, reduce-scatters the unit's gradients
/// straight into this rank's shard, and releases again. Inputs that require grad get their
/// gradients back; integer outputs are not differentiable.
class UnitGate {
 public:
  std::vector<at::Tensor> operator()(size_t unit, const std::vector<at::Tensor>& inputs,
                                     const UnitFn& fn) const {
    return runner_ == nullptr ? fn(inputs) : runner_->run_unit(unit, inputs, fn);
  }
  /// Routes this gate's units through `runner` from now on (nullptr: call them directly).
  void attach(UnitRunner* runner) { runner_ = runner; }
  bool attached() const { return runner_ != nullptr; }

 private:
  UnitRunner* runner_ = nullptr;
};

/// True on the calling thread while a runner recomputes a unit for backward (ZeRO-3 or
/// activation checkpointing). The unit's outputs then serve only as the starting points of
/// back-propagation: their values are never read. A unit function may use this to skip work
/// whose result nothing inside the unit needs — zerotrain's decoder layers skip the forward
/// product of their last projection, whose backward needs only its input and weight.
bool recomputing_for_backward();

/// Activations a unit keeps for its recomputation (selective checkpointing). In the first pass
/// of a unit that the runner will recompute, keep_for_recompute(t) holds t with the call until
/// the call's backward and returns true; anywhere else it keeps nothing and returns false.
/// During the recomputation, kept_for_recompute() returns what the first pass kept, one tensor
/// per call in the order kept (undefined once none is left). A unit that keeps must take the
/// same decisions in both passes. Calling thread only, like recomputing_for_backward().
bool keep_for_recompute(const at::Tensor& t);
at::Tensor kept_for_recompute();

/// As keep_for_recompute, for activations whose keeping only saves recomputation time (the
/// recomputation could form them again): keeps all of `ts` or none, and only while the bytes so
/// kept by every live unit call of the engine stay within its budget for them
/// (EngineOptions::recompute_keep_bytes). Returns whether it kept them; the recomputation
/// reads them back with kept_for_recompute(), in order, after what keep_for_recompute kept
/// before them. Calling thread only; the budget is shared with backward's threads.
bool keep_for_recompute_if_room(at::TensorList ts);

/// One sharding unit: a name for messages and the submodule whose parameters form it.
struct UnitSpec {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  /// Whether activation checkpointing recomputes this unit in stages 0–2 (ZeRO-3 always
  /// recomputes to re-gather). Off for cheap units whose activations are small anyway.
  bool recompute = true;
};

/// Supplies initial parameter values by name: elements [offset, offset + out.numel()) of the
/// flattened parameter into `out` (any dtype; CPU). With one, the engine places only each rank's
/// slice (ZeRO-3 loading without materializing the whole model) and the model's parameters may
/// live on the meta device. Implementations: zt::checkpoint_source, zt::random_source,
/// zt::checkpoint_master_source. Called from the thread that builds the engine.
class ParameterSource {
 public:
  virtual ~ParameterSource() = default;
  /// Whether this source holds `name` (sources that hold everything answer true).
  virtual bool has(const std::string& /*name*/) const { return true; }
  virtual void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
                    const at::Tensor& out) = 0;
};

}  // namespace zt
