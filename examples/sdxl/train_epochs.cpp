#include "train_epochs.hpp"

#include <charconv>
#include <cstdio>
#include <sstream>
#include <utility>

#include "zero/core/error.hpp"

namespace sdxl {

namespace {

const char* length_unit(const TrainConfig& c) { return c.epochs > 0 ? "epochs" : "steps"; }

std::string length_option(const TrainConfig& c) {
  return c.epochs > 0 ? "[train] epochs = " + std::to_string(c.epochs) : "[train] steps = " + std::to_string(c.steps);
}

std::uint64_t saved_u64(const std::map<std::string, std::string>& saved, const std::string& key,
                        const std::string& folder) {
  const auto it = saved.find(key);
  ZERO_CHECK(it != saved.end(), "resume: ", folder, " records the run's length but not '", key,
             "' in its manifest's data_position: the manifest was edited or is damaged");
  std::uint64_t value = 0;
  const std::string& text = it->second;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  ZERO_CHECK(error == std::errc() && end == text.data() + text.size() && !text.empty(), "resume: ", folder,
             ": data_position '", key, "' is '", text, "', expected an unsigned integer");
  return value;
}

}  // namespace

std::int64_t run_length(const TrainConfig& c, const data::EpochSchedule& schedule) {
  const std::int64_t steps = c.epochs > 0 ? schedule.end_step(c.epochs) : c.steps;
  c.validate_length(steps);
  return steps;
}

std::map<std::string, std::string> schedule_metadata(const TrainConfig& c, const data::EpochSchedule& schedule) {
  std::ostringstream steps_per_epoch;
  steps_per_epoch << schedule.steps_per_epoch();
  return {{"schedule.length", length_unit(c)},
          {"schedule.batches_per_epoch", std::to_string(schedule.batches_per_epoch())},
          {"schedule.accumulation", std::to_string(schedule.accumulation())},
          {"schedule.steps_per_epoch", steps_per_epoch.str()}};
}

void check_resumed_schedule(const TrainConfig& c, const data::EpochSchedule& schedule,
                            const std::map<std::string, std::string>& saved, const std::string& folder) {
  const auto unit = saved.find("schedule.length");
  // Checkpoints from before epochs existed: their runs counted steps.
  const std::string saved_unit = unit == saved.end() ? "steps" : unit->second;
  ZERO_CHECK(saved_unit == "steps" || saved_unit == "epochs", "resume: ", folder, ": data_position 'schedule.length' is '",
             saved_unit, "', expected steps or epochs");
  ZERO_CHECK(saved_unit == length_unit(c), "resume: ", folder, " was saved by a run whose length is counted in [train] ",
             saved_unit, ", this run sets ", length_option(c), ": a resumed run counts its length as the run that "
             "saved (set [train] ", saved_unit, " and the other of steps and epochs to 0)");
  if (!c.uses_epochs() || unit == saved.end()) return;
  const std::uint64_t batches = saved_u64(saved, "schedule.batches_per_epoch", folder);
  const std::uint64_t accumulation = saved_u64(saved, "schedule.accumulation", folder);
  if (batches == schedule.batches_per_epoch() && accumulation == schedule.accumulation()) return;
  const data::EpochSchedule then(batches == 0 ? 1 : batches, accumulation == 0 ? 1 : accumulation);
  std::string options;
  for (const auto& [name, value] : {std::pair<const char*, std::int64_t>{"[train] epochs", c.epochs},
                                    {"checkpoint_every_epochs", c.checkpoint_every_epochs},
                                    {"export_every_epochs", c.export_every_epochs}})
    if (value > 0) options += (options.empty() ? "" : ", ") + std::string(name) + " = " + std::to_string(value);
  ZERO_THROW(zero::InvalidArgument, "resume: ", folder, " was saved with ", then.describe(), "; this run has ",
             schedule.describe(), ": its epochs (", options, ") would end on other steps. Resume with the dataset, "
             "the global batch (batch_size x ranks) and the accumulation of the run that saved");
}

std::string epoch_folder_name(std::int64_t epoch) {
  char name[32];
  std::snprintf(name, sizeof name, "epoch-%06lld", static_cast<long long>(epoch));
  return name;
}

}  // namespace sdxl
