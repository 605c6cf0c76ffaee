#include "train_memory.hpp"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "sdxl_calibration.hpp"
#include "unet_param_count.hpp"
#include "zero/engine/memory_model.hpp"

namespace sdxl {

namespace {

std::string memory_suggestion(const TrainConfig& c, int world) {
  std::string s;
  if (c.stage < 3 && world > 1) s += " a higher ZeRO stage (stage = 3 shards everything),";
  if (!c.offload_optimizer) s += " offload_optimizer = true (master, optimizer state and EMA to host memory; stages 1-3),";
  if (!c.offload_params) s += " stage = 3 with offload_params = true (parameter shards to host memory too),";
  if (!c.activation_checkpointing) s += " activation_checkpointing = true,";
  if (c.batch_size > 1) s += " a smaller batch_size with accumulation,";
  s += s.empty() ? " more GPUs" : " or more GPUs";
  return s;
}

/// The memory planner's view of this run (model, engine options, batch,
/// checkpointing, latent size), before anything is allocated.
zero::plan::Plan plan_run(const TrainConfig& c, const UNetConfig& ucfg, const zero::EngineOptions& options, int world,
                          int ranks_per_host, const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  zero::plan::PlanInput in;
  in.engine = options;
  in.world_size = world;
  sdxl::calibration::apply(in, static_cast<std::size_t>(count_parameters(ucfg)));
  in.units = sdxl::plan_units(ucfg);
  // Frozen tensors count as parameters only: each unit's frozen sizes (from
  // the model) are moved out of the planner's list of the unit's tensors.
  ZERO_CHECK(frozen_sizes_by_unit.empty() || frozen_sizes_by_unit.size() == in.units.size(),
             "memory plan: the model has ", frozen_sizes_by_unit.size(), " units, the planner's count of the UNet "
             "config ", in.units.size());
  for (std::size_t u = 0; u < frozen_sizes_by_unit.size(); ++u) {
    zero::plan::PlanUnit& unit = in.units[u];
    for (std::size_t size : frozen_sizes_by_unit[u]) {
      auto it = std::find(unit.tensors.begin(), unit.tensors.end(), size);
      ZERO_CHECK(it != unit.tensors.end(), "memory plan: unit '", unit.name, "' has a frozen tensor of ", size,
                 " elements that the planner's count of the UNet config does not list");
      unit.tensors.erase(it);
      unit.frozen_tensors.push_back(size);
    }
  }
  in.model_name = c.model_config;
  in.activations = sdxl::plan_activations(ucfg, c.latent_size);
  in.gpus_per_host = ranks_per_host;
  in.batch = static_cast<int>(c.batch_size);
  in.activation_checkpointing = c.activation_checkpointing;
  return zero::plan::make_plan(in);
}

/// Before the engine exists: fail when the planner's UPPER bound of the
/// peak is over the cap. A run refused only on the lower bound was accepted
/// with a range reaching past the cap and then died mid-step in a raw CUDA
/// out-of-memory; the refusal names the range, the cap and a configuration
/// that fits at the same global batch.
void check_plan_fits(const TrainConfig& c, std::size_t cap, const zero::plan::Plan& plan) {
  const auto why = zero::plan::check_cap(plan, cap);
  if (why) ZERO_THROW(zero::OutOfMemory, "max_gpu_memory = ", c.max_gpu_memory, ": ", *why);
}

}  // namespace

std::optional<zero::plan::Plan> plan_gpu_memory(const TrainConfig& c, const UNetConfig& ucfg,
                                                zero::EngineOptions& options, std::size_t cap, int world,
                                                int ranks_per_host, bool leader,
                                                const std::vector<std::vector<std::size_t>>& frozen_sizes_by_unit) {
  if (c.device != "cuda") return std::nullopt;
  zero::plan::Plan run_plan = plan_run(c, ucfg, options, world, ranks_per_host, frozen_sizes_by_unit);
  if (cap > 0 && run_plan.gpu_peak() > cap) {
    // Tight cap: the engine frees its transient blocks instead of caching
    // them (each free then waits for the device; that is what the cap
    // costs), where that is what lets the run fit.
    zero::EngineOptions uncached = options;
    uncached.buckets.cache_bytes = 0;
    zero::plan::Plan uncached_plan = plan_run(c, ucfg, uncached, world, ranks_per_host, frozen_sizes_by_unit);
    if (uncached_plan.gpu_peak() <= cap) {
      options = uncached;
      run_plan = std::move(uncached_plan);
      if (leader) std::printf("max_gpu_memory: the engine's block cache is off to fit the cap\n");
    }
  }
  if (leader)
    std::printf("memory plan (zero-plan): GPU peak %s .. %s per rank, pinned host %s per rank\n",
                zero::format_bytes(run_plan.gpu_peak_lower()).c_str(), zero::format_bytes(run_plan.gpu_peak()).c_str(),
                zero::format_bytes(run_plan.host_per_rank()).c_str());
  if (cap > 0) check_plan_fits(c, cap, run_plan);
  return run_plan;
}

void apply_gpu_memory_cap(const TrainConfig& c, std::size_t cap, const zero::Engine& engine,
                          const zero::plan::Plan& plan, DeviceRuntime& runtime, int world, bool leader) {
  const DeviceMemory settled = runtime.settled_memory();
  const std::size_t outside = settled.in_use;  // context, NCCL, the engine's buffers
  // The engine's transient buffers at their peak (gradient buckets and
  // scratch in flight, gathered units, cached blocks), as the planner ran them.
  const std::size_t transient = plan.engine.peak();
  if (outside + transient >= cap)
    ZERO_THROW(zero::OutOfMemory, "max_gpu_memory = ", c.max_gpu_memory, ": ", zero::format_bytes(outside),
               " are in use before training (CUDA context, NCCL, the engine's model state: ",
               zero::format_memory(engine.memory()), ") and the engine's transient buffers need up to ",
               zero::format_bytes(transient), "; nothing is left for activations. Try",
               memory_suggestion(c, world), ".");
  const std::size_t for_torch = cap - outside - transient;
  runtime.limit_torch_memory(static_cast<double>(for_torch) / static_cast<double>(settled.total));
  if (leader)
    std::printf("GPU memory cap %s: %s in use before training, up to %s for the engine's transient buffers, %s for "
                "LibTorch (activations)\n",
                zero::format_bytes(cap).c_str(), zero::format_bytes(outside).c_str(),
                zero::format_bytes(transient).c_str(), zero::format_bytes(for_torch).c_str());
}

}  // namespace sdxl
