// The memory planner (zero-plan): per-GPU and per-host bytes of a training
// configuration by category, before anything is allocated, and the fastest
// configuration that fits a memory budget.
//
//   GPU  = runtime overhead (CUDA context, cuBLAS/cuDNN/NCCL workspaces,
//          allocator slack)
//        + model state       (model_state_bytes: params, grads, master,
//                             optimizer state, EMA)
//        + engine buffers    (simulated from the engine's allocation rules:
//                             bucket gradient buffers, stage-3 gathered
//                             units, the cache of free blocks, communicator
//                             scratch)
//        + activations       (fixed + per-sample bytes, with or without
//                             activation checkpointing, scaled by latent area)
//   host = host_model_state_bytes per rank (pinned master, optimizer state,
//          EMA and the transfer buffers of offload_optimizer) x ranks per host
//
// The activation model and the runtime overhead are calibrated on the SDXL
// UNet on one H200 (docs/planner.md lists which run sets which constant and
// the error on every recorded run).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "zero/core/dtype.hpp"
#include "zero/engine/memory_model.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {
struct EngineOptions;
}

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
  /// Latent h*w relative to the calibration's (128 x 128 for SDXL at 1024 px).
  double area_scale = 1.0;
  /// Precision the constants were measured in (bf16); fp32 doubles them.
  std::size_t reference_dtype_bytes = 2;
  /// Where the numbers come from, shown in the table ("calibrated",
  /// "extrapolated from ...", "given").
  std::string source = "none";

  /// The full SDXL UNet (2,567,463,684 parameters), bf16, 128x128 latents,
  /// calibrated on one H200 (docs/planner.md).
  static ActivationModel sdxl_unet();
  /// sdxl_unet() scaled by parameter count, for other models of the UNet
  /// family: a rough extrapolation, marked as such.
  static ActivationModel scaled_from_sdxl(std::size_t param_count);
  /// Bytes for one micro-step of `batch` samples in a precision of dtype_bytes.
  std::size_t bytes(int batch, bool checkpointing, std::size_t dtype_bytes) const;
};

/// CUDA context + cuBLAS/cuDNN workspaces + NCCL + allocator slack of one
/// trainer process on one GPU, calibrated on the H200 runs.
std::size_t calibrated_runtime_overhead();

/// One engine bucket (a stage-3 unit), by its parameter tensors' sizes in
/// elements (one entry is fine when only the total is known; tensors matter
/// for the alignment padding between parameters).
struct PlanUnit {
  std::string name;
  std::vector<std::size_t> tensors;
  /// Recomputed in backward when activation checkpointing is on (the SDXL
  /// UNet's embed and head units are not).
  bool checkpointed = true;
  std::size_t numel() const;
};

/// The speed model's constants (relative time per sample; see docs/planner.md).
struct SpeedModel {
  double checkpointing_factor = 1.33;   // recompute: unet_bench 1.32x at batch 8, 1.43x at batch 1
  double stage3_gather_cost = 0.4;      // stage 3: x (1 + this / batch); measured +41% at b1, +2.5% at b8
  /// Stages 1 and 2 per stage over stage 0: 0, their measured differences
  /// are within 3% (N = 1) and their traffic equals stage 0's; equal times
  /// go to the configuration with less memory.
  double stage_step_cost = 0.0;
  /// GPU time of one micro-step at stage 0 without checkpointing: fixed +
  /// per sample, for the full SDXL UNet at 1024 px on an H200 (unet_bench:
  /// 174 ms at batch 1, 449 ms at batch 8), scaled by parameters (both) and
  /// latent area (per sample) for other models.
  double gpu_seconds_per_step = 0.135;
  double gpu_seconds_per_sample = 0.0392;
  double cpu_elements_per_second = 3e9;   // CPU AdamW per host (16 cores, vectorized), offload
  double pcie_bytes_per_second = 25e9;    // per GPU, offload transfers
};

struct PlanInput {
  /// The model: units (preferred: exact padding, stage-3 unit sizes), or a
  /// parameter count grouped into buckets of bucket_bytes.
  std::vector<PlanUnit> units;
  std::size_t param_count = 0;
  std::string model_name;  // for the table ("sdxl-base", "2.6e9 params")

