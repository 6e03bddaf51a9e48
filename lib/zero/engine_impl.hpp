// The engine's state, shared by its parts. Each part is a file that reads alone:
//
//   settings.cpp          what the engine does (a pure function of config, options and world)
//   setup.cpp             the constructor's phases: parameters, layout, state, buckets, parts
//   engine.cpp            backward(), step() and the public API
//   gradients.cpp         the bucket scheduler every gradient path shares: hooks, in-order
//                         launches, the in-flight bound
//   gradients_stage0.cpp  stage 0: all-reduce;  gradients_stage1.cpp  stage 1: flat
//                         reduce-scatter;  gradients_stage2.cpp  stages 2/3: staged
//                         reduce-scatter;  gradients_one_rank.cpp  one rank: no collective
//   update_in_backward.cpp  the optimizer inside backward (one rank, no accumulator)
//   offload.cpp           the optimizer on the CPU, pipelined per bucket (with a share on
//                         the device under offload_optimizer.ratio)
//   units.cpp             sharding units: ZeRO-3 gathers, releases, recomputation
//   keep_budget.cpp       how much recomputed units may keep beyond need
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

#include <torch/csrc/autograd/function.h>

#include "optim/shard_optimizer.hpp"
#include "precision/loss_scaler.hpp"
#include "zero/keep_budget.hpp"
#include "zero/layout.hpp"
#include "zero/settings.hpp"
#include "zerotrain/engine.hpp"

namespace zt::zero {

struct EngineImpl;

/// A bucket reduction in flight.
struct Pending {
  WorkHandle work;
  int bucket = -1;
  at::Tensor output;      ///< the reduced values of this rank's slice (wire dtype), if any
  at::Tensor input;       ///< kept alive until done
  bool in_place = false;  ///< stage 0: the all-reduce result is the flat gradient itself
};

/// How gradients get from autograd into this rank's accumulator slices: one implementation
/// per GradientPath (make_gradient_strategy). The shared scheduler in gradients.cpp decides
/// *when* (hooks, in-order launches); a strategy decides *where* gradients go and *how* a
/// bucket is reduced.
class GradientStrategy {
 public:
  explicit GradientStrategy(EngineImpl& engine) : e_(engine) {}
  virtual ~GradientStrategy() = default;

  /// Whether the backward of micro-step `micro` (0-based) reduces buckets.
  virtual bool reduces(int64_t micro) const;
  virtual void begin_backward() {}
  /// A resident trainable parameter's gradient is complete (`again`: a tied weight's next
  /// share in the same backward).
  virtual void take(int param, bool again) = 0;
  /// Where a stage-3 unit bucket's gradients accumulate during its unit's backward.
  virtual at::Tensor unit_gradients(int bucket);
  /// Starts the reduction of a bucket.
  virtual Pending launch(int bucket) = 0;
  /// Folds a finished reduction into this rank's slice of the accumulator.
  virtual void complete(Pending& done) = 0;
  /// Reductions allowed in flight before the oldest is completed (bounds staging memory).
  virtual size_t max_in_flight() const { return 2; }
  /// At a boundary, before the step reads the accumulator: zero the slices this window never
  /// wrote (a unit that did not run), which still hold the last window's values.
  virtual void before_step();
  /// After a step, applied or skipped: ready the buffers for the next window.
  virtual void clear();

 protected:
  /// Accumulates `result` × `post` into the bucket's slice (copies at a window's first).
  void fold_into_slice(int bucket, const at::Tensor& result, double post);
  /// Stages 0/1: autograd accumulated into the bucket's flat-gradient view in place; if it
  /// replaced the .grad (it does when the old one is shared elsewhere), fold it back.
  void keep_in_flat_gradient(int param);

