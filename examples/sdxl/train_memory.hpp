// The trainer's GPU memory budget: the memory planner's view of the run,
// printed before anything is allocated, and --max_gpu_memory, which makes a
// big GPU behave like a smaller card. The run fails before training when the
// model state alone cannot fit, and LibTorch's caching allocator gets what
// is left of the cap once the CUDA context, NCCL and the engine's persistent
// buffers (cudaMalloc, outside the allocator) are in place, minus the
// engine's transient buffers to come.
#pragma once

#include <cstddef>
#include <optional>

#include "device_runtime.hpp"
#include "train_config.hpp"
#include "unet_config.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/planner.hpp"

namespace sdxl {

/// device = "cuda" only (the planner's constants are calibrated for the
/// GPU): the plan of the run, printed by rank 0. With a cap (bytes, 0 for
/// none) it may switch the engine's block cache off in `options` where that
/// is what fits, and throws zero::OutOfMemory when the plan's upper bound
/// is over the cap (zero::plan::check_cap: the range, the cap, a proposal). frozen_sizes_by_unit: the element counts of each
/// unit's frozen tensors ([model] freeze), in the model's unit order; empty: none.
std::optional<zero::plan::Plan> plan_gpu_memory(const TrainConfig& c, const UNetConfig& ucfg,
                                                zero::EngineOptions& options, std::size_t cap, int world,
                                                int ranks_per_host, bool leader,
                                                const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit = {});

/// Once the engine holds its buffers: measures what is in use and gives
/// LibTorch's caching allocator the rest of the cap, less the engine's
/// transient peak. Throws zero::OutOfMemory when nothing is left.
void apply_gpu_memory_cap(const TrainConfig& c, std::size_t cap, const zero::Engine& engine,
                          const zero::plan::Plan& plan, DeviceRuntime& runtime, int world, bool leader);

}  // namespace sdxl
