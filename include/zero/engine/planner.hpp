// The memory planner (zero-plan): per-GPU and per-host bytes of a training
// configuration by category, before anything is allocated, and the fastest
// configuration that fits a memory budget.
//
//   GPU  = runtime overhead (CUDA context, cuBLAS/cuDNN/NCCL workspaces,
//          allocator slack: given)
//        + model state       (what the engine allocates at construction)
//        + engine buffers    (the engine's own transient peak over two
//                             steps: bucket gradient buffers, stage-3
//                             gathered units, the cache of free blocks;
//                             plus communicator scratch)
//        + activations       (fixed + per-sample bytes, with or without
//                             activation checkpointing, scaled by latent area:
//                             given)
//   host = the engine's pinned host memory per rank (master, optimizer state,
//          EMA and the staging buffers of offload) x ranks per host
//
// The engine part is exact: the planner runs the real Engine on a
// CountingBackend with a SimulatedCommunicator. The library is
// model-agnostic: the activation model, the runtime overhead and the speed
// model are inputs: a model's measured constants live with the model (the
// example trainer's calibration; docs/planner.md).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zero/core/dtype.hpp"
#include "zero/core/layout.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/engine/options.hpp"

namespace zero::plan {

constexpr std::size_t kGiB = std::size_t{1} << 30;

/// Activation bytes of one micro-step on one GPU: fixed + per_sample x batch,
/// each at the reference latent area, then x area_scale (latent h*w over the
/// reference's). "Activations" here are everything the framework (LibTorch)
/// allocates beyond the engine's buffers: saved tensors, the recompute of one
/// block under checkpointing, autograd's transient gradients, the caching
/// allocator's reserve.
struct ActivationModel {
  double fixed_bytes_checkpointed = 0;
  double per_sample_bytes_checkpointed = 0;
  double fixed_bytes_full = 0;  // without activation checkpointing
  double per_sample_bytes_full = 0;
  /// Latent h*w relative to the one the constants were measured at.
  double area_scale = 1.0;
  /// Precision the constants were measured in (bf16); fp32 doubles them.
  std::size_t reference_dtype_bytes = 2;
  /// Where the numbers come from, shown in the table ("calibrated",
  /// "extrapolated from ...", "given").
  std::string source = "none";

