// zt::Engine — the analogue of deepspeed.initialize(): wraps a LibTorch module, shards its
// optimizer state, gradients and (stage 3) parameters across the ranks of a Communicator, and
// runs mixed-precision training steps with DeepSpeed's semantics.
//
// Collective-ness: the constructor, backward(), step() and gather_full_parameters() are
// collectives — every rank calls them in the same order; so is, at stages 1-2, the first unit
// run after step(), which issues the step's parameter all-gathers (overlap_step_gather: the next
// forward starts at the same point on every rank). Threading: one thread drives an
// Engine; LibTorch's autograd threads run its hooks. The Engine does not own the communicator
// exclusively (shared_ptr) but must be the only user of it while it runs, apart from the model
// it trains: an expert-parallel model's exchanges (CausalLM::set_expert_communicator) run inside
// the forwards and backwards the caller drives, in the same order on every rank.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/units.hpp"

namespace zt {

namespace zero {
struct EngineImpl;
}  // namespace zero

struct EngineOptions {
  /// Where the compute copy of the parameters lives (one GPU per rank, or CPU).
  at::Device device = at::kCPU;
  /// Sharding units in forward order (see UnitGate). Required for ZeRO-3 unless the whole
  /// model is one unit; also the activation-checkpointing boundaries.
  std::vector<UnitSpec> units;
  /// The gate the model routes units through; the engine attaches itself to it for its
  /// lifetime (the gate must outlive the engine).
  UnitGate* gate = nullptr;
  /// Recompute units in backward (HF's gradient_checkpointing); implied by stage 3 wherever it
  /// partitions units (several ranks, or parameters offloaded — at one rank without offload
  /// stage 3 has nothing to partition and runs as stage 2).
  bool activation_checkpointing = false;
  /// What recomputed units may keep from their first pass beyond what they must, to skip
  /// products in the recomputation (zt::keep_for_recompute_if_room; the decoder keeps its MLP's
  /// gate and up outputs): a budget in bytes for all unit calls alive at once. 0: nothing;
  /// kAutoKeep: on CUDA, what the device has left — after the first optimizer step, 90% of the
  /// memory this process could use (free + its own reserved) less the step's peak reserved,
  /// the activations' share scaled up for larger batches —, nothing before that, on the CPU, or
  /// with parameters offloaded (a footprint the user asked to keep small).
  static constexpr int64_t kAutoKeep = -1;
  int64_t recompute_keep_bytes = kAutoKeep;
  /// Hold what a recomputed unit saves for its recomputation — its inputs that need a gradient
  /// and what it must keep (zt::keep_for_recompute) — in host memory between its forward and
  /// its backward (page-locked, copied on a side stream; each unit's come back while the unit
  /// after it runs its backward). LLaMA-Factory's use_unsloth_gc. What units keep only to skip
  /// products (recompute_keep_bytes) stays on the device. No effect where no unit is recomputed.
  bool offload_activations = false;
  /// With offload_activations: the most bytes the saved activations may hold in host memory at
  /// once (page-locked ones counted rounded up to a power of two, as the caching host allocator
  /// makes them); a tensor that would pass it stays on the device. 0: three quarters of the
  /// host's available memory (MemAvailable) when the engine is built, shared by the ranks of the
  /// node (LOCAL_WORLD_SIZE).
  int64_t offload_activations_host_bytes = 0;
  /// Units per saved checkpoint (Megatron's recompute_num_layers). N > 1: every unit is
  /// recomputed (UnitSpec::recompute false too), and of up to N consecutive calls, each taking
  /// the one before's output as input, only the first saves its inputs (on the device, or the
  /// host with offload_activations); each other's are rebuilt in its backward by running the
  /// calls before it again, without gradients. Saved inputs shrink N-fold for N(N-1)/2 unit
  /// forwards more per N units. Only activations passed as a call's output to the next call
  /// are rebuilt; a call whose inputs come from elsewhere starts a new span. 1: every recomputed
  /// unit saves its inputs. No effect without checkpointing. InvalidArgument below 1.
  int64_t units_per_checkpoint = 1;
  /// Stages 1 and 2 over several ranks: step() leaves the all-gathers that refresh the compute
  /// copy of a trainable bucket whose parameters all belong to units for the next forward,
  /// which issues them in unit order when its first unit runs and waits for each just before
  /// the first unit reading it, so that the gathers overlap the forward (a bucket holding a
  /// parameter outside every unit, or one step() publishes from offloaded state, is gathered
  /// within step() as before). Until then those parameters hold the previous step's values: a
  /// host reading them other than through units calls wait_for_parameters() first. false:
  /// every gather finishes inside step().
  bool overlap_step_gather = true;
  /// Ranks per node, for hierarchies keeping traffic in a node (consecutive ranks share one). 0:
  /// LOCAL_WORLD_SIZE, else the whole job. ZT_RANKS_PER_NODE overrides both (emulated nodes).
  int ranks_per_node = 0;
  /// Optimizer steps of the whole run, for schedules that count towards its end.
  int64_t total_train_steps = 0;
  /// The learning rate of the optimizer step that follows `applied` applied steps (skipped fp16
  /// steps do not count). Empty: the DeepSpeed config's `scheduler` block, else the
  /// optimizer's constant `lr`. learning_rate_schedule() (zerotrain/schedule.hpp) builds HF
  /// Trainer's.
  std::function<double(int64_t applied)> learning_rate;
  /// Record a trace of bucket launches and backward boundaries (tests, debugging).
  bool trace = false;
  /// Where initial values come from; empty: the module's own values, broadcast from rank 0.
  std::shared_ptr<ParameterSource> source;
  /// Parameters (by name) whose values differ from rank to rank: an expert-parallel model's
  /// experts (each rank's own share, `local_split` says which). They come from `source` (each
  /// rank reads its own); the engine never broadcasts them or shards them over the job — under
  /// ZeRO-3 they stay whole on their rank, as persistent parameters do. A trainable one keeps
  /// whole optimizer state on its rank, and its gradient is summed over `local_split.peers`
  /// (the ranks holding the same share) with the same normalization as every other gradient.
  /// Empty: none. InvalidArgument without a source.
  std::function<bool(const std::string& name)> rank_local;
  /// How the rank-local parameters split over the job (EngineOptions::rank_local).
  struct LocalSplit {
    /// This rank holds block `index` of `blocks` equal blocks along dim 0 of each rank-local
    /// parameter's whole tensor: its checkpoint pieces and gather_full_parameters() are in the
    /// whole's terms.
    int64_t blocks = 1, index = 0;
    /// holders[j]: the rank of this rank's group that holds block j, ascending (this rank at
    /// `index`); gather_full_parameters() assembles the whole from them. Empty: this rank
    /// alone.
    std::vector<int> holders;
    /// The ranks holding the same block as this one, ascending, this rank among them. Empty:
    /// this rank alone.
    std::vector<int> peers;
  } local_split;
  /// With a `source`: called on the constructing thread after each parameter's values are read
  /// from it (reading may quantize or decompose them), with the values this rank has read so
  /// far and will read in all. It may throw (the Trainer throws CancelledError when a stop is
  /// asked): the constructor then stops there and throws it. Reading makes no collective, so
  /// one rank stopping leaves no other waiting inside the constructor. Not kept past the
  /// constructor. May be empty.
  std::function<void(int64_t done, int64_t total)> on_load_progress;
  /// Apply the optimizer to each parameter as soon as its gradient is complete during
  /// backward, then free that gradient, instead of keeping every gradient for step(): the
  /// update is the same, but no full set of gradients ever exists (for pure bf16 on 7B, 15 GB
  /// less at the peak) and no gradient buffer is zeroed or accumulated into. Used only where
  /// that cannot change the math — one rank, ZeRO stage 0–2 (or 3 with nothing partitioned), no
  /// gradient accumulation, no gradient clipping, bf16 or fp32 (not fp16: overflow skips a step),
  /// masters in the compute dtype, no optimizer offload, no parameter shared by two units — and
  /// silently not used elsewhere (updates_in_backward() tells). The caller then passes the
  /// normalizer to backward(loss, divisor); step() with a gradient_scale other than 1 is an error.
  bool update_in_backward = false;
};

/// Values of an Engine's trainable parameters laid out as one rank keeps its compute copy:
/// under ZeRO-3 its shards, below stage 3 the whole of each bucket (Engine::parameter_snapshot).
/// Holds them in the compute dtype, where the compute copy lives (device, or pinned host memory
/// with offload_param). Owned by the caller; only the Engine that made it reads it.
struct ParameterSnapshot {
  std::vector<at::Tensor> buckets;  ///< by bucket; undefined for frozen buckets
  int64_t bytes() const;
};

/// One recorded engine event (EngineOptions::trace).
struct TraceEvent {
  /// kUnitRun: a unit starts (index the unit); kParameterWait: a gather step() left for the
  /// forward is waited for (index the bucket; EngineOptions::overlap_step_gather).
  enum class Kind {
    kBackwardBegin,
    kBucketLaunch,
    kBackwardEnd,
    kUnitGather,
    kUnitRelease,
    kUnitRun,
    kParameterWait
  };
  Kind kind;
  int64_t micro_step;
  int index;  ///< bucket or unit, -1 otherwise
};

/// Memory the engine holds on this rank, by role, in bytes (what ZeRO partitions).
struct EngineMemory {
  int64_t compute_params = 0;   ///< resident compute-dtype parameters (full or shards)
  int64_t gradients = 0;        ///< gradient buffers (full flat grads, shard accumulators)
  int64_t optimizer_state = 0;  ///< fp32 master + moments
  /// Of optimizer_state, with offload_optimizer.ratio < 1: the share kept and updated on the
  /// device (counted on top of the whole host copy, which checkpoints read).
  int64_t device_optimizer_state = 0;
  int64_t gathered_peak = 0;  ///< stage 3: peak of gathered parameter elements
  int64_t gathered_now = 0;   ///< stage 3: gathered parameter elements right now
  /// On a GPU rank, host memory the engine holds (offload: parameter shards, masters, moments,
  /// gradient slots), page-locked or not. What crosses to the GPU every step is page-locked;
  /// the moments, which never do, are not. Both 0 on a CPU rank.
  int64_t host_pinned = 0;
  int64_t host_pageable = 0;
  /// EngineOptions::offload_activations: the most bytes of activations held in host memory at
  /// once so far (on a CPU rank too, where the "host" copies are plain ones).
  int64_t host_activations_peak = 0;
};

/// What a checkpoint keeps of an engine besides tensors: step counters and the loss scaler.
struct EngineState {
  int64_t global_steps = 0;   ///< accumulation boundaries passed (skipped ones included)
  int64_t applied_steps = 0;  ///< optimizer updates applied (what schedules count)
  int64_t micro_steps = 0;
  int64_t optimizer_steps = 0;  ///< the optimizer's own step count (Adam bias correction)
  double loss_scale = 1.0;
  int64_t scaler_iter = 0;
  int64_t scaler_last_overflow_iter = -1;
  int64_t scaler_hysteresis = 1;
};

/// A contiguous run of one trainable parameter's flattened elements in a rank's optimizer state
/// — the unit in which state is saved and restored, independent of bucket layout and world size.
struct StatePiece {
  std::string name;            ///< the parameter's name
  std::vector<int64_t> shape;  ///< the whole parameter's shape
  int64_t begin = 0;           ///< first element, within the flattened parameter
  int64_t length = 0;
};

/// Reads elements [piece.begin, piece.begin + piece.length) of one state kind of a parameter
/// into `out` (CPU, fp32 or the state's dtype). Throws when the checkpoint lacks them.
using StateReader =
    std::function<void(const std::string& kind, const StatePiece& piece, const at::Tensor& out)>;

class Engine {
 public:
  /// Takes over `model`'s trainable parameters (requires_grad) and, under ZeRO-3, all of its
  /// parameters: moves them to `options.device` in the compute dtype (bf16/fp16 per config),
  /// broadcasts rank 0's initial values, and builds the sharded fp32 master and optimizer
  /// state. `ds` must be resolved (check_resolved passes); the learning rate comes from
  /// `options.learning_rate`. Collective.
  /// Throws ConfigError for unusable settings (e.g. no trainable parameters).
  Engine(std::shared_ptr<torch::nn::Module> model, const DeepSpeedConfig& ds,
         std::shared_ptr<Communicator> comm, EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Back-propagates one micro-batch with DeepSpeed's normalization: `loss` is this rank's
  /// mean loss, and the applied gradient is the mean over ranks and accumulation steps.
  /// Collective (reduces gradients as buckets fill).
  void backward(const at::Tensor& loss);
  /// Back-propagates with an explicit normalizer (HF Trainer ≥ 4.46 token normalization):
  /// `loss` is a *sum* (e.g. of token losses on this rank's micro-batch) and the applied
  /// gradient is ∂(Σ over ranks and accumulation steps of loss)/∂θ ÷ `divisor` (e.g. the number
  /// of non-ignored tokens in the global batch). Collective.
  void backward(const at::Tensor& loss, double divisor);
  /// Back-propagates a sum whose normalizer is learned only when the window ends (HF's token
  /// normalization for batches fed one at a time): `loss` is the sum of `count` per-token
  /// losses on this rank's micro-batch, and the applied gradient is ∂(Σ over ranks and the
  /// window's micro-steps of loss)/∂θ ÷ (Σ of their counts). While the window accumulates the
  /// gradients are divided by a fixed estimate (agreed once across ranks), and step() corrects
  /// them to the real count — its all-reduce carries the counts. Do not mix with the other
  /// backward() forms inside one window. Collective.
  void backward_tokens(const at::Tensor& loss, int64_t count);

  /// Ends a micro-step. At an accumulation boundary it runs the optimizer step (unless fp16
  /// overflowed, see last_step_skipped) and returns true; otherwise returns false. Collective.
  /// With updates_in_backward() the update already happened in backward(); step() then checks
  /// the gradient norm and counts the step.
  /// `gradient_scale` multiplies the accumulated gradients at the boundary, before clipping,
  /// the reported norm and the update — for callers that learn the normalizer (e.g. the global
  /// batch's token count) only when the window is complete. Ignored between boundaries.
  /// Throws NumericError for a non-finite gradient in bf16/fp32 or a loss scale at its minimum.
  bool step(double gradient_scale = 1.0);
  /// Whether the next step() call ends an accumulation window (backward() has run for it).
  bool at_boundary() const;

  double learning_rate() const;   ///< of the last (or, before any, the first) optimizer step
  double loss_scale() const;      ///< 1 unless fp16
  double last_grad_norm() const;  ///< global norm before clipping, of the last boundary
  bool last_step_skipped() const;
  int64_t global_step() const;  ///< accumulation boundaries passed (skipped ones included)
  int64_t micro_step() const;   ///< backward() calls so far
  int gradient_accumulation_steps() const;
  at::ScalarType compute_dtype() const;
  int stage() const;
  /// Whether updates run inside backward (EngineOptions::update_in_backward, where allowed).
  bool updates_in_backward() const;

  Communicator& communicator();
  torch::nn::Module& module();

  /// Full fp32 values of every trainable parameter by name (from the master weights), and the
  /// compute-dtype values of frozen ones (unless `trainable_only`, which spares gathering a
  /// frozen base model to save an adapter); rank-local parameters whole, assembled from their
  /// holders (EngineOptions::local_split), in host memory. Collective under stage ≥ 1 or with
  /// rank-local parameters (all-gathers).
  std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters(
      bool trainable_only = false);

  /// Names and shapes of the trainable parameters (the optimizer's), in module order; a
  /// rank-local one's whole shape (EngineOptions::local_split).
  std::vector<std::pair<std::string, std::vector<int64_t>>> trainable_parameters() const;
  /// The kinds of optimizer state kept per trainable element, in order: "master", then
  /// "exp_avg" and "exp_avg_sq" (Adam/AdamW) or "momentum_buffer" (SGD with momentum).
  std::vector<std::string> state_kinds() const;
  /// What this rank contributes to a checkpoint: its pieces of the trainable parameters with a
  /// host copy of each kind's values (state_kinds() order). Under stage 0 every rank holds
  /// everything and rank 0 alone contributes; of the rank-local parameters, the first of the
  /// peers holding a block contributes it, in the whole tensor's elements. Not collective.
  std::vector<std::pair<StatePiece, std::vector<at::Tensor>>> state_pieces() const;
  EngineState state() const;
  /// Restores the optimizer state of every piece this rank holds through `read`, and the
  /// counters, then refreshes the parameters' compute copies from the restored masters. Works
  /// for any world size and stage the state was saved with. Collective.
  void load_state(const StateReader& read, const EngineState& state);

  /// The trainable parameters as `source` holds them (e.g. the model as it started: a frozen
  /// reference model for preference training), laid out as this rank keeps its compute copy —
  /// so ZeRO-3 shards it as it shards the policy. Reads only this rank's part of `source`. Not
  /// collective.
  ParameterSnapshot parameter_snapshot(ParameterSource& source) const;
  /// Exchanges the trainable parameters' compute values with `snapshot`'s: after one call the
  /// module computes with the snapshot's values (the engine's own are in `snapshot`), after a
  /// second it is as before, bit for bit. For forwards without gradients in between (nothing
  /// may train the swapped-in values); not between backward() and step() (InvalidArgument).
  /// Gathered ZeRO-3 units are released first (a hold_units() ends). Not collective, but every rank
  /// swaps before the same forwards (it finishes what wait_for_parameters() would).
  void swap_parameters(ParameterSnapshot& snapshot);

  /// Stage 3 with partitioned units: gathers every unit's parameters and keeps them until
  /// release_units(), so forwards without gradients in between (generation: one forward per
  /// token) gather nothing and need no other rank — ranks may run different numbers of them.
  /// Holds the whole model on each rank meanwhile (EngineMemory's gathered elements say how
  /// much). At other stages it only waits as wait_for_parameters() does. Collective
  /// (all-gathers); not between backward() and step() (InvalidArgument).
  void hold_units();
  /// Issues and waits for the all-gathers step() left for the next forward
  /// (EngineOptions::overlap_step_gather): afterwards every parameter holds the last step's
  /// values. Units wait for their own parameters, and backward(), step(), hold_units(),
  /// swap_parameters(), load_state() and gather_full_parameters() call it; a host that reads the
  /// module's parameters otherwise, or runs units on some ranks only (an evaluation over uneven
  /// shards), calls it first. Collective when gathers are pending: every rank calls it at the
  /// same point. Cheap when none is.
  void wait_for_parameters();
  /// Ends hold_units(): every unit released. Not collective; a no-op when nothing is held.
  void release_units();

  EngineMemory memory() const;
  const std::vector<TraceEvent>& trace() const;

 private:
  std::unique_ptr<zero::EngineImpl> impl_;
};

/// HF's weight-decay rule, by parameter name: biases and normalization weights are excluded
/// (names containing "bias", "layernorm", "rmsnorm", or a path component "norm"/ending "_norm").
bool applies_weight_decay(const std::string& parameter_name);

}  // namespace zt
