// DistributedBucketSampler: which samples each rank trains on, step by step.
//
// Every batch comes from one aspect-ratio bucket (one latent size), so a batch
// stacks into one [B,4,h,w] tensor. Ranks get disjoint slices of one *global*
// batch per step, so the data-parallel gradient average is the gradient of the
// global batch, and every rank's micro-batch has the same shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/dataset.hpp"

namespace sdxl::data {

/// What happens to the samples of a bucket that do not fill a whole global batch.
enum class LastBatchPolicy : std::uint8_t {
  /// The leftover (fewer than a global batch) samples of each bucket are left
  /// out of this epoch. The shuffle differs per epoch, so different samples
  /// are left out each time; a bucket smaller than one global batch is never
  /// used. Every sample appears at most once per epoch.
  drop,
  /// The leftover is completed with samples from the start of the same
  /// bucket's (shuffled) order, so every sample appears at least once per
  /// epoch and a few appear twice (a bucket smaller than a global batch is
  /// repeated as often as needed).
  pad,
};

struct SamplerOptions {
  /// Samples per rank per step (the micro-batch).
  std::size_t batch_size = 1;
  int world_size = 1;
  int rank = 0;
  std::uint64_t seed = 0;
  /// False keeps buckets in (height, width) order and samples in index order,
  /// for debugging and evaluation.
  bool shuffle = true;
  LastBatchPolicy last_batch = LastBatchPolicy::drop;
};

/// Where a sampler stands; save it with the checkpoint and pass it to
/// restore(). The identity fields make restoring onto a different dataset,
/// seed or global batch size an error instead of silently different data.
struct SamplerState {
  std::uint64_t epoch = 0;
  /// Global batches of `epoch` already handed out.
  std::uint64_t batch_in_epoch = 0;
  std::uint64_t seed = 0;
  std::uint64_t global_batch_size = 0;
  /// Hash of the dataset's size and every sample's bucket (see fingerprint()).
  std::uint64_t dataset_fingerprint = 0;

  bool operator==(const SamplerState&) const = default;

  /// As string key/values, e.g. for a safetensors checkpoint's __metadata__;
  /// keys are prefixed "sampler.".
  std::map<std::string, std::string> to_metadata() const;
  /// Inverse of to_metadata(); throws zero::InvalidArgument for missing or
  /// malformed keys.
  static SamplerState from_metadata(const std::map<std::string, std::string>& metadata);
};

/// One rank's share of one global batch.
struct RankBatch {
  std::uint64_t epoch = 0;
  std::uint64_t batch_in_epoch = 0;
  LatentSize bucket;
  /// Sample indices, batch_size of them.
  std::vector<std::size_t> indices;
};

/// One global batch: world_size * batch_size samples of one bucket.
struct GlobalBatch {
  LatentSize bucket;
  std::vector<std::size_t> indices;
};

/// Aspect-ratio bucketed, distributed, resumable sampler.
///
/// Epoch e is planned from (seed, e) alone:
///  1. samples are grouped by bucket, buckets taken in (height, width) order;
///  2. each bucket's indices are shuffled (Fisher–Yates, SplitMix64 seeded
///     from (seed, e), unbiased bounded draws) and cut into global batches of
///     G = batch_size * world_size; the leftover follows `last_batch`;
///  3. the list of global batches is shuffled with the same generator.
/// Rank r takes elements [r*batch_size, (r+1)*batch_size) of each global batch.
/// Iteration continues into epoch e+1 after the last batch of epoch e.
///
/// Guarantees (tested):
///  - every batch is from one bucket;
///  - within an epoch, ranks' samples are disjoint (drop policy) and together
///    cover every sample not dropped; for any world size, whether or not it
///    divides the dataset;
///  - the plan uses only integer arithmetic and this file's own PRNG, so it is
///    identical on every platform and standard library;
///  - the sequence of global batches depends only on (dataset buckets, seed,
///    G, shuffle, last_batch), not on world_size: runs with 8 ranks x 2 and
///    2 ranks x 8 see the same data in the same order, and a checkpoint can be
///    resumed at another world size with the same G;
///  - restore(state()) continues with exactly the batches an uninterrupted run
///    would have produced.
class DistributedBucketSampler {
 public:
  /// `buckets[i]` is sample i's latent size (Dataset::buckets()). Throws
  /// zero::InvalidArgument for bad options or when an epoch would hold no batch.
  DistributedBucketSampler(std::vector<LatentSize> buckets, SamplerOptions options);
  DistributedBucketSampler(const Dataset& dataset, SamplerOptions options);

  /// This rank's next batch; moves to the next epoch after the last one.
  RankBatch next();

  /// The state after the batches handed out so far.
  SamplerState state() const;
  /// Continues from `state`. Throws zero::InvalidArgument when it belongs to
  /// another seed, global batch size or dataset, or lies past the epoch's end.
  void restore(const SamplerState& state);
  /// Starts epoch `epoch` from its first batch.
  void set_epoch(std::uint64_t epoch);

  /// All global batches of an epoch, in order (what next() walks through).
  std::vector<GlobalBatch> global_batches(std::uint64_t epoch) const;

  std::size_t batches_per_epoch() const noexcept { return batches_per_epoch_; }
  std::size_t global_batch_size() const noexcept { return global_batch_size_; }
  /// Samples left out of every epoch (drop) or repeated in every epoch (pad).
  std::size_t leftover_per_epoch() const noexcept { return leftover_per_epoch_; }
  const SamplerOptions& options() const noexcept { return options_; }

  /// The identity hash stored in SamplerState.
  static std::uint64_t fingerprint(const std::vector<LatentSize>& buckets);

 private:
  const std::vector<GlobalBatch>& plan(std::uint64_t epoch);

  SamplerOptions options_;
  std::size_t global_batch_size_ = 0;
  std::uint64_t fingerprint_ = 0;
  // Sample indices per bucket, ascending, buckets in (height, width) order.
  std::map<LatentSize, std::vector<std::size_t>> members_;
  std::size_t batches_per_epoch_ = 0;
  std::size_t leftover_per_epoch_ = 0;

  std::uint64_t epoch_ = 0;
  std::uint64_t position_ = 0;  // global batches of epoch_ handed out
  std::uint64_t planned_epoch_ = 0;
  bool planned_ = false;
  std::vector<GlobalBatch> plan_;
};

}  // namespace sdxl::data
