// The sharding engine. It owns the flat parameter and gradient buffers and
// this rank's optimizer shard, and runs the stage 0..3 schedules against a
// Backend (memory and kernels) and a Communicator (collectives). It knows
// nothing of torch: a model hands it parameter sizes, writes gradients where
// it is told, and reads parameters where it is told.
//
// One step, every stage:
//   for each micro-step:
//     [stage 3: gather_unit(u) before using unit u's parameters, release after]
//     forward/backward; for each parameter: add its gradient into
//     grad_data(id), then grad_ready(id). A bucket whose parameters are all
//     ready is reduce-scattered (average over ranks) at once.
//     finish_micro_step()
//   step(): global grad norm (one scalar all-reduce), overflow check agreed
//   across ranks, clipping and unscaling folded into the optimizer kernel,
//   update of this rank's shard, then the parameter all-gather (stages 1-2).
//
// Every stage reduces gradients with the same bucketed reduce-scatter and
// updates with the same element-wise kernel, so stages 0..3 produce the same
// bits at the same world size.
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/backend.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/stage_plan.hpp"
#include "zero/optim/loss_scaler.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {

/// Transient device memory of the engine (gradient buckets, scratch, stage-3
/// unit buffers, cached free blocks): at the moment it was highest, and now.
struct TransientMemory {
  std::size_t gathered_units_at_peak = 0;
  std::size_t bucket_buffers_at_peak = 0;
  std::size_t cached_blocks_at_peak = 0;
  std::size_t now = 0;
  std::size_t peak() const { return gathered_units_at_peak + bucket_buffers_at_peak + cached_blocks_at_peak; }
};

/// Which pass of a micro-step a model is in (the unit schedule).
enum class Pass { forward, backward };

struct StepResult {
  bool applied = false;      // false: skipped for non-finite gradients
  double grad_norm = 0;      // global L2 norm of the averaged, unscaled gradient, before clipping
  double clip_coefficient = 1;
  double loss_scale = 1;
  std::int64_t step = 0;     // optimizer steps applied so far
  /// Offload: host wall time of step()'s CPU work, the gradient statistics
  /// of streamed gradients (each bucket's are summed on the host worker as
  /// its gradient lands, beside backward: this is what was left to wait for
  /// and to add up; with them summed on the device before the download, the
  /// copy that reads them back, which waits for the last bucket's sums) and
  /// the CPU update (optimizer, and waiting for
  /// gradients still on their way down; the EMA of a synchronous update runs
  /// on a background thread during the next forward and backward, and the
  /// wait for it, if any, is counted here at the next step); 0 without offload.
  double cpu_grad_stats_seconds = 0;
  double cpu_update_seconds = 0;
  /// offload_delayed_update: cpu_update_seconds is the background update
  /// that step() joined (the previous step's), and this is how long step()
  /// waited for it: the part of the CPU update not hidden behind the device.
  double cpu_update_wait_seconds = 0;
  /// Streamed gradients (offload with one micro-step, or
  /// offload.accumulate_on_host): how long the thread that drives the device
  /// waited for the host worker during this step's micro-steps (a bucket's
  /// staging slice still being read by an addition, and the last
  /// micro-step's wait for every addition and statistic): the part of that
  /// host work not hidden behind the device.
  double host_add_wait_seconds = 0;
  /// Offload: the bytes this step queued between host and device memory
  /// (PCIe on a GPU): gradients down, parameters up (after the update, or
  /// with offload_params at every gather of a unit), from the last step() to
  /// this one's end. With the delayed update, the parameters of the update
  /// joined in this step() go up here. 0 without offload.
  std::uint64_t host_to_device_bytes = 0;
  std::uint64_t device_to_host_bytes = 0;
  /// offload.upload_during_backward: how many buckets of the delayed update
  /// joined in this step() went up during this step's backward (the rest
  /// went up at step()). Depends on how far the CPU had got; 0 otherwise.
  std::uint64_t buckets_up_during_backward = 0;
  /// The engine's transient blocks (gathered units, gradient buckets,
  /// scratch) from the last step() to this one's end: new blocks made
  /// (cudaMalloc on a GPU), blocks freed (cudaFree, each batch after a host
  /// wait for both streams) and those waits. In the steady state a handful a
  /// step (the trim at its end); hundreds mean the launch queue drains in
  /// the middle of the passes (bench/results/session19-h100.md).
  std::uint64_t block_allocations = 0;
  std::uint64_t block_frees = 0;
  std::uint64_t block_waits = 0;
};

