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
#include <string>
#include <vector>

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

/// The GPU memory cap of the run in bytes: max_gpu_memory, else fit; 0 for
/// none. Applies on device = "cuda" only.
std::size_t gpu_memory_cap(const TrainConfig& c);

/// Without a cap the GPU's own memory is the limit (gpu_total_bytes: the
/// smallest GPU among the ranks, so that every rank decides alike). A plan
/// whose lower bound is over it by more than kUncappedRefusalSlack could
/// not run: throws zero::OutOfMemory naming the GPU, the prediction and a
/// configuration that fits at the same global batch, before anything is
/// allocated (such a run used to load the model and die in its first step).
/// A plan whose upper bound is over the GPU but not that far: a warning
/// (returned, empty when the plan fits), since the run may still fit.
std::string check_plan_against_gpu(const zero::plan::Plan& plan, std::size_t gpu_total_bytes);

/// The slack over the GPU's memory before an uncapped run is refused: the
/// SDXL calibration predicts its 13 recorded runs within 0.2%
/// (docs/planner.md); other models are extrapolated and less sure.
inline constexpr double kUncappedRefusalSlack = 0.05;

/// What [device] fit (--fit SIZE) decided, and the block rank 0 prints.
struct FitDecision {
  zero::plan::Plan plan;  // of the configuration the run now has
  std::string report;     // what was chosen (or kept), why, and what changed
};

/// [device] fit: the memory planner's search (zero::plan::fit with the
/// run's global batch, world x batch_size x accumulation, the default 5%
/// margin and the upper bound of the peak: `zero-plan --fit SIZE
/// --global-batch G`) over micro-batch, accumulation, stage, offload,
/// activation checkpointing and the delayed update, for the model, optimizer,
/// EMA, precision and frozen tensors of this run (`options`: the engine
/// options of `c`). The fastest candidate that fits is applied to `c`,
/// except that options given on the command line (c.command_line_keys) are
/// kept: candidates that change them, or that c.validate() refuses (e.g.
/// cuda_graph's needs), are passed over, and the report says so.
/// `resumed_config`: the saved configuration (TrainConfig::to_toml()) of the
/// checkpoint this run resumes from; then nothing is searched: the run keeps
/// the checkpoint's settings (same global batch, same data order) and they
/// must fit the cap by zero::plan::check_cap. Throws zero::OutOfMemory
/// naming the size and the smallest predicted peak when nothing fits.
FitDecision fit_gpu_memory(TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options, int world,
                           int ranks_per_host, const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit = {},
                           const std::optional<std::string>& resumed_config = std::nullopt);

/// checkpoint_units = "fit": the fewest units (zero::plan::recompute_order)
/// whose predicted peak (upper bound, the default 5% margin) fits gpu_bytes,
/// applied to `c` as a count; "all" when only every unit fits, or when not
/// even that does (a cap then refuses the run); activation_checkpointing
/// off when nothing needs recomputing. gpu_bytes 0 (the CPU): "all".
/// Without activation_checkpointing: "all", nothing printed.
/// Returns the line rank 0 prints (empty unless checkpoint_units was "fit").
std::string resolve_checkpoint_fit(TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options,
                                   int world, int ranks_per_host, std::size_t gpu_bytes,
                                   const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit = {});

/// What to change when a micro-step's forward and backward run out of GPU
/// memory, from the run's settings (after checkpoint_units = "fit" was
/// resolved): recompute more units where only some are, turn checkpointing
/// on where it is off, else a smaller batch or latent size, or offload.
std::string out_of_memory_advice(const TrainConfig& c);

/// Once the engine holds its buffers: measures what is in use and gives
/// LibTorch's caching allocator the rest of the cap, less the engine's
/// transient peak. Throws zero::OutOfMemory when nothing is left.
void apply_gpu_memory_cap(const TrainConfig& c, std::size_t cap, const zero::Engine& engine,
                          const zero::plan::Plan& plan, DeviceRuntime& runtime, int world, bool leader);

}  // namespace sdxl
