#include "data/sampler.hpp"

#include <charconv>
#include <utility>

#include "zero/core/error.hpp"

namespace sdxl::data {
namespace {

// Fisher–Yates with the sampler's own generator: the same permutation on every
// platform, unlike std::shuffle.
template <typename T>
void shuffle_in_place(std::vector<T>& items, SplitMix64& rng) {
  for (std::size_t i = items.size(); i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(rng.bounded(i));
    std::swap(items[i - 1], items[j]);
  }
}

// Distinguishes the shuffle stream from other uses of combine() on the same seed.
constexpr std::uint64_t kShuffleStream = 0x53485546464c45ull;  // "SHUFFLE"

std::uint64_t parse_u64(const std::map<std::string, std::string>& metadata, const std::string& key) {
  auto it = metadata.find(key);
  ZERO_CHECK(it != metadata.end(), "sampler state: missing key '", key, "'");
  std::uint64_t value = 0;
  const std::string& text = it->second;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  ZERO_CHECK(error == std::errc() && end == text.data() + text.size() && !text.empty(),
             "sampler state: '", key, "' is '", text, "', expected an unsigned integer");
  return value;
}

}  // namespace

std::map<std::string, std::string> SamplerState::to_metadata() const {
  return {{"sampler.epoch", std::to_string(epoch)},
          {"sampler.batch_in_epoch", std::to_string(batch_in_epoch)},
          {"sampler.seed", std::to_string(seed)},
          {"sampler.global_batch_size", std::to_string(global_batch_size)},
          {"sampler.dataset_fingerprint", std::to_string(dataset_fingerprint)}};
}

SamplerState SamplerState::from_metadata(const std::map<std::string, std::string>& metadata) {
  SamplerState state;
  state.epoch = parse_u64(metadata, "sampler.epoch");
  state.batch_in_epoch = parse_u64(metadata, "sampler.batch_in_epoch");
  state.seed = parse_u64(metadata, "sampler.seed");
  state.global_batch_size = parse_u64(metadata, "sampler.global_batch_size");
  state.dataset_fingerprint = parse_u64(metadata, "sampler.dataset_fingerprint");
  return state;
}

std::uint64_t DistributedBucketSampler::fingerprint(const std::vector<LatentSize>& buckets) {
  std::uint64_t h = SplitMix64::combine(buckets.size());
  for (const LatentSize& b : buckets)
    h = SplitMix64::combine(h, static_cast<std::uint64_t>(b.height), static_cast<std::uint64_t>(b.width));
  return h;
}

DistributedBucketSampler::DistributedBucketSampler(const Dataset& dataset, SamplerOptions options)
    : DistributedBucketSampler(dataset.buckets(), options) {}

DistributedBucketSampler::DistributedBucketSampler(std::vector<LatentSize> buckets, SamplerOptions options)
    : options_(options) {
  ZERO_CHECK(options_.batch_size > 0, "sampler: batch_size must be > 0");
  ZERO_CHECK(options_.world_size > 0, "sampler: world_size must be > 0, got ", options_.world_size);
  ZERO_CHECK(options_.rank >= 0 && options_.rank < options_.world_size, "sampler: rank ", options_.rank,
             " outside [0, ", options_.world_size, ")");
  ZERO_CHECK(options_.last_batch == LastBatchPolicy::drop || options_.last_batch == LastBatchPolicy::pad,
             "sampler: unknown last_batch policy");
  ZERO_CHECK(!buckets.empty(), "sampler: the dataset is empty");
  global_batch_size_ = options_.batch_size * static_cast<std::size_t>(options_.world_size);
  fingerprint_ = fingerprint(buckets);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    ZERO_CHECK(buckets[i].height > 0 && buckets[i].width > 0, "sampler: sample ", i, " has latent size ",
               buckets[i]);
    members_[buckets[i]].push_back(i);
  }
  for (const auto& [bucket, indices] : members_) {
    const std::size_t full = indices.size() / global_batch_size_;
    const std::size_t leftover = indices.size() % global_batch_size_;
    if (options_.last_batch == LastBatchPolicy::drop) {
      batches_per_epoch_ += full;
      leftover_per_epoch_ += leftover;
    } else {
      batches_per_epoch_ += full + (leftover ? 1 : 0);
      leftover_per_epoch_ += leftover ? global_batch_size_ - leftover : 0;
    }
  }
  ZERO_CHECK(batches_per_epoch_ > 0, "sampler: no bucket holds a global batch of ", global_batch_size_,
             " samples (", options_.batch_size, " per rank x ", options_.world_size, " ranks, ",
             members_.size(), " buckets, ", buckets.size(),
             " samples); lower batch_size, run on fewer ranks, or use a dataset with more samples of one latent "
             "size (synthetic_samples for synthetic data)");
}

