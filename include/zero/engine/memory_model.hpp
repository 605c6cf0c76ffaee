// The memory model: bytes of model state per rank by category, as the ZeRO
// paper counts them, for a given stage, world size and precision. The engine
// reports what it actually allocated; tests hold the two equal, and the
// planner (zero-plan) builds on these functions.
#pragma once

#include <cstddef>
#include <string>

#include "zero/core/dtype.hpp"
#include "zero/engine/stage_plan.hpp"

namespace zero {

struct MemoryByCategory {
  std::size_t params = 0;           // model-dtype parameters (full, shard, and live gathered units)
  std::size_t grads = 0;            // gradient buffers and accumulators
  std::size_t master = 0;           // fp32 master weights (0 when the model itself is fp32)
  std::size_t optimizer_state = 0;  // fp32 moments
  std::size_t ema = 0;              // fp32 exponential moving average of the weights (if enabled)
  std::size_t buffers = 0;          // bucket buffers, scratch, communicator workspace
  std::size_t model_state() const { return params + grads + master + optimizer_state + ema; }
  std::size_t total() const { return model_state() + buffers; }
};

/// Persistent model-state bytes per rank (no transient buffers) of an engine
/// with this plan over padded_numel elements (a multiple of the world size):
///   params: Ψ·p, or Ψ·p/N at stage 3
///   grads:  Ψ·g where backward writes a full buffer, plus Ψ·g/N for a
///           sharded accumulator (see GradAccumulation)
///   master: Ψ·4 at stage 0, Ψ·4/N at stages 1-3 (0 when params are fp32)
///   state:  K·Ψ·4 at stage 0, K·Ψ·4/N at stages 1-3 (K = state slots)
///   ema:    Ψ·4 at stage 0, Ψ·4/N at stages 1-3, when enabled
/// With offload these are the device bytes: master, state and ema are 0
/// (they live in host memory, see host_model_state_bytes); with one
/// micro-step per step the gradients stream to the host as they are reduced,
/// so stages 2-3 hold no gradient shard; offloaded parameters leave only the
/// gathered units (transient) on the device.
/// Frozen parameters (frozen_padded_numel, Φ, their own padded layout) count
/// as parameters only: Φ·p, or Φ·p/N at stage 3 (0 on the device when
/// parameters are offloaded) — no gradient, master, state or EMA.
MemoryByCategory model_state_bytes(const StagePlan& plan, std::size_t padded_numel,
                                   std::size_t frozen_padded_numel = 0);
MemoryByCategory model_state_bytes(const EngineOptions& options, std::size_t padded_numel, int world_size);

/// Host (pinned) bytes per rank; all zero without offload. With it:
///   master: Ψ·4/N (kept even for fp32 parameters), state: K·Ψ·4/N,
///   ema: Ψ·4/N when enabled, buffers: Ψ·(g + p)/N (the gradient shard
///   copied down and the updated model-dtype shard copied back up);
///   with offloaded parameters: params (Ψ + Φ)·p/N and buffers Ψ·g/N (the CPU
///   writes the updated shard in place); the delayed update doubles the buffers.
MemoryByCategory host_model_state_bytes(const StagePlan& plan, std::size_t padded_numel,
                                        std::size_t frozen_padded_numel = 0);
MemoryByCategory host_model_state_bytes(const EngineOptions& options, std::size_t padded_numel, int world_size);

/// "params 1.00 GiB, grads ..." for logs.
std::string format_memory(const MemoryByCategory& memory);
std::string format_bytes(std::size_t bytes);
/// "24GiB", "12 GiB", "500MiB", "1.5G", "4096" (bytes) -> bytes; binary
/// units (K/M/G/T with or without "iB", or "B"). Throws InvalidArgument
/// naming `what` (e.g. "--max_gpu_memory") and the expected form.
std::size_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace zero
