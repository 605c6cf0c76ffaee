// The SDXL UNet's constants for the planner (zero::plan), measured on one
// H200: activation bytes, the runtime's overhead and the speed model.
// libzero's planner is model-agnostic and takes these as inputs;
// docs/planner.md lists which recorded run sets which constant and the error
// on every run. Header-only: zero-plan, the trainer and the planner's tests
// use it.
//
// Activations and runtime overhead: the trainer (sdxl-1024.toml: bf16, AdamW +
// EMA, stage 2, N = 1, 91 layer units), 128x128 latents, measured 2026-12-06
// (bench/results/session23-recalibration.md; the peaks are the same on the
// H100 and the H200 to 0.01 GiB: 53.79 and 53.78 at batch 8, every unit):
//  - per sample with checkpointing every unit: the slope of the trainer's
//    peak, (53.79 - 49.86) GiB / 7 between batch 1 and batch 8, equal at
//    stages 0-3. No fixed part.
//  - runtime overhead: the batch-1 peak (49.86 GiB) minus the model state
//    (47.82 GiB) minus one sample of checkpointed activations.
//  - without checkpointing: the trainer's peaks at batch 1, 2, 4 and 8
//    (54.86, 60.56, 71.97, 94.70 GiB) less the model state and the overhead,
//    least squares: 5.691 GiB per sample, intercept -0.12 GiB (taken as 0).
//    5.69 - 0.56 GiB per sample freed is 2.76 G bf16 elements; the UNet's
//    count of what autograd keeps (unet_param_count.cpp) gives 2.72 G.
// The first calibration (2026-12-02: 2.267 GiB per sample checkpointed,
// 6.447 + 0.165 without, 1.453 overhead) predated the NHWC group norm, the
// GEGLU kernel and per-layer units, and predicted 6-14 GiB too much.
#pragma once

#include <cstddef>

#include "zero/engine/planner.hpp"