std::vector<GlobalBatch> DistributedBucketSampler::global_batches(std::uint64_t epoch) const {
  const std::size_t g = global_batch_size_;
  SplitMix64 rng(SplitMix64::combine(options_.seed, kShuffleStream, epoch));
  std::vector<GlobalBatch> batches;
  batches.reserve(batches_per_epoch_);
  // Buckets in map order ((height, width) ascending) so the draws from rng
  // happen in the same order everywhere.
  for (const auto& [bucket, members] : members_) {
    std::vector<std::size_t> order = members;
    if (options_.shuffle) shuffle_in_place(order, rng);
    std::size_t start = 0;
    for (; start + g <= order.size(); start += g)
      batches.push_back({bucket, std::vector<std::size_t>(order.begin() + static_cast<std::ptrdiff_t>(start),
                                                          order.begin() + static_cast<std::ptrdiff_t>(start + g))});
    if (start < order.size() && options_.last_batch == LastBatchPolicy::pad) {
      GlobalBatch last{bucket, std::vector<std::size_t>(order.begin() + static_cast<std::ptrdiff_t>(start),
                                                        order.end())};
      for (std::size_t k = 0; last.indices.size() < g; ++k) last.indices.push_back(order[k % order.size()]);
      batches.push_back(std::move(last));
    }
  }
  if (options_.shuffle) shuffle_in_place(batches, rng);
  return batches;
}

const std::vector<GlobalBatch>& DistributedBucketSampler::plan(std::uint64_t epoch) {
  if (!planned_ || planned_epoch_ != epoch) {
    plan_ = global_batches(epoch);
    planned_epoch_ = epoch;
    planned_ = true;
  }
  return plan_;
}

RankBatch DistributedBucketSampler::next() {
  if (position_ >= batches_per_epoch_) {
    ++epoch_;
    position_ = 0;
  }
  const GlobalBatch& global = plan(epoch_)[position_];
  RankBatch batch;
  batch.epoch = epoch_;
  batch.batch_in_epoch = position_;
  batch.bucket = global.bucket;
  const std::size_t begin = static_cast<std::size_t>(options_.rank) * options_.batch_size;
  batch.indices.assign(global.indices.begin() + static_cast<std::ptrdiff_t>(begin),
                       global.indices.begin() + static_cast<std::ptrdiff_t>(begin + options_.batch_size));
  ++position_;
  return batch;
}

SamplerState DistributedBucketSampler::state() const {
  return {.epoch = epoch_,
          .batch_in_epoch = position_,
          .seed = options_.seed,
          .global_batch_size = global_batch_size_,
          .dataset_fingerprint = fingerprint_};
}

void DistributedBucketSampler::restore(const SamplerState& state) {
  ZERO_CHECK(state.seed == options_.seed, "sampler restore: state has seed ", state.seed,
             ", this sampler ", options_.seed);
  ZERO_CHECK(state.global_batch_size == global_batch_size_, "sampler restore: state has global batch size ",
             state.global_batch_size, ", this sampler ", global_batch_size_,
             " (batch_size x world_size); the data order is defined per global batch size");
  ZERO_CHECK(state.dataset_fingerprint == fingerprint_,
             "sampler restore: the state was saved for another dataset (different sample count or buckets)");
  ZERO_CHECK(state.batch_in_epoch <= batches_per_epoch_, "sampler restore: batch ", state.batch_in_epoch,
             " is past the end of an epoch of ", batches_per_epoch_, " batches");
  epoch_ = state.epoch;
  position_ = state.batch_in_epoch;
}

void DistributedBucketSampler::set_epoch(std::uint64_t epoch) {
  epoch_ = epoch;
  position_ = 0;
}

}  // namespace sdxl::data
