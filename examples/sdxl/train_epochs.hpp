// The trainer's epochs: the run's length in steps when [train] epochs sets
// it, what a checkpoint records so that a resumed run ends its epochs on the
// same steps, and the check of that record on resume.
//
// The epoch ends themselves are data::EpochSchedule's: a function of the
// sampler's global batches per epoch (dataset and batch_size x ranks) and
// accumulation only, so they do not move with the world size (same global
// batch) or a resume.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "data/epoch_schedule.hpp"
#include "train_config.hpp"

namespace sdxl {

/// Optimizer steps the run trains for: [train] steps, or the step that
/// completes epoch [train] epochs. Checks the options bounded by it
/// (TrainConfig::validate_length).
std::int64_t run_length(const TrainConfig& c, const data::EpochSchedule& schedule);

/// What a checkpoint records about the run's length and epochs, as key/values
/// for the manifest's data_position (prefix "schedule."): whether the length
/// counts steps or epochs, the sampler's global batches per epoch, the
/// accumulation and the steps per epoch they make.
std::map<std::string, std::string> schedule_metadata(const TrainConfig& c, const data::EpochSchedule& schedule);

/// On resume from `folder`, whose manifest's data_position is `saved`:
/// refuses (zero::InvalidArgument naming the options) a run that counts its
/// length in the other unit than the one that saved (steps vs epochs), and,
/// when any option counts epochs, one whose epochs end on other steps
/// (another dataset, global batch or accumulation). A checkpoint written
/// before epochs existed counted steps and recorded no schedule: only the
/// unit is checked then (the sampler itself refuses another dataset or
/// global batch).
void check_resumed_schedule(const TrainConfig& c, const data::EpochSchedule& schedule,
                            const std::map<std::string, std::string>& saved, const std::string& folder);

/// "epoch-000003": the folder of the export at the end of epoch 3.
std::string epoch_folder_name(std::int64_t epoch);

}  // namespace sdxl
