// EpochSchedule: which optimizer steps end an epoch of the
// DistributedBucketSampler.
//
// An epoch is one pass of the sampler: B global batches of G = batch_size x
// world_size samples each (B = batches_per_epoch(), samples of a bucket that
// do not fill a whole global batch are left out of that epoch, see
// LastBatchPolicy::drop). An optimizer step takes A = accumulation of those
// batches, and the sampler runs on into the next epoch without a gap, so
// after step s exactly s x A batches have been handed out since the start of
// the run, and s x A / B epochs are done. Epoch k (1-based) therefore ends
// with step ceil(k x B / A). When A divides B that is every B / A steps; when
// it does not, the step that ends epoch k also trains on the first batches of
// epoch k + 1, and the gaps between epoch ends differ by one step.
//
// Everything here is a function of (B, A, step): the same steps end epochs at
// any world size with the same G and A, and after any resume.
#pragma once

#include <cstdint>
#include <string>

namespace sdxl::data {

class EpochSchedule {
 public:
  /// `batches_per_epoch` is the sampler's (B), `accumulation` the global
  /// batches per optimizer step (A). Throws zero::InvalidArgument for 0.
  EpochSchedule(std::uint64_t batches_per_epoch, std::uint64_t accumulation);

  std::uint64_t batches_per_epoch() const noexcept { return batches_per_epoch_; }
  std::uint64_t accumulation() const noexcept { return accumulation_; }
  /// B / A: whole when A divides B.
  double steps_per_epoch() const noexcept;

  /// The step (1-based) that completes epoch `epoch` (1-based): ceil(epoch x B / A).
  /// Throws zero::InvalidArgument when it does not fit an int64.
  std::int64_t end_step(std::int64_t epoch) const;
  /// Epochs completed once step `step` is done: floor(step x A / B).
  std::int64_t completed(std::int64_t step) const;
  /// Epochs done after `step`, with the fraction of the current one: step x A / B.
  double progress(std::int64_t step) const;
  /// Whether step `step` completes an epoch that is a multiple of `every`
  /// (epoch every, 2 every, ...). With A > B one step can complete more than
  /// one epoch; it counts when any of them is such a multiple.
  bool completes_multiple_of(std::int64_t step, std::int64_t every) const;

  /// "B global batches per epoch, accumulation A: S steps per epoch" for messages.
  std::string describe() const;

 private:
  std::uint64_t batches_per_epoch_;
  std::uint64_t accumulation_;
};

}  // namespace sdxl::data