namespace sdxl::calibration {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline constexpr double kSdxlParams = 2567463684.0;

/// Activations of the full SDXL UNet, bf16, 128x128 latents.
inline zero::plan::ActivationModel activation_model() {
  zero::plan::ActivationModel m;
  m.fixed_bytes_checkpointed = 0;
  m.per_sample_bytes_checkpointed = (53.79 - 49.86) / 7.0 * kGiB;  // 0.561 GiB
  m.fixed_bytes_full = 0;
  m.per_sample_bytes_full = 5.691 * kGiB;
  m.source = "calibrated: SDXL UNet, H100/H200";
  return m;
}

/// activation_model() scaled by parameter count, for other models of the
/// UNet family: a rough extrapolation, marked as such.
inline zero::plan::ActivationModel scaled_activation_model(std::size_t param_count) {
  zero::plan::ActivationModel m = activation_model();
  const double ratio = static_cast<double>(param_count) / kSdxlParams;
  m.fixed_bytes_checkpointed *= ratio;
  m.per_sample_bytes_checkpointed *= ratio;
  m.fixed_bytes_full *= ratio;
  m.per_sample_bytes_full *= ratio;
  m.source = "extrapolated from SDXL by parameter count (rough)";
  return m;
}

/// CUDA context + cuBLAS/cuDNN workspaces + NCCL + allocator slack of one
/// trainer process (H200 and H100 alike): 49.86 - 47.82 - 0.561 GiB.
inline std::size_t runtime_overhead_bytes() { return static_cast<std::size_t>(1.478 * kGiB); }

/// The speed model of the SDXL UNet at 1024 px on an H200, from trainer runs
/// (sdxl-1024.toml, EMA, global batch 8; bench/results/speed-prediction.md):
/// a micro-step at stage 0 without checkpointing takes 0.2265 s at batch 1,
/// 0.1396 s at batch 2 (batch 1 is slower than 2: docs/perf-notes.md),
/// 0.2523 s at batch 4 and 0.4084 s at batch 8 (the checkpointed runs divided
/// by 1.33), unet_bench's 0.0392 s per sample beyond; x 1.33 with
/// checkpointing; 0.04 s per step for the device AdamW + EMA. Offload: the
/// host's AdamW + EMA (the EMA in the update's pass) at 3.4 G elements/s, the
/// EMA 0.125 of it, the update with the EMA on the GPU 0.765 of it, forward +
/// backward beside the delayed update x 1.21 (the hosts of H100 machines, not
/// yet the H200's: below); PCIe at 50 GB/s, stage 3's parameter uploads
/// (offload_params) at 24.3.
inline zero::plan::SpeedModel speed_model() {
  zero::plan::SpeedModel s;
  s.checkpointing_factor = 1.33;  // recompute: unet_bench 1.32x at batch 8; trainer 1.30x at batch 8
  s.stage3_gather_cost = 0.4;     // measured +41% at batch 1, +2.5% at batch 8
  // Stages 1 and 2: their measured differences to stage 0 are within 3%
  // (N = 1) and their traffic equals stage 0's; equal times go to the
  // configuration with less memory.
  s.stage_step_cost = 0.0;
  s.gpu_seconds_per_step = 0.096;
  s.gpu_seconds_per_sample = 0.0392;
  s.measured_micro_step_seconds = {{1, 0.2265}, {2, 0.1396}, {4, 0.2523}, {8, 0.4084}};
  s.optimizer_seconds_per_step = 0.04;
  // bench/results/session17-h200.md: stage 2, offload, delayed, 8 x 1, the
  // update beside backward: 0.97 s with the EMA every step; with ema_every 4
  // 0.85 s at the steps without it, so the EMA is 1 - 0.85 / 0.97 of the
  // update's time (less than its 8 of 34 bytes: it reads the master from cache).
  s.cpu_ema_share = 0.125;
  // The rate: 2.65e9 on the H200 host then (session 17's kernels). Since
  // session 27 the update's chunks are handed out dynamically (-12% on the
  // same machine); on the H100 machines' hosts (16 cores, the same Xeon model
  // name as the H200 machine's) the update with the EMA on the GPU took
  // 0.519-0.590 s (sessions 28 and 30: 2.57e9 x 0.765 / 0.55 = 3.6e9), and
  // with the host EMA 0.86-0.94 s before the change (session 26: ~0.78 after
  // -12%, 3.3e9). Between the two; the H200 host is to be remeasured.
  s.cpu_elements_per_second = 3.4e9;
  // bench/results/session26.md, the same build with and without
  // offload_ema_on_device, alternated in one call (H100 machine, 16 cores):
  // 0.676 / 0.865, 0.739 / 0.917 and 0.663 / 0.935 s of CPU update per step.
  s.cpu_update_share_ema_on_device = 0.765;
  // bf16 moments offloaded (bench/results/session35.md, the H100 machine's
  // 16-core host, EMA on the GPU): 0.623 -> 0.458 s of CPU update per step,
  // 0.735 where the bytes say 18 / 26 = 0.69 (the rounding's hash costs some).
  s.cpu_bf16_state_share = 0.735;
  // The delayed update's forward + backward against on-device at batch 8 (H100
  // machine, EMA on the GPU, parameters up during backward): 0.614 / 0.504
  // (session 28), 0.626 / 0.516 (session 30, before backward stopped waiting
  // for each bucket's download, which that trace found: predicted ~1.10 now).
  s.delayed_offload_fwd_bwd_factor = 1.21;
  // Not measured on the H200 host: the bf16 addition ran 4.6x the AdamW + EMA
  // rate on the 2-core CI machine (6.7 vs 1.45 G elements/s), applied to 2.25.
  s.cpu_add_elements_per_second = 10e9;
  s.pcie_bytes_per_second = 50e9;
  // Stage 3 with offload_params and checkpointing (bench/results/session15):
  // forward + backward took 0.379 s per micro-step more than the model's
  // compute at batch 8 and 0.466 s at batch 2 x 4, for 2 x 5.13 GB of bf16
  // parameters: 27 and 22 GB/s; the mean of the two exposed times.
  s.param_gather_bytes_per_second = 24.3e9;
  s.reference_param_count = kSdxlParams;
  return s;
}

/// A plan input's model-dependent constants set to the SDXL UNet's (scaled
/// by parameters when the model is another size).
inline void apply(zero::plan::PlanInput& in, std::size_t param_count) {
  in.activations = param_count == static_cast<std::size_t>(kSdxlParams) ? activation_model()
                                                                          : scaled_activation_model(param_count);
  in.runtime_overhead_bytes = runtime_overhead_bytes();
  in.speed = speed_model();
}

}  // namespace sdxl::calibration
