#include "data/epoch_schedule.hpp"

#include <limits>
#include <sstream>

#include "zero/core/error.hpp"

namespace sdxl::data {

EpochSchedule::EpochSchedule(std::uint64_t batches_per_epoch, std::uint64_t accumulation)
    : batches_per_epoch_(batches_per_epoch), accumulation_(accumulation) {
  ZERO_CHECK(batches_per_epoch_ > 0, "epoch schedule: an epoch must hold at least one global batch");
  ZERO_CHECK(accumulation_ > 0, "epoch schedule: accumulation must be > 0");
}

double EpochSchedule::steps_per_epoch() const noexcept {
  return static_cast<double>(batches_per_epoch_) / static_cast<double>(accumulation_);
}

std::int64_t EpochSchedule::end_step(std::int64_t epoch) const {
  ZERO_CHECK(epoch >= 0, "epoch schedule: epoch ", epoch, " is negative");
  const auto e = static_cast<unsigned __int128>(epoch);
  const unsigned __int128 batches = e * batches_per_epoch_;
  const unsigned __int128 step = (batches + accumulation_ - 1) / accumulation_;
  ZERO_CHECK(step <= static_cast<unsigned __int128>(std::numeric_limits<std::int64_t>::max()), "epoch schedule: ",
             epoch, " epochs of ", describe(), " are more steps than an int64 holds");
  return static_cast<std::int64_t>(step);
}

std::int64_t EpochSchedule::completed(std::int64_t step) const {
  if (step <= 0) return 0;
  const unsigned __int128 batches = static_cast<unsigned __int128>(step) * accumulation_;
  return static_cast<std::int64_t>(batches / batches_per_epoch_);
}

double EpochSchedule::progress(std::int64_t step) const {
  if (step <= 0) return 0.0;
  // Whole epochs exactly, then the fraction: no rounding drift over long runs.
  const unsigned __int128 batches = static_cast<unsigned __int128>(step) * accumulation_;
  const auto whole = static_cast<double>(batches / batches_per_epoch_);
  const auto rest = static_cast<double>(batches % batches_per_epoch_);
  return whole + rest / static_cast<double>(batches_per_epoch_);
}

bool EpochSchedule::completes_multiple_of(std::int64_t step, std::int64_t every) const {
  if (every <= 0 || step <= 0) return false;
  return completed(step) / every > completed(step - 1) / every;
}

std::string EpochSchedule::describe() const {
  std::ostringstream text;
  text << batches_per_epoch_ << " global batches per epoch, accumulation " << accumulation_ << ": ";
  if (batches_per_epoch_ % accumulation_ == 0)
    text << batches_per_epoch_ / accumulation_ << (batches_per_epoch_ == accumulation_ ? " step" : " steps")
         << " per epoch";
  else
    text << steps_per_epoch() << " steps per epoch (epoch k ends at step ceil(k x " << batches_per_epoch_ << " / "
         << accumulation_ << "))";
  return text.str();
}

}  // namespace sdxl::data
