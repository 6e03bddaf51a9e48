// The engine's state, shared by its three parts: engine.cpp (set-up, step, public API),
// gradients.cpp (hooks, buckets, reductions) and units.cpp (sharding units: gather, release,
// recompute).
#pragma once

#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include <torch/csrc/autograd/function.h>

#include "optim/schedule.hpp"
#include "optim/shard_optimizer.hpp"
#include "precision/loss_scaler.hpp"
#include "zero/layout.hpp"
#include "zerotrain/engine.hpp"

namespace zt {

namespace zero {

/// Engine's state and internals (the engine's UnitRunner: units.cpp runs the gate's units).
struct EngineImpl final : UnitRunner {
  // ---- configuration (fixed after construction) ----
  DeepSpeedConfig ds;
  TrainingArguments args;
  EngineOptions options;
  std::shared_ptr<torch::nn::Module> model;
  std::shared_ptr<Communicator> comm;
  int stage = 0, world = 1, rank = 0, accumulation = 1;
  at::Device device = at::kCPU;
  at::ScalarType compute = at::kFloat;  ///< dtype of the module's parameters
  at::ScalarType wire = at::kFloat;     ///< dtype of gradient reductions
  bool overlap = false;                 ///< reduce buckets while backward runs
  bool use_reduce_scatter = true;
  double pre_scale = 1.0, post_scale = 1.0;  ///< around each gradient reduction (product 1/world)
  bool offload_optimizer = false, offload_param = false;
  bool checkpointing = false;                ///< recompute units in backward
  at::ScalarType master_dtype = at::kFloat;  ///< fp32, or bf16 with bf16_master_weights_and_grads
  /// The master slice IS the compute copy (bf16 masters where a rank keeps whole buckets).
  bool master_aliases_params = false;
  /// One rank and the accumulator in the compute dtype: every parameter's .grad is a view into
  /// grad_acc, so autograd accumulates there and no reduction, copy or staging is needed.
  bool grads_in_acc = false;
  /// EngineOptions::update_in_backward in effect: each parameter is updated by its gradient's
  /// hook and the gradient dropped; there is no gradient buffer (grad_acc is empty).
  bool in_backward = false;
  int64_t prefetch_elements = 0, max_live_elements = 0;
  zero::Layout layout;

  // ---- per-bucket storage ----
  struct BucketState {
    at::Tensor flat_param;    ///< full compute-dtype values (resident, or gathered stage-3)
    at::Tensor flat_grad;     ///< stages 0/1: the .grad of every parameter is a view into it
    at::Tensor param_shard;   ///< stage 3 units: this rank's compute-dtype slice (persistent)
    at::Tensor staging;       ///< stage 2/3: gradients of this micro-step, until reduced
    int expected = 0;         ///< parameters whose gradient readiness is awaited
    bool slice_fresh = true;  ///< grad_acc's slice holds nothing of this window yet (copy, not add)
    int ready = 0;
    bool launched = false;
  };
  std::vector<BucketState> buckets;
  std::unordered_map<const void*, int> param_of_impl;  ///< TensorImpl* → ParamInfo index
  std::vector<int> bucket_of_param, slot_of_param;     ///< ParamInfo index → bucket, position
  std::vector<char> fired;  ///< per parameter: its gradient arrived in the current backward

  // ---- optimizer state (this rank's slices of the trainable buckets) ----
  at::Tensor master;    ///< fp32, on device or (offload) host
  at::Tensor grad_acc;  ///< fp32 reduced gradients of this rank's slices, accumulated
  /// Offload: pinned host slots the CPU optimizer reads gradients from, a few trainable
  /// buckets' worth (each as long as the longest slice), reused round-robin during a step —
  /// not a host copy of all of grad_acc (4 bytes per parameter fewer in host memory).
  std::vector<at::Tensor> grad_slots;
  std::unique_ptr<ShardOptimizer> optimizer;
  std::vector<std::vector<Segment>> bucket_segments;  ///< per trainable bucket, its slice's runs
  /// in_backward: per parameter, its runs of the state and the offset of its first element.
  std::vector<std::vector<Segment>> param_segments;
  std::vector<int64_t> param_state_offset;
  UpdateHyper backward_hyper;  ///< in_backward: the update of the step under way
  at::Tensor
      param_grad_sq;  ///< in_backward: Σ g² of each parameter's gradient this step (0 if none)
  LrSchedule schedule;
  LossScaler scaler;

  // ---- step bookkeeping ----
  int64_t micro_steps = 0, global_steps = 0, applied_steps = 0;
  double last_norm = 0.0, last_lr = 0.0;
  bool last_skipped = false;
  bool awaiting_step = false;   ///< backward() ran; step() must follow
  bool reducing = false;        ///< gradients are reduced during the current backward
  int next_launch = 0;          ///< buckets launch strictly in index order
  at::Tensor nonfinite_losses;  ///< count of non-finite losses since the last boundary

  struct Pending {
    WorkHandle work;
    int bucket = -1;
    at::Tensor output;      ///< reduce-scatter output slice (wire dtype)
    at::Tensor input;       ///< kept alive until done
    bool in_place = false;  ///< stage 0: the all-reduce result is the flat grad itself
  };
  std::deque<Pending> pending;

  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  ///< hooks live with them
  std::vector<TraceEvent> trace;

  // ---- sharding units ----
  enum class UnitStatus { kReleased, kGathering, kGathered };
  struct UnitState {
    UnitStatus status = UnitStatus::kReleased;
    std::vector<WorkHandle> gathers;
    std::vector<at::Tensor> sources;  ///< shard copies on the device while gathering
    int64_t elements = 0;             ///< gathered elements when gathered
  };
  std::vector<UnitState> units;
  int64_t gathered_now = 0, gathered_peak = 0;
  at::Tensor dummy;  ///< requires grad, so every unit call has a backward
  int unit_depth = 0;

  // parameter all-gathers after a step
  std::vector<WorkHandle> param_gathers;
  std::vector<at::Tensor> param_gather_inputs;
  int64_t gathering_elements = 0;

  // engine.cpp
  void record(TraceEvent::Kind kind, int index);
  void offloaded_step(const UpdateHyper& h);
  /// Writes a trainable bucket's updated fp32 slice `mine` into its compute copy (all-gathers
  /// when others hold the rest).
  void publish(const zero::Bucket& b, const at::Tensor& mine);
  void finish_publishing();
  bool at_boundary() const { return micro_steps % accumulation == 0; }

  // gradients.cpp
  void install_hooks();
  void begin_backward();
  void on_gradient(int param_index);
  void update_now(int param_index);  ///< in_backward: one parameter's update from its .grad
  UpdateHyper step_hyper(double grad_scale) const;
  void try_launch();
  void launch(int bucket);
  void complete_oldest();
  void finish_backward();
  at::Tensor slice_of(int bucket, const at::Tensor& state) const;
  void reduce_unit_gradients(int bucket);

  // units.cpp
  std::vector<at::Tensor> run_unit(size_t unit, const std::vector<at::Tensor>& inputs,
                                   const UnitFn& fn) override;
  void gather(size_t unit, bool forward_order);
  void start_gather(size_t unit);
  void finish_gather(size_t unit);
  void release(size_t unit);
  void prefetch_after(size_t unit, bool forward_order);
  void bind_unit_params(size_t unit, bool gathered);
};

}  // namespace zero
}  // namespace zt
