// The trainer's checkpoints: save every rank's shard with a manifest, and
// resume from one (at the same or another number of ranks).
//
// output_dir/checkpoints/step-00000100/{rank-00000.safetensors ..., manifest.json}
// (zero/checkpoint/checkpoint.hpp, docs/checkpoints.md). The manifest is written
// last, atomically, by rank 0 after every rank has finished its file: a
// folder without it is an interrupted save and ignored.
#pragma once

#include <cstdint>
#include <optional>

#include "data/sampler.hpp"
#include "train_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/torch/sharded_model.hpp"

namespace sdxl {

/// Every rank writes its engine state; rank 0 then writes the manifest (with
/// each file's checksum) and drops checkpoints beyond keep_checkpoints.
void save_checkpoint(const TrainConfig& c, std::int64_t step, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm, const data::SamplerState& sampler, zero::MpiCommunicator& host);

/// Where a resumed run picks up: the step done and the data position.
struct Resumed {
  std::int64_t step = 0;
  std::optional<data::SamplerState> sampler;
};

/// resume = "" starts fresh; "latest" takes the newest complete checkpoint
/// under output_dir (fresh when there is none); anything else is a
/// checkpoint folder. Checksums are verified before the engine loads.
Resumed maybe_resume(const TrainConfig& c, zero::adapter::ShardedModel& model, zero::Communicator& comm);

}  // namespace sdxl