class Engine {
 public:
  /// Parameters grouped automatically into buckets of about options.buckets.bytes.
  Engine(std::vector<ParamSpec> params, const EngineOptions& options, Communicator& comm,
         Backend& backend);
  /// One bucket per group: the units of stage 3 (e.g. one UNet block each).
  Engine(std::vector<std::vector<ParamSpec>> groups, const EngineOptions& options,
         Communicator& comm, Backend& backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineOptions& options() const { return options_; }
  /// What the stage and options mean for the buffers (computed once).
  const StagePlan& plan() const;
  /// The trainable parameters' layout (every parameter's when none is
  /// frozen): gradients, master weights, optimizer state and EMA follow it.
  /// Its parameter indices are not the engine's once some are frozen.
  const FlatLayout& layout() const { return layout_; }
  /// The frozen parameters' layout: one bucket per unit (empty ones all
  /// padding), no bucket at all when nothing is frozen. Model-dtype values only.
  const FlatLayout& frozen_layout() const { return frozen_layout_; }
  /// This rank's place in its shard group and the group's size (the world
  /// size without hybrid sharding): the layout, the shards and the
  /// checkpoint files follow them.
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  /// Hybrid sharding: which replica of the shard group this rank is in, and
  /// how many there are (0 and 1 without). Replica 0 writes the checkpoint;
  /// the others hold the same state.
  int replica() const { return replica_; }
  int replica_count() const { return replicas_; }
  /// Every parameter, frozen or not, in the order given (the engine's indices).
  const std::vector<ParamSpec>& params() const { return params_; }
  std::size_t param_count() const { return params_.size(); }
  std::size_t unit_count() const { return unit_params_.size(); }
  std::size_t unit_of(std::size_t param) const { return unit_of_.at(param); }
  /// The engine indices of unit u's parameters, in the order given.
  const std::vector<std::size_t>& unit_params(std::size_t unit) const { return unit_params_.at(unit); }
  bool frozen(std::size_t param) const { return params_.at(param).frozen; }
  /// Where param lies: its index in frozen_layout() if frozen, else in layout().
  std::size_t layout_index(std::size_t param) const { return index_in_layout_.at(param); }
  std::size_t frozen_count() const { return frozen_layout_.params().size(); }

  // ------------------------------------------------------------ parameters
  /// Sets parameter `param` from fp32 host values (numel of them). Every rank
  /// must pass the same values; each keeps what its stage needs. The master
  /// copy keeps the fp32 values, the model copy their rounding.
  void set_param(std::size_t param, const float* host_values);
  /// Frozen parameters keep the rounded values only, and are never changed
  /// by the engine again.
  /// Model-dtype values of a parameter, in backend memory. Stages 0-2:
  /// always valid. Stage 3: only while its unit is gathered (frozen ones too).
  const void* param_data(std::size_t param) const;
  /// Stage 3: gathers unit u's parameters (waits for a prefetch if one was
  /// issued). Other stages: no-op. Gathers nest: each needs a release.
  void gather_unit(std::size_t unit);
  /// Stage 3: issues the gather of unit u without waiting for it.
  void prefetch_unit(std::size_t unit);
  void release_unit(std::size_t unit);
  bool unit_gathered(std::size_t unit) const;
  /// Stage 3: units whose full parameters are on the device now, gathered or
  /// prefetched (at most 1 + buckets.prefetch_units once the schedule runs;
  /// their blocks may be larger free blocks the pool reused). Else 0.
  std::size_t units_on_device() const;

  // ------------------------------------------------------------ unit schedule
  // The order in which a model gathers units: the adapter (zero::torch) and
  // the planner both follow it, so what the planner counts is what runs.
  /// The units to prefetch once `unit` is gathered in `pass` (stage 3):
  /// the next buckets.prefetch_units units in the pass's direction (forward:
  /// up, backward: down), none past the ends. The recompute of a
  /// checkpointed unit runs in backward and prefetches downwards like it.
  std::vector<std::size_t> units_to_prefetch(std::size_t unit, Pass pass) const;
  /// gather_unit(unit), then prefetch_unit of each of units_to_prefetch(...).
  /// Leave the unit with release_unit.
  void enter_unit(std::size_t unit, Pass pass);

  // ------------------------------------------------------------ gradients
  /// Where this micro-step's gradient of `param` is to be added (grad dtype,
  /// numel elements, zeroed at the start of the micro-step). A frozen
  /// parameter has none: grad_data and grad_ready refuse it.
  void* grad_data(std::size_t param);
  /// Declares param's gradient complete for this micro-step; the bucket is
  /// reduce-scattered as soon as all its parameters are ready.
  void grad_ready(std::size_t param);
  /// Ends a micro-step: parameters never declared ready count as zero
  /// gradients (unused parameters), every reduction issued is completed.
  void finish_micro_step();
  int micro_step() const;

  /// How a model puts gradients into grad_data(param).
  ///   add: added into zeroed memory (the default; the engine zeroes the
  ///     gradient buffers between micro-steps or steps).
  ///   write_when_clear: where grad_slot_is_clear(param) the model writes
  ///     (copies) the gradient, elsewhere adds it. With a full gradient buffer
  ///     (StagePlan::full_grads) the engine then stops zeroing it: a slot's old
  ///     contents are dead until written, and finish_micro_step zeroes the
  ///     slots of parameters that got no gradient. One pass over the
  ///     gradients less per step (the zero fill) and a read less (the zeros).
  /// Set between steps (no micro-step begun).
  enum class GradientWrites { add, write_when_clear };
  void set_gradient_writes(GradientWrites writes);
  GradientWrites gradient_writes() const;
  /// True when grad_data(param) may be written rather than added to: nothing
  /// of this step is in it yet that the model's gradient must be added to
  /// (false in add mode, where it holds zeros anyway).
  bool grad_slot_is_clear(std::size_t param) const;

  // ------------------------------------------------------------ CUDA graphs (any stage)
  // A micro-step (the stage-3 gathers, forward, backward with its gradient
  // writes and reductions, finish_micro_step) captured once in a CUDA graph
  // on the compute stream and replayed in place of the later ones:
  //   capture begins on the compute stream -> begin_graph_capture() ->
  //   the micro-step as usual, finish_micro_step() included ->
  //   end_graph_capture() -> capture ends;
  //   each later micro-step: prepare_graph_replay() -> replay -> graph_replayed().
  // While capturing, the engine waits for its collectives on the device, not
  // the host, and the transient blocks the capture used are kept for the
  // graph's replays (the graph has their addresses). Needs a capturable
  // communicator (NCCL), one micro-step per step and no offload; throws
  // InvalidArgument naming what is missing otherwise.
  void begin_graph_capture();
  void end_graph_capture();
  bool graph_captured() const;
  /// Before a replay: the work outside the graph that its first nodes must
  /// follow (stages 1-2's parameter gathers, the accumulator's zeroing on the
  /// comm stream) is ordered before the compute stream's next work.
  void prepare_graph_replay();
  /// After a replay: the micro-step is done, as the captured one left it.
  void graph_replayed();

  // ------------------------------------------------------------ optimizer
  /// Applies the optimizer after accumulation_steps micro-steps.
  StepResult step();
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }
  double loss_scale() const { return scaler_.scale(); }
  std::int64_t steps_applied() const { return step_; }
  std::int64_t steps_skipped() const { return skipped_total_; }
  /// Host seconds spent blocked waiting for the engine's collectives to
  /// complete (gradient reduce-scatters, parameter gathers, the gradient
  /// statistics' all-reduce), summed since construction; a caller takes the
  /// difference around a phase. On host communicators this is time spent
  /// waiting for slower ranks and the transfer itself. On device
  /// communicators the host blocks on an event recorded after the collective,
  /// so it also covers device work queued before it (Work::wait); no wait is
  /// added for the measurement.
  double comm_wait_seconds() const;

