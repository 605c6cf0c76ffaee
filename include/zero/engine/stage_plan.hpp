// StagePlan: what a stage and its options mean for the buffers, derived once
// from EngineOptions and the world size. The engine allocates and schedules
// by it, the memory model counts by it, the planner runs the engine that
// reads it: a new stage behaviour is one more field here, not a new branch
// in three files.
//
// [Note: where things live]
//   buffer                  stage 0   stage 1   stage 2      stage 3
//   parameters              full      full      full         shard (+ gathered units)
//   backward writes into    full      full      buckets(*)   buckets(*)
//   reduced gradients       in place  in place  shard        shard
//   master, state, EMA      full      shard     shard        shard
// (*) a full buffer too when accumulating locally to the boundary.
// Offload moves master, state and EMA (and at stage 3 optionally the
// parameter shard) to pinned host memory; with one micro-step the reduced
// gradients then stream to the host during backward and no device shard is kept.
#pragma once

#include <cstddef>

#include "zero/core/dtype.hpp"
#include "zero/engine/options.hpp"

namespace zero {

struct StagePlan {
  int stage = 0;
  int world_size = 1;
  DType param_dtype = DType::bf16;
  DType grad_dtype = DType::bf16;

  // ---- parameters
  /// Stages 0-2: every rank holds every parameter.
  bool params_full = true;
  /// Stage 3: units are gathered into transient buffers around their use.
  bool gathers_units = false;
  /// Stage 3 on one rank without offload: the shard is the whole model, so a
  /// "gathered" unit is used where it lies in the shard (no buffer, no copy).
  bool units_in_place = false;
  /// Stages 1-2: each rank updates its slices, then the slices are all-gathered.
  bool gathers_params_after_step = false;
  /// offload.params: the stage-3 parameter shard lives in pinned host memory.
  bool params_on_host = false;

  // ---- gradients
  /// Backward writes into one full gradient buffer (else transient bucket
  /// buffers): stages 0-1, and stages 2-3 on one rank with one micro-step
  /// and no offload (where the reduce-scatter is the identity).
  bool full_grads = true;
  /// Reduced gradients accumulate in a sharded buffer (else in place in the full one).
  bool shard_accumulator = false;
  /// Several micro-steps accumulated locally and reduced once, at the last.
  bool reduce_only_at_boundary = false;
  /// Offload with one micro-step (or offload.accumulate_on_host): each
  /// bucket's reduced slice is copied to host memory as its reduction
  /// completes; no gradient shard on the device.
  bool streams_grads_to_host = false;
  /// Streamed over several micro-steps: after the first, each slice lands in
  /// a host staging shard and the CPU adds it into the host gradient shard.
  bool accumulates_on_host = false;
  /// offload.gradient_stats_on_device with streamed gradients that the host
  /// does not accumulate: each bucket's statistics are summed on the device
  /// as its slice goes down, not by the host gradient worker after it lands.
  bool grad_stats_on_device_before_download = false;

  // ---- optimizer
  /// Stage 0: every rank updates every element, after gathering every reduced slice.
  bool optimizer_full = true;
  /// offload.optimizer: master, optimizer state and EMA in pinned host memory.
  bool optimizer_on_host = false;
  /// The EMA in pinned host memory: offload.optimizer without offload.ema_on_device.
  bool ema_on_host = false;
  /// offload.ema_on_device: the CPU update sends the fp32 master up; the
  /// device updates the EMA from it and rounds it into the parameters.
  bool uploads_master = false;
  /// An fp32 master copy exists (model dtype below fp32, or offloaded).
  bool has_master = false;
  int state_slots = 0;
  DType state_dtype = DType::fp32;  // OptimizerOptions::state_dtype
  bool ema = false;
  /// offload.delayed_update: the CPU update overlaps the next step's backward.
  bool delayed_update = false;

  /// The plan of these options on world_size ranks (options validated first).
  static StagePlan of(const EngineOptions& options, int world_size);

  bool reduces_in_place() const { return !shard_accumulator; }
  /// A device gradient shard accumulates the reductions.
  bool grad_shard_on_device() const { return shard_accumulator && !streams_grads_to_host; }
  std::size_t param_bytes() const { return size_of(param_dtype); }
  std::size_t grad_bytes() const { return size_of(grad_dtype); }
  std::size_t state_bytes() const { return size_of(state_dtype); }
  /// Elements of the master, state and EMA buffers: all at stage 0, a shard otherwise.
  std::size_t optimizer_elements(std::size_t padded_numel) const {
    return optimizer_full ? padded_numel : padded_numel / static_cast<std::size_t>(world_size);
  }
};

}  // namespace zero