  /// Bytes for one micro-step of `batch` samples in a precision of
  /// dtype_bytes, with `recomputed_share` of the checkpointable activation
  /// bytes recomputed (0: no checkpointing, 1: every checkpointable unit;
  /// between: linear from the full to the checkpointed constants, the
  /// share weighted by PlanUnit::activation_weight).
  std::size_t bytes(int batch, double recomputed_share, std::size_t dtype_bytes) const;
};

/// One engine bucket (a stage-3 unit), by its parameter tensors' sizes in
/// elements (one entry is fine when only the total is known; tensors matter
/// for the alignment padding between parameters).
struct PlanUnit {
  std::string name;
  std::vector<std::size_t> tensors;
  /// Recomputed in backward when activation checkpointing is on (a model
  /// may leave small units, such as embeddings and heads, out).
  bool checkpointed = true;
  /// Partial checkpointing (PlanInput::checkpoint_units): the activation
  /// bytes autograd keeps for this unit when it is not recomputed, and the
  /// time its recompute takes, each relative to the model's other units
  /// (e.g. saved elements and forward FLOPs per sample; only ratios matter).
  /// Both 0 on every unit: equal shares.
  double activation_weight = 0;
  double recompute_weight = 0;
  /// Frozen tensors of the unit (sizes): parameters only, no gradient,
  /// master, optimizer state or EMA (ParamSpec::frozen).
  std::vector<std::size_t> frozen_tensors;
  std::size_t numel() const;  // trained and frozen
};

/// The speed model: GPU time of one micro-step, and what checkpointing,
/// stage 3 and offload add (relative time per sample; see docs/planner.md).
/// The defaults are generic; a model's measured values are an input
/// (the example trainer carries its model's, measured on its GPU).
struct SpeedModel {
  double checkpointing_factor = 4.0 / 3.0;  // recompute: one more forward (~1/3 of forward + backward)
  double stage3_gather_cost = 0.0;          // stage 3: x (1 + this / batch)
  double stage_step_cost = 0.0;             // stages 1-2: x (1 + this x stage)
  /// GPU time of one micro-step at stage 0 without checkpointing: fixed +
  /// per sample, for a model of reference_param_count parameters (scaled by
  /// parameters, both, and latent area, per sample, for other models).
  double gpu_seconds_per_step = 0.0;
  double gpu_seconds_per_sample = 1.0;
  /// Measured GPU time of one micro-step at stage 0 without checkpointing
  /// (optimizer excluded), as (batch, seconds) points in increasing batch:
  /// when given, a micro-step's time is interpolated linearly between them
  /// (the first point's below it, gpu_seconds_per_sample per sample beyond the
  /// last) instead of the straight line above. Small batches are far from a
  /// line: launch-bound, and on the H200 batch 1 was slower than batch 2.
  std::vector<std::pair<double, double>> measured_micro_step_seconds;
  /// The on-device optimizer step (and EMA) of the whole model, once per
  /// step; divided by N where the optimizer state is sharded (stages 1-3);
  /// not paid with offload_optimizer (the CPU update replaces it).
  double optimizer_seconds_per_step = 0.0;
  /// Parameters of the model the times were measured on; 0: this model's own.
  double reference_param_count = 0.0;
  double cpu_elements_per_second = 3e9;  // CPU AdamW + EMA every step, per host, offload
  /// The EMA's share of that update's time: its 8 bytes (read and written)
  /// of the 34 a parameter moves (fp32 master, m and v read and written, the
  /// 16-bit gradient in and copy out). Without an EMA the update costs
  /// 1 - share; with EmaOptions::every = k, 1 - share + share / k.
  double cpu_ema_share = 8.0 / 34.0;
  /// offload.ema_on_device: the CPU update without the EMA and without the
  /// model-dtype copy (the fp32 master goes up and the GPU rounds it), as a
  /// share of the update with both (EMA every step). Its own constant: the
  /// copy's cost is not the EMA's by byte count (measured 0.71-0.81 where the
  /// bytes say 26 / 36). The default is the bytes' share.
  double cpu_update_share_ema_on_device = 26.0 / 36.0;
  /// optimizer state_dtype bf16, offloaded: the host update's time as a share
  /// of its time with fp32 state (the same EMA placement). Its own constant:
  /// a host bound by memory gains the bytes' share, one bound by arithmetic
  /// can lose (the stochastic rounding's hash; a 2-core AVX2 host ran 1.22x).
  /// 0: the bytes' share (the same scaling as the device's update).
  double cpu_bf16_state_share = 0.0;
  double pcie_bytes_per_second = 25e9;   // per GPU, offload transfers
  /// offload.delayed_update: forward + backward against the same micro-steps
  /// on the device alone (x this), because the CPU update beside them and the
  /// transfers (parameters up, gradients down) share the host's memory and the
  /// GPU's with them. 1: no slowdown.
  double delayed_offload_fwd_bwd_factor = 1.0;
  /// offload.params: the parameter uploads of stage 3's gathers (forward and
  /// backward of each micro-step), counted as not hidden by compute. They go
  /// up unit by unit as the schedule asks for them, far below the bulk rate
  /// (SDXL on the H200: 22-27 GB/s effective against 50). 0: the bulk rate.
  double param_gather_bytes_per_second = 0.0;
  /// offload.accumulate_on_host: the CPU's gradient additions per host
  /// (dst += src in the gradient dtype), on the thread that drives the GPU.
  double cpu_add_elements_per_second = 10e9;
};

struct PlanInput {
  /// The model: units (preferred: exact padding, stage-3 unit sizes), or a
  /// parameter count grouped into buckets of engine.buckets.bytes.
  std::vector<PlanUnit> units;
  std::size_t param_count = 0;
  std::string model_name;  // for the table ("my-unet", "2.6e9 params")