  // ------------------------------------------------------------ inspection (collective)
  /// All parameters as fp32 master values, in parameter order, each numel long
  /// (collective: every rank must call it). For tests, exports and validation
  /// images. Frozen parameters (here and in the EMA) are their model-dtype
  /// values widened. Reading leaves the next step as it would be: with the
  /// delayed offload update it waits for the running update (the values are
  /// the latest) but leaves its upload to the next step. Gathered one bucket
  /// at a time through a bucket-sized device buffer.
  std::vector<std::vector<float>> gather_master_params();
  /// All parameters as model-dtype values widened to float (collective).
  /// Settles the engine first: a finished delayed update is sent up.
  std::vector<std::vector<float>> gather_model_params();
  /// The EMA weights (collective); throws when EMA is off.
  std::vector<std::vector<float>> gather_ema_params();

  /// Which weights visit_params reads: the fp32 master weights or their EMA.
  enum class Weights { master, ema };
  /// One parameter's values for visit_params: `numel` elements of `dtype`
  /// (fp32 for trained parameters, the model dtype for frozen ones) in the
  /// backend's memory (the GPU's on a device backend), valid only until the
  /// visitor returns: a visitor that copies them on a stream of its own
  /// waits for that copy before returning.
  using ParamVisitor = std::function<void(std::size_t param, const void* values, DType dtype, std::size_t numel)>;
  /// What gather_master_params / gather_ema_params return, handed to
  /// `visit` once per parameter (engine order within each bucket, trained
  /// buckets first) where the engine gathers them, without a host copy: for
  /// readers that want the weights on the device (the trainer's validation
  /// images). Collective: every rank calls it (a rank that wants nothing
  /// passes a visitor that does nothing). Leaves the next step as the
  /// gathers do. Throws for Weights::ema when EMA is off.
  void visit_params(Weights which, const ParamVisitor& visit);

