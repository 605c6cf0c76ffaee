// The trainer's checkpoints: save every rank's shard with a manifest, and
// resume from one (at the same or another number of ranks).
//
// output_dir/checkpoints/step-00000100/{rank-00000.safetensors ..., manifest.json}
// (zero/checkpoint/checkpoint.hpp, docs/checkpoints.md). Every rank writes its
// file into a hidden staging folder beside the checkpoints; rank 0 writes the
// manifest there last, after every rank has finished, then moves the folder
// into place in one rename: a step folder is always a complete checkpoint.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>

#include "data/sampler.hpp"
#include "train_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/torch/sharded_model.hpp"

namespace sdxl {

/// Every rank writes its engine state into the staging folder; rank 0 then
/// writes the manifest (with each file's checksum), moves the folder into
/// place (replacing an older save of the same step only then) and drops
/// checkpoints beyond keep_checkpoints.
void save_checkpoint(const TrainConfig& c, std::int64_t step, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm, const data::SamplerState& sampler, zero::MpiCommunicator& host);

/// Where a resumed run picks up: the step done and the data position.
struct Resumed {
  std::int64_t step = 0;
  std::optional<data::SamplerState> sampler;
  std::filesystem::path folder;  // empty when starting fresh
};

/// resume = "" starts fresh; "latest" takes the newest complete checkpoint
/// under output_dir (fresh when there is none); anything else is a
/// checkpoint folder. Before the engine loads: the manifest lists checksums
/// (or accept_unchecksummed_checkpoint), sizes and CRCs match, the manifest
/// agrees with the shards' own metadata (its step above all), and the step
/// is not beyond `steps`. A damaged newest checkpoint names the older
/// complete one to resume from. Prints nothing on success: the caller says
/// "resumed" once the data position is restored too.
Resumed maybe_resume(const TrainConfig& c, zero::adapter::ShardedModel& model, zero::Communicator& comm);

}  // namespace sdxl