  int world_size = 1;
  int gpus_per_host = 8;  // ranks sharing one host's memory: min(world_size, this)
  int stage = 2;
  DType param_dtype = DType::bf16;
  std::optional<DType> grad_dtype;  // defaults to param_dtype
  OptimizerOptions optimizer{};
  bool ema = false;
  bool offload_optimizer = false;
  bool offload_params = false;  // stage 3 with offload_optimizer: parameter shard in host memory
  /// EngineOptions::offload_delayed_update: the CPU update overlaps the next
  /// step's device work (parameters one step stale); never proposed by fit().
  bool offload_delayed_update = false;
  GradAccumulation accumulation = GradAccumulation::reduce_each_micro_step;
  int accumulation_steps = 1;
  /// Bucket target when grouping a bare parameter count (ignored with units).
  std::size_t bucket_bytes = std::size_t{32} << 20;
  std::size_t alignment_elements = 128;
  int max_reductions_in_flight = 2;
  /// EngineOptions::buffer_cache_bytes (default: two of the largest bucket).
  std::optional<std::size_t> buffer_cache_bytes;
  /// NcclCommunicator with HalfReduction::fp32_accumulate: fp32 scratch for
  /// the largest bucket.
  bool fp32_accumulate_reductions = false;

  int batch = 1;  // per GPU and micro-step
  bool activation_checkpointing = false;
  ActivationModel activations{};
  std::size_t runtime_overhead_bytes = calibrated_runtime_overhead();
  SpeedModel speed{};

  DType effective_grad_dtype() const { return grad_dtype.value_or(param_dtype); }
  /// Throws zero::InvalidArgument naming the field.
  void validate() const;
};

/// Engine buffers beyond the persistent model state, from a replay of the
/// engine's allocation rules over two steps (steady state).
struct EngineBuffers {
  std::size_t gathered_units = 0;    // stage 3: live unit buffers at the peak
  std::size_t bucket_buffers = 0;    // gradient buckets and accumulation scratch live at the peak
  std::size_t cached_blocks = 0;     // free blocks kept for reuse at the peak (<= 2 x largest bucket)
  std::size_t comm_scratch = 0;      // communicator workspace
  std::size_t peak() const { return gathered_units + bucket_buffers + cached_blocks + comm_scratch; }
  /// Held after step() returns (the cache plus scratch): what a
  /// cudaMemGetInfo sample between steps sees.
  std::size_t at_step_end = 0;
};

struct Plan {
  PlanInput input;
  std::size_t padded_numel = 0;
  std::size_t unit_count = 0;
  std::size_t largest_unit_elements = 0;  // padded
  int ranks_per_host = 1;

  // ---- per GPU
  MemoryByCategory model_state;  // model_state_bytes (buffers = 0)
  EngineBuffers engine;
  std::size_t activations = 0;
  std::size_t runtime_overhead = 0;
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
  /// A one-line name: "stage 2, offload, checkpointing, batch 1".
  std::string label() const;

  std::string to_json(int indent = 2) const;
  /// Readable table, one category per line, per GPU then per host.
  std::string table() const;
};

/// A PlanInput with the engine's settings (stage, dtypes, optimizer, EMA,
/// offload, accumulation, bucket size, alignment, reductions in flight) and
/// world size; the caller adds the model (units or param_count), batch,
/// activation checkpointing and the activation model.
PlanInput input_from_engine_options(const EngineOptions& options, int world_size);

/// Predicts the bytes of one configuration. Throws zero::InvalidArgument for
/// invalid inputs (the field named).
Plan make_plan(const PlanInput& input);

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

/// Searches stage (0-3) x offload_optimizer x activation checkpointing (plus
/// offload_params at stage 3) at the base input's world size and batch;
/// everything else is kept.
FitResult fit(const PlanInput& base, std::size_t gpu_bytes, const FitOptions& options = {});

/// For a trainer, before it allocates anything: nullopt when the plan's peak
/// (options.estimate) fits cap_bytes with the safety margin, else a message
/// with the prediction, the budget and fit()'s proposal (or suggestions).
/// To fail fast only on what surely cannot fit, pass
/// {.safety_margin = 0, .estimate = PeakEstimate::lower}.
std::optional<std::string> check_fits(const Plan& plan, std::size_t cap_bytes, const FitOptions& options = {});

}  // namespace zero::plan