  // ------------------------------------------------------------ checkpoints
  /// Writes this rank's part of the training state to one safetensors file
  /// (atomically): master weights, optimizer moments and EMA of the slices it
  /// owns, plus step, loss-scaler state and the layout as metadata. The
  /// format does not depend on the stage: a stage-0 engine writes its own
  /// slices only, so a checkpoint can be resumed at another stage.
  /// `metadata` adds string entries (the trainer's config, RNG states...).
  void save_state(const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata = {});
  /// Restores what save_state wrote for this rank, at the same world size and
  /// placement (same units, order and alignment; any stage); the model
  /// parameters are recomputed from the master weights. Collective. Throws
  /// zero::IoError naming the file and the mismatch; for a checkpoint of the
  /// same parameters placed otherwise it names load_state_resharded.
  void load_state(const std::string& path);
  /// Whether load_state can restore from `path` (any rank's file of a
  /// checkpoint) alone: the checkpoint places the parameters exactly as this
  /// engine does (same world size, units, order and alignment). False for the
  /// same parameters placed otherwise (load_state_resharded restores those);
  /// throws zero::IoError, as load_state would, for another model or a file
  /// that is not a shard. Reads the file's metadata only; not collective.
  bool saved_layout_matches(const std::string& path) const;
  /// Restores a state saved at any world size (and any stage), given every
  /// old rank's file in rank order: each rank reads the elements of its new
  /// slices from whichever old shards hold them. The model must hold the same
  /// parameters (names, sizes, shapes, groups, the same ones frozen); they are
  /// matched by name, so their order and grouping into units may differ, as
  /// may padding and alignment. Collective.
  void load_state_resharded(const std::vector<std::string>& rank_files);
  /// The optimizer state tensor `slot` (0 or 1) of every parameter, widened to
  /// float where state_dtype is bf16 (collective; tests); empty for frozen parameters.
  std::vector<std::vector<float>> gather_optimizer_state(int slot);