  int world_size = 1;
  int gpus_per_host = 8;  // ranks sharing one host's memory: min(world_size, this)
  /// The engine exactly as it will run (stage, dtypes, optimizer, EMA,
  /// offload, accumulation, buckets). fit() varies stage, offload and
  /// checkpointing; with a global batch it also searches the micro-batch,
  /// accumulation, the delayed update and, with accumulation, where the
  /// offloaded gradients accumulate (device or host).
  EngineOptions engine{};
  /// NcclCommunicator with HalfReduction::fp32_accumulate: fp32 scratch for
  /// the largest bucket.
  bool fp32_accumulate_reductions = false;

  int batch = 1;  // per GPU and micro-step
  bool activation_checkpointing = false;
  /// With activation_checkpointing: recompute only the first
  /// checkpoint_units units of recompute_order(units), the ones that free
  /// the most activation bytes per second of recompute (0: every unit
  /// marked checkpointed). Needs units.
  std::size_t checkpoint_units = 0;
  ActivationModel activations{};
  /// CUDA context, cuBLAS/cuDNN/NCCL workspaces and allocator slack of one
  /// process on one GPU.
  std::size_t runtime_overhead_bytes = 0;
  SpeedModel speed{};

  /// Throws zero::InvalidArgument naming the field.
  void validate() const;
};

/// Engine buffers beyond the persistent model state: the engine's transient
/// peak over two steps (steady state), by kind at that moment.
struct EngineBuffers {
  std::size_t gathered_units = 0;    // stage 3: live unit buffers at the peak
  std::size_t bucket_buffers = 0;    // gradient buckets and accumulation scratch live at the peak
  std::size_t cached_blocks = 0;     // free blocks kept for reuse at the peak (<= 2 x largest bucket)
  std::size_t comm_scratch = 0;      // communicator workspace
  std::size_t peak() const { return gathered_units + bucket_buffers + cached_blocks + comm_scratch; }
  /// Held after step() returns (the cache plus scratch): what a
  /// cudaMemGetInfo sample between steps sees.
  std::size_t at_step_end = 0;
  /// The steady step's (the second's) transient-block allocations, frees and
  /// host waits for both streams before frees, as step() reports them
  /// (StepResult::block_*, the trainer's engine/block_* metrics): on CUDA
  /// each wait drains the queue of launched work, and each free is a
  /// cudaFree. A pool that keeps its working set makes none mid-step.
  std::size_t allocations_per_step = 0, frees_per_step = 0, waits_per_step = 0;
};

/// What one rank sends in one training step, from the collectives the engine
/// issues (ring algorithms: a reduce-scatter or all-gather of n ranks sends
/// n-1 slices, an all-reduce 2 (n-1)/n of its buffer). Shard groups and the
/// world are taken as consecutive ranks, gpus_per_host of them per node.
struct Traffic {
  int shard_group_size = 1;          // S (N when flat)
  double within_shard_group = 0;     // gathers and reduce-scatters among the S
  double across_replicas = 0;        // hybrid: the reduced shards averaged across the R copies
  bool shard_group_in_node = true;   // S <= gpus_per_host
  bool replicas_in_node = true;      // N <= gpus_per_host
  double intra_node() const {
    return (shard_group_in_node ? within_shard_group : 0) + (replicas_in_node ? across_replicas : 0);
  }
  /// Bytes through the links between nodes: a ring that spans nodes sends
  /// every one of its hops' bytes over them at the pace of the slowest.
  double inter_node() const {
    return (shard_group_in_node ? 0 : within_shard_group) + (replicas_in_node ? 0 : across_replicas);
  }
};

/// The checkpointable units (PlanUnit::checkpointed) by activation bytes
/// freed per recompute time, largest first (ties in model order): the order
/// in which partial checkpointing (PlanInput::checkpoint_units) takes them.
std::vector<std::size_t> recompute_order(const std::vector<PlanUnit>& units);

/// Number of checkpointable units.
std::size_t checkpointable_units(const std::vector<PlanUnit>& units);

/// The shares of the checkpointable units' activation bytes (first) and
/// recompute time (second) that `in` recomputes: Plan::recomputed_*_share.
std::pair<double, double> recomputed_shares(const PlanInput& in);

struct Plan {
  PlanInput input;
  std::size_t padded_numel = 0;
  std::size_t unit_count = 0;
  std::size_t largest_unit_elements = 0;  // padded
  int ranks_per_host = 1;
  Traffic traffic;  // per rank, one step (the second: steady state)

