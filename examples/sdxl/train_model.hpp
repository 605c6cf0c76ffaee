// The UNet bound to the sharding engine: built (or loaded) with the same
// initial weights on every rank, its parameters handed to the engine unit by
// unit (frozen parameters, LoRA adapters, parameter groups, the memory plan
// and [device] fit applied first), and every unit's forward routed through
// the engine (stage-3 gathers, recomputation with checkpointing).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "device_runtime.hpp"
#include "train_config.hpp"
#include "unet.hpp"
#include "unet_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/torch/sharded_model.hpp"

namespace sdxl {

struct ModelOnEngine {
  UNetConfig config;
  UNet2DConditionModel unet{nullptr};
  std::vector<std::string> parameter_names;  // in the engine's order: the export writes them back by name
  torch::ScalarType compute_type = torch::kFloat32;
  std::unique_ptr<zero::adapter::ShardedModel> sharded;
  std::string memory_plan_note;  // " (memory plan: ...)" on the GPU, for out-of-memory messages
};

/// Builds the model on the engine for this run. [device] fit may change
/// `cfg` (batch, accumulation, stage, offload, checkpointing) before the
/// engine is built from it.
ModelOnEngine build_model_on_engine(TrainConfig& cfg, zero::MpiCommunicator& host_comm, DeviceRuntime& runtime);

/// Rank 0's summary: parameters trained and frozen, units, stage, model
/// state per rank (and the pinned host memory when offloaded).
void describe_model(const TrainConfig& cfg, const ModelOnEngine& m);

}  // namespace sdxl
