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
#include <map>
#include <optional>
#include <string>

#include "data/epoch_schedule.hpp"
#include "data/sampler.hpp"
#include "train_config.hpp"
#include "zero/comm/mpi_communicator.hpp"
#include "zero/torch/sharded_model.hpp"

namespace sdxl {

/// Every rank writes its engine state into the staging folder; rank 0 then
/// writes the manifest (with each file's checksum), moves the folder into
/// place (replacing an older save of the same step only then) and drops
/// checkpoints beyond keep_checkpoints.
/// `schedule` (train_epochs.hpp schedule_metadata) goes into the manifest's
/// data_position and every shard's metadata next to the sampler's state.
void save_checkpoint(const TrainConfig& c, std::int64_t step, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm, const data::SamplerState& sampler,
                     const std::map<std::string, std::string>& schedule, zero::MpiCommunicator& host);

/// Where a resumed run picks up: the step done and the data position.
struct Resumed {
  std::int64_t step = 0;
  std::optional<data::SamplerState> sampler;
  std::map<std::string, std::string> data_position;  // the manifest's: sampler and schedule records
  std::filesystem::path folder;  // empty when starting fresh
};

/// resume = "" starts fresh; "latest" takes the newest complete checkpoint
/// under output_dir (fresh when there is none); anything else is a
/// checkpoint folder. Before the engine loads: the manifest lists checksums
/// (or accept_unchecksummed_checkpoint), sizes and CRCs match, the manifest
/// agrees with the shards' own metadata (its step above all), and the step
/// counts the run's length as this one and its epochs end on the same steps
/// (check_resumed_schedule), and the step is not beyond the run's length
/// (run_length: steps, or what epochs come to with `schedule`). A damaged
/// newest checkpoint names the older complete one to resume from. Prints
/// nothing on success: the caller says "resumed" once the data position is
/// restored too.
Resumed maybe_resume(const TrainConfig& c, const data::EpochSchedule& schedule, zero::adapter::ShardedModel& model,
                     zero::Communicator& comm);

/// The saved configuration (TrainConfig::to_toml() in the manifest) of the
/// checkpoint that `resume` names ("latest": the newest complete one), for
/// [device] fit to keep the settings it trained with. nullopt when the run
/// starts fresh, or when the manifest cannot be read (maybe_resume then says
/// what is wrong with it). Throws when the manifest records no configuration.
std::optional<std::string> saved_config_to_resume(const TrainConfig& c);

}  // namespace sdxl