  // ---- per GPU
  MemoryByCategory model_state;  // model_state_bytes (buffers = 0)
  EngineBuffers engine;
  std::size_t activations = 0;
  std::size_t runtime_overhead = 0;
  /// The shares of the checkpointable units' activation bytes and recompute
  /// time that this plan recomputes: 0 without checkpointing, 1 with every
  /// unit, between with PlanInput::checkpoint_units.
  double recomputed_bytes_share = 0;
  double recomputed_time_share = 0;
  /// Units recomputed in backward (0 without checkpointing).
  std::size_t recomputed_units = 0;
  // ---- per rank in host memory
  MemoryByCategory host_state;  // host_model_state_bytes; buffers = transfer (staging) buffers

  /// Predicted peak per GPU: every category at its peak (conservative: the
  /// engine's transient buffers and the activations need not peak together).
  std::size_t gpu_peak() const;
  /// What a sample between steps sees (context + model state + engine cache
  /// + the allocator's activation reserve): the trainer's "mem" metric.
  std::size_t gpu_at_step_end() const;
  /// The least the true peak can be: the between-steps total, or the
  /// engine's in-step peak over the model state and runtime (activations
  /// then at their smallest, counted as 0), whichever is larger. The true
  /// peak lies in [gpu_peak_lower(), gpu_peak()].
  std::size_t gpu_peak_lower() const;
  std::size_t host_per_rank() const { return host_state.total(); }
  std::size_t host_per_host() const { return host_per_rank() * static_cast<std::size_t>(ranks_per_host); }
  /// Relative time per sample (1 = one sample's GPU compute at stage 0, no
  /// checkpointing, no offload), from input.speed.
  double relative_time() const;
  /// Predicted seconds of one optimizer step (all micro-steps, offload,
  /// delayed update overlapped) in the speed model's units: seconds when
  /// the speed model carries measured GPU times (sdxl::calibration), else
  /// relative. Not validated against measured runs across batch sizes.
  double seconds_per_step() const;
  /// world x batch x accumulation / seconds_per_step(): what fit() with a
  /// global batch maximises.
  double images_per_second() const;
  /// The example trainer's keys that select this configuration
  /// ("stage = 2, offload_optimizer = true, ..., batch_size = 4, accumulation = 2").
  std::string trainer_options() const;
  /// A one-line name: "stage 2, offload, checkpointing, batch 1".
  std::string label() const;