  // ------------------------------------------------------------ memory
  /// Bytes held now, by category (communicator workspace in buffers).
  MemoryByCategory memory() const;
  /// The most held at once, per category, since construction.
  MemoryByCategory peak_memory() const;
  /// What model_state_bytes() predicts for this engine's padded layout.
  MemoryByCategory predicted_model_state() const;
  /// Host (pinned) bytes the engine holds: offloaded master, state, EMA and
  /// staging buffers; all zero without offload_optimizer.
  MemoryByCategory host_memory() const;
  /// The memory model's prediction of host_memory().
  MemoryByCategory predicted_host_state() const;
  /// Transient device memory now and at its highest (the planner's engine buffers).
  TransientMemory transient_memory() const;
  /// How many step() calls come before the steady step, the first whose
  /// pool calls, traffic and blocks every later step repeats (the planner's
  /// replay counts that one): 1 (the first step makes the working set), more
  /// with the delayed update (its warm-up, then the step that starts the
  /// first background update and the one whose backward first sends one up).
  int steps_before_steady() const;

 /// The engine's buffers and bookkeeping (src/engine/engine_impl.hpp): opaque
  /// here, shared by the engine's source files and its updaters.
  struct Impl;

 private:
  struct Units;  // the units split into trainable and frozen parameters (engine.cpp)
  std::unique_ptr<Impl> impl_;
  void restore_state(const std::array<const float*, 4>& tensors, const std::vector<float>& frozen_shard,
                     const std::string& state_json, const std::string& path);
  std::vector<std::vector<float>> gather_fp32_slices(const std::function<const float*(std::size_t)>& slice);
  /// The same for slices stored as `dtype` (widened to float on the host).
  std::vector<std::vector<float>> gather_slices(const std::function<const void*(std::size_t)>& slice, DType dtype);
  /// Trainable parameters (layout order) widened, frozen ones from their own
  /// buffers, back in the engine's order (collective).
  std::vector<std::vector<float>> in_engine_order(std::vector<std::vector<float>> trainable);
  std::vector<std::vector<float>> gather_frozen_params();
  GradStats local_grad_stats(StepResult& result);
  /// The index of a trainable parameter in layout(); throws for a frozen one.
  std::size_t trainable_index(std::size_t param, const char* what) const;
  void* trainable_grad_data(std::size_t t);
  void trainable_grad_ready(std::size_t t);
  Engine(Units units, const EngineOptions& options, Communicator& comm, Backend& backend);
  /// The collectives' communicator: the shard group's with hybrid sharding, else the world's.
  Communicator& shard_comm(Communicator& world);

  EngineOptions options_;
  std::vector<ParamSpec> params_;
  std::vector<std::size_t> index_in_layout_;  // engine index -> index in layout_ or frozen_layout_
  std::vector<std::size_t> unit_of_;
  std::vector<std::vector<std::size_t>> unit_params_;
  FlatLayout layout_;
  FlatLayout frozen_layout_;
  HybridGroups hybrid_;  // empty without hybrid sharding
  int rank_ = 0;
  int world_ = 1;
  int replica_ = 0;
  int replicas_ = 1;
  std::int64_t step_ = 0;
  std::int64_t skipped_total_ = 0;
  int consecutive_nonfinite_ = 0;
  double lr_ = 0;
  DynamicLossScaler scaler_;
};

}  // namespace zero