  EngineImpl& e_;
};

/// The strategy of engine.S.gradients (gradients.cpp), and the parts it picks from.
std::unique_ptr<GradientStrategy> make_gradient_strategy(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_stage0_gradients(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_stage1_gradients(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_stage2_gradients(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_one_rank_gradients(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_in_accumulator_gradients(EngineImpl& engine);
std::unique_ptr<GradientStrategy> make_in_backward_update(
    EngineImpl& engine);  ///< sets in_backward

/// Reduce-scatters `input` (a whole bucket in the wire dtype, scaled in place by pre_scale)
/// into this rank's slice, or all-reduces it where zero_optimization.reduce_scatter is off
/// (gradients_stage1.cpp; stages 1–3 share it).
Pending scatter_bucket(EngineImpl& engine, int bucket, at::Tensor input);
/// A gradient for a bucket already reduced this micro-step: a parameter used by two units
/// that are not both registered for it (InvalidArgument, naming it).
[[noreturn]] void throw_late_gradient(const ParamInfo& p);

/// Where one parameter lives (one record per layout parameter, by its index).
struct ParamSlot {
  int bucket = -1;
  int64_t offset = 0;              ///< in its bucket's flat space
  bool fired = false;              ///< its gradient arrived in the current backward
  std::vector<Segment> state_run;  ///< update_in_backward: its elements in the flat state
};

struct BucketState {
  at::Tensor flat_param;   ///< full compute-dtype values (resident, or gathered stage-3)
  at::Tensor flat_grad;    ///< stages 0/1: the .grad of every parameter is a view into it
  at::Tensor param_shard;  ///< stage 3 units: this rank's compute-dtype slice (persistent)
  /// hpZ (EngineSettings::hpz_group): this rank's part of the gathered whole among its hpZ group,
  /// kept from the last gather over the job until the values change; gathers within the group
  /// read it instead.
  at::Tensor secondary;
  at::Tensor staging;       ///< stage 2/3: gradients of this micro-step, until reduced
  int expected = 0;         ///< parameters whose gradient readiness is awaited
  bool slice_fresh = true;  ///< grad_acc's slice holds nothing of this window yet (copy, not add)
  int ready = 0;
  bool launched = false;
};

class InBackwardUpdate;
class OffloadedOptimizer;
class CopyStream;
struct ActivationHost;

// The engine's changing state, in groups, each written by one part (named with it) and read by
// the others. A reader that changed one would break the writer's invariants stated here.

/// Step counters and what the last step did. Written by engine.cpp (backward, step) and by
/// update_in_backward.cpp (the step it takes inside backward). Invariants: applied ≤ global;
/// `global` counts boundaries passed, so micro == global × accumulation at a boundary and
/// between boundaries global == micro / accumulation rounded down; awaiting_step holds from
/// a backward() until the step() that must follow it.
struct StepCounters {
  int64_t micro = 0, global = 0, applied = 0;
  double last_norm = 0.0, last_lr = 0.0;
  bool last_skipped = false;
  bool awaiting_step = false;
  at::Tensor nonfinite_losses;  ///< count of non-finite losses since the last boundary (device)
};

/// backward_tokens' window (engine.cpp alone): the window's fixed divisor, set by its first
/// call and kept for the run, and the counts fed so far. `open`: the window now accumulating
/// was fed through backward_tokens; step() corrects the gradients by estimate / counted tokens
/// and closes it.
struct TokenWindow {
  double estimate = 0.0, count = 0.0;
  bool open = false;
};

/// The bucket scheduler (gradients.cpp alone). Buckets launch strictly in index order:
/// next_launch is the first bucket not launched in this backward; `pending` holds the launched,
/// not yet completed reductions in launch order, at most the strategy's
/// max_in_flight() once a launch returns, and none after finish_backward (which launches what a
/// reducing backward left).
/// `reducing`: this backward reduces (GradientStrategy::reduces of its micro-step).
struct LaunchQueue {
  bool reducing = false;
  int next_launch = 0;
  std::deque<Pending> pending;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  ///< hooks live with them
};

/// Stage 3's gathered parameters (units.cpp alone; memory() reads it). gathered_now is the sum
/// of the elements of the units gathered or gathering; before a unit gathers, prefetched units
/// are released until it fits S.max_live_elements (or none is left to release). depth is 1
/// while a unit's function runs: units cannot nest.
struct UnitResidency {
  int64_t gathered_now = 0, gathered_peak = 0;
  int depth = 0;
  bool held = false;  ///< Engine::hold_units: forwards without gradients release nothing
};

/// The all-gathers of updated parameters after a step (engine.cpp's publish and
/// finish_publishing): grouped up to S.allgather_bucket_size elements; `inputs` kept alive until
/// they are waited on, at the end of the step. With EngineOptions::overlap_step_gather the
/// buckets of EngineImpl::step_gather_unit wait in `deferred` instead, by the unit before which
/// each must be complete: the next unit to run issues them all in that order (each input made
/// from the masters then, so nothing is held meanwhile) and waits for those its unit needs.
struct Publishing {
  std::vector<WorkHandle> gathers;
  std::vector<at::Tensor> inputs;
  int64_t elements = 0;
  struct Deferred {
    int unit = 0;
    int bucket = 0;
    WorkHandle gather;  ///< once issued
    at::Tensor input;
  };
  std::vector<Deferred> deferred;
  size_t next_wait = 0;  ///< deferred[next_wait..] are not waited for yet
};

/// Reads the part of bucket `b` that a rank keeps, elements [begin, begin + len) of its flat
/// space, straight from `source`, as fp32 on `device` (a raw bucket: its bytes); `staging` a
/// host buffer reused across calls for a GPU (setup.cpp). `on_read`, when given, hears the
/// elements of each parameter read.
at::Tensor read_bucket(ParameterSource& source, const Layout& L, const Bucket& b, int64_t begin,
                       int64_t len, const at::Device& device, at::Tensor& staging,
                       const std::function<void(int64_t elements)>& on_read = nullptr);

/// Engine's state and internals (the engine's UnitRunner: units.cpp runs the gate's units).
struct EngineImpl final : UnitRunner {
  EngineImpl();
  ~EngineImpl();

  // ---- what was decided (fixed after construction) ----
  EngineSettings S;
  EngineOptions options;
  std::shared_ptr<torch::nn::Module> model;
  std::shared_ptr<Communicator> comm;
  Layout layout;
  /// The ranks holding this rank's rank-local values (EngineOptions::local_split.peers, or
  /// this rank alone): local buckets are reduced over them, and the first speaks for them.
  std::vector<int> local_peers;
  bool local_leader = true;
  /// MiCS (EngineSettings::shard_group below the world): the ranks of this rank's shard group,
  /// among which other buckets are cut and gathered, and the ranks holding the same slices in the
  /// other groups, over which those slices' gradients are summed; the first group speaks for
  /// the slices (the norm, checkpoints). Without MiCS the world and this rank alone.
  std::vector<int> shard_peers, replica_peers;
  /// hpZ: the consecutive ranks (EngineSettings::hpz_group) whose secondary parts make a whole;
  /// empty without hpZ.
  std::vector<int> hpz_peers;
  /// qgZ's two hops where the job spans nodes (EngineOptions::ranks_per_node between 1 and the
  /// world): this rank's node, and the ranks at its place on every node. Empty otherwise.
  std::vector<int> node_peers, place_peers;
  bool hybrid() const { return replica_peers.size() > 1; }
  bool writes_slices() const { return S.rank < S.shard_group; }
  /// Starts the all-gather of bucket `b`'s slices `mine` into `whole` among the ranks cutting it.
  WorkHandle gather_bucket(const Bucket& b, const at::Tensor& whole, const at::Tensor& mine);
  /// The dtype a bucket's parameters are kept in: the compute dtype, or uint8 for raw bytes.
  at::ScalarType stored_dtype(const Bucket& b) const { return b.raw ? at::kByte : S.compute; }

  // ---- storage ----
  std::vector<BucketState> buckets;
  std::vector<ParamSlot> slots;  ///< by layout parameter index
  at::Tensor master;    ///< this rank's slices of the trainable buckets: fp32 (or bf16) masters
  at::Tensor grad_acc;  ///< the reduced gradients of those slices, accumulated over a window
  std::unique_ptr<ShardOptimizer> optimizer;
  std::vector<std::vector<Segment>> bucket_segments;  ///< per trainable bucket, its slice's runs
  std::function<double(int64_t)> learning_rate;       ///< of the step after n applied steps
  LossScaler scaler;

  // ---- parts ----
  std::unique_ptr<GradientStrategy> gradients;
  InBackwardUpdate* in_backward = nullptr;  ///< `gradients`, when it updates inside backward
  std::unique_ptr<OffloadedOptimizer> offload;

  // ---- step bookkeeping (the groups above say who writes them) ----
  StepCounters steps;
  TokenWindow tokens;
  LaunchQueue queue;
  std::vector<TraceEvent> trace;  ///< engine.cpp's record(), when options.trace

  // ---- sharding units ----
  enum class UnitStatus { kReleased, kGathering, kGathered };
  struct UnitState {
    UnitStatus status = UnitStatus::kReleased;
    std::vector<WorkHandle> gathers;
    std::vector<at::Tensor> sources;  ///< shard copies on the device while gathering
    std::vector<int> keep_secondary;  ///< hpZ: buckets gathered over the job, to keep a part of
    std::vector<int64_t> uploads;     ///< one rank: offloaded shards coming up (param_uploads)
    int64_t elements = 0;             ///< gathered elements when gathered
  };
  std::vector<UnitState> units;
  /// One rank with offloaded parameters: shards come up on this side stream while the GPU
  /// computes (the next unit's during this one's); null elsewhere.
  std::unique_ptr<CopyStream> param_uploads;
  /// EngineOptions::offload_activations: the copies of recomputed units' saved activations to
  /// the host and back (units.cpp); null without it.
  std::shared_ptr<ActivationHost> activation_host;
  UnitResidency residency;
  at::Tensor dummy;  ///< requires grad, so every unit call has a backward
  std::shared_ptr<KeepBudget> keep_budget = std::make_shared<KeepBudget>();

  // ---- parameter all-gathers after a step ----
  Publishing publishing;
  /// By bucket: the first unit reading a trainable bucket whose gather after a step waits for
  /// the next forward (EngineOptions::overlap_step_gather); -1 for those gathered within step().
  std::vector<int> step_gather_unit;

  // setup.cpp: the constructor's phases, in order
  void collect_parameters(const DeepSpeedConfig& ds);
  void check_state_fits() const;
  void allocate_state();
  void place_buckets();
  void bind_parameters();
  void create_parts();

  // engine.cpp
  void record(TraceEvent::Kind kind, int index);
  UpdateHyper step_hyper(double grad_scale) const;
  /// Writes a trainable bucket's updated slice `mine` into its compute copy (all-gathers
  /// when others hold the rest).
  void publish(const Bucket& b, const at::Tensor& mine);
  /// Waits for what publish() issued (not the deferred gathers).
  void wait_published();
  /// Issues the deferred gathers (once) and waits for those complete before `unit` runs.
  void wait_gathers_before(int64_t unit);
  /// Every gather of the last step issued and waited for (Engine::wait_for_parameters).
  void finish_publishing();
  bool at_boundary() const { return steps.micro % S.accumulation == 0; }
  at::Tensor slice_of(int bucket, const at::Tensor& state) const;

  // gradients.cpp: the bucket scheduler
  void install_hooks();
  void begin_backward();
  void on_gradient(int param_index);
  void try_launch();
  void launch(int bucket);
  void complete_oldest();
  void finish_backward();
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

}  // namespace zt::zero