  std::string to_json(int indent = 2) const;
  /// Readable table, one category per line, per GPU then per host.
  std::string table() const;
};

/// Predicts the bytes of one configuration. Throws zero::InvalidArgument for
/// invalid inputs (the field named).
Plan make_plan(const PlanInput& input);

/// The parameter groups make_plan's engine is built from: one group a unit
/// (its tensors, then its frozen tensors), or, for a bare parameter count,
/// groups of buckets.bytes. Tests replaying the same engine take them here.
std::vector<std::vector<ParamSpec>> engine_groups(const PlanInput& input);

/// Which end of the peak's range fit() and check_fits() compare.
enum class PeakEstimate {
  upper,  // gpu_peak(): can only be too high (plan a run)
  lower,  // gpu_peak_lower(): can only be too low (refuse only what cannot fit)
};

struct FitOptions {
  /// A configuration fits when its peak <= (1 - safety_margin) x gpu_bytes.
  double safety_margin = 0.05;
  PeakEstimate estimate = PeakEstimate::upper;
  /// Host memory per host (0 = not checked).
  std::size_t host_bytes = 0;
  /// > 0: also search the micro-batch (every divisor of global_batch /
  /// world_size) with accumulation = global_batch / (micro-batch x world),
  /// and the delayed update where the engine allows it (offload_optimizer,
  /// no offload_params, accumulation 1); candidates ranked by
  /// images_per_second(). 0: the base input's batch and accumulation.
  int global_batch = 0;
  /// Stage 3 with real gathers: the chosen plan prefetches as many units
  /// ahead as still fit, up to this many (deepest_prefetch()); the speed
  /// model does not count the depth (uploads are counted as not hidden by
  /// compute at any depth). 0: keep the base input's prefetch_units.
  int max_prefetch_units = 4;
};

struct FitResult {
  std::size_t gpu_bytes = 0;
  FitOptions options;
  /// Every configuration searched (stage 0-3 x offload x checkpointing, and
  /// stage 3 with the parameters offloaded too; the invalid stage-0 offload
  /// left out), fastest first, each with its fit.
  struct Candidate {
    Plan plan;
    bool fits = false;
    std::string why_not;  // "needs 31.2 GiB of 22.8 GiB usable"
  };
  std::vector<Candidate> candidates;
  /// The fastest configuration that fits, when one does.
  std::optional<Plan> best;
  /// When nothing fits: what would (a smaller batch, more GPUs).
  std::vector<std::string> suggestions;
  /// One paragraph: the choice, or that nothing fits and the suggestions.
  std::string summary() const;
  std::string to_json(int indent = 2) const;
  std::string table() const;
};

/// Searches stage (0-3) x offload_optimizer x activation checkpointing (none,
/// every unit, and the fewest units in recompute_order() that make the peak
/// fit when none does not and every unit does) (plus
/// offload_params at stage 3) at the base input's world size and batch
/// (with options.global_batch: micro-batch, accumulation and the delayed
/// update too); everything else is kept. A delayed update in the base input
/// is kept only where the candidate allows it.
FitResult fit(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options = {});

/// `plan` with the deepest buckets.prefetch_units up to
/// options.max_prefetch_units whose peak still fits gpu_bytes (fit()'s
/// test); `plan` itself where no deeper one fits, where it does not gather
/// units (below stage 3, or one rank without offload_params) or where the
/// maximum is not above its depth.
Plan deepest_prefetch(const Plan& plan, std::size_t gpu_bytes, const FitOptions& options = {});

/// Partial checkpointing for one configuration: the fewest units of
/// recompute_order(base.units) to recompute for the peak (options.estimate)
/// to fit gpu_bytes less the margin. 0: no checkpointing fits;
/// checkpointable_units(base.units): only every unit does; nullopt: not even
/// that. base's activation_checkpointing and checkpoint_units are ignored;
/// base needs units.
std::optional<std::size_t> fewest_recomputed_units(const PlanInput& base, std::size_t gpu_bytes,
                                                   const FitOptions& options = {});
/// The same from the plan that recomputes every unit (activation
/// checkpointing on, checkpoint_units 0), for a caller that has made it.
std::optional<std::size_t> fewest_recomputed_units(const Plan& every_unit, std::size_t gpu_bytes,
                                                   const FitOptions& options = {});

/// For a trainer, before it allocates anything: nullopt when the plan's peak
/// (options.estimate) fits cap_bytes with the safety margin, else a message
/// with the prediction, the budget and fit()'s proposal (or suggestions).
/// To fail fast only on what surely cannot fit, pass
/// {.safety_margin = 0, .estimate = PeakEstimate::lower}.
std::optional<std::string> check_fits(const Plan& plan, std::size_t cap_bytes, const FitOptions& options = {});

/// The trainer's refusal under a cap (max_gpu_memory), before it allocates:
/// nullopt when the plan's UPPER bound of the peak is within cap_bytes (no
/// margin), else the predicted peak range, the cap, and a configuration that
/// fits at the same global batch (fit() with global_batch = world x batch x
/// accumulation), with its trainer options.
std::optional<std::string> check_cap(const Plan& plan, std::size_t cap_bytes);

}  // namespace zero::plan
