// The memory model: bytes of model state per rank by category, as the ZeRO
// paper counts them, for a given stage, world size and precision. The engine
// reports what it actually allocated; tests hold the two equal, and the
// planner (zero-plan) builds on these functions.
#pragma once

#include <cstddef>
#include <string>

#include "zero/core/dtype.hpp"
#include "zero/optim/optimizer.hpp"

namespace zero {

enum class GradAccumulation {
  /// Reduce-scatter every micro-step's gradients into the (sharded)
  /// accumulator: least memory at stages 2-3, N x the communication.
  reduce_each_micro_step,
  /// Accumulate a full local gradient and reduce once at the boundary: one
  /// reduction per step, but every rank holds a full gradient buffer.
  reduce_at_boundary,
};

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

struct ModelStateConfig {
  std::size_t numel = 0;  // parameters Ψ (use the padded length for exact engine bytes)
  int world_size = 1;
  int stage = 0;
  DType param_dtype = DType::bf16;
  DType grad_dtype = DType::bf16;
  OptimizerOptions optimizer{};
  GradAccumulation accumulation = GradAccumulation::reduce_each_micro_step;
  int accumulation_steps = 1;
  bool ema = false;  // an fp32 EMA of the weights, sharded like the master weights
  /// ZeRO-Offload: master weights, optimizer state and EMA (this rank's
  /// shard) in pinned host memory, updated by the CPU optimizer; stages 1-3.
  bool offload_optimizer = false;
  /// Parameter offload (stage 3 with offload_optimizer): the model-dtype
  /// parameter shard in pinned host memory as well.
  bool offload_params = false;
  /// EngineOptions::offload_delayed_update: a second gradient and parameter
  /// staging shard in host memory.
  bool offload_delayed_update = false;
};

/// Persistent model-state bytes per rank (no transient buffers):
///   params: Ψ·p, or Ψ·p/N at stage 3
///   grads:  Ψ·g at stages 0-1, Ψ·g/N at stages 2-3; plus the other form
///           where the accumulation mode needs both (see GradAccumulation)
///   master: Ψ·4 at stage 0, Ψ·4/N at stages 1-3 (0 when params are fp32)
///   state:  K·Ψ·4 at stage 0, K·Ψ·4/N at stages 1-3 (K = state slots)
///   ema:    Ψ·4 at stage 0, Ψ·4/N at stages 1-3, when enabled
/// numel must be a multiple of world_size (padded).
/// With offload_optimizer these are the device bytes: master, state and ema
/// are 0 (they live in host memory, see host_model_state_bytes); with one
/// micro-step per step the gradients stream to the host as they are reduced,
/// so stages 2-3 hold no gradient shard; offload_params moves the stage-3
/// parameter shard to the host (only gathered units, transient, remain).
MemoryByCategory model_state_bytes(const ModelStateConfig& config);

/// Host (pinned) bytes per rank; all zero without offload_optimizer. With it:
///   master: Ψ·4/N (kept even for fp32 parameters), state: K·Ψ·4/N,
///   ema: Ψ·4/N when enabled, buffers: Ψ·(g + p)/N (the gradient shard
///   copied down and the updated model-dtype shard copied back up);
///   with offload_params: params Ψ·p/N and buffers Ψ·g/N (the CPU writes the
///   updated shard in place); offload_delayed_update doubles the buffers.
MemoryByCategory host_model_state_bytes(const ModelStateConfig& config);

/// "params 1.00 GiB, grads ..." for logs.
std::string format_memory(const MemoryByCategory& memory);
std::string format_bytes(std::size_t bytes);
/// "24GiB", "12 GiB", "500MiB", "1.5G", "4096" (bytes) -> bytes; binary
/// units (K/M/G/T with or without "iB", or "B"). Throws InvalidArgument
/// naming `what` (e.g. "--max_gpu_memory") and the expected form.
std::size_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace zero
