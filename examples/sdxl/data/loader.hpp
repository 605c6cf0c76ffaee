// PrefetchingLoader: loads and collates the next batches on a background
// thread while the trainer computes, so that reading shards and converting
// fp16 to fp32 never sits on the training step's critical path.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "data/dataset.hpp"
#include "data/sampler.hpp"

namespace sdxl::data {

/// One rank's batch, collated into contiguous row-major float32 buffers that
/// the trainer can wrap with torch::from_blob(buffer.data(), shape).
struct Batch {
  std::uint64_t epoch = 0;
  std::uint64_t batch_in_epoch = 0;
  LatentSize bucket;
  std::vector<std::size_t> indices;

  std::vector<float> latents;  // [B, 4, h, w]
  std::array<std::int64_t, 4> latents_shape{0, kLatentChannels, 0, 0};
  std::vector<float> prompt_embeds;  // [B, sequence_length, width]
  std::array<std::int64_t, 3> prompt_embeds_shape{0, 0, 0};
  std::vector<float> pooled_prompt_embeds;  // [B, pooled_width]
  std::array<std::int64_t, 2> pooled_prompt_embeds_shape{0, 0};
  std::vector<float> time_ids;  // [B, 6]
  std::array<std::int64_t, 2> time_ids_shape{0, static_cast<std::int64_t>(kTimeIdCount)};
  std::vector<std::string> captions;

  /// The sampler state after this batch: what a checkpoint taken after
  /// training on this batch must save, so that the resumed run's first batch
  /// is the one after it.
  SamplerState state_after;

  std::size_t size() const noexcept { return indices.size(); }
};

/// Loads the samples of `batch` and stacks them. Throws zero::InvalidArgument
/// when a sample's shapes differ from the batch's bucket or from the dataset's
/// text dims (a Dataset whose bucket_of() disagrees with sample()).
Batch collate(const Dataset& dataset, const RankBatch& batch);

struct LoaderOptions {
  /// Batches prepared ahead of the trainer (the queue's bound). Two hide the
  /// load time of one batch behind a step even when step times jitter;
  /// more only costs memory (SDXL at 128x128 latents: ~0.9 MB per sample in fp32,
  /// most of it prompt_embeds).
  std::size_t prefetch_batches = 2;
};

/// Owns a sampler and a background thread that runs sampler.next() and
/// collate() up to prefetch_batches ahead of next().
///
/// Batches come out in exactly the sampler's order, so a run with the loader
/// sees the same data as one that collates directly. An exception thrown while
/// loading (a shard that fails to read, say) is rethrown by next() after the
/// batches prepared before it have been returned, and by every later call.
/// The destructor stops the thread and joins it; it waits at most for the
/// batch being loaded at that moment. Not thread-safe: one consumer thread.
class PrefetchingLoader {
 public:
  PrefetchingLoader(std::shared_ptr<const Dataset> dataset, DistributedBucketSampler sampler,
                    LoaderOptions options = {});
  ~PrefetchingLoader();
  PrefetchingLoader(const PrefetchingLoader&) = delete;
  PrefetchingLoader& operator=(const PrefetchingLoader&) = delete;

  /// The next batch; blocks until it is ready.
  Batch next();

  /// The sampler state after the last batch next() returned (the sampler's
  /// initial state before the first): save it with a checkpoint; a new loader
  /// whose sampler was restore()d from it continues with the following batch.
  /// Not the background thread's position, which runs ahead.
  SamplerState state() const { return consumed_state_; }

 private:
  void run();

  std::shared_ptr<const Dataset> dataset_;
  DistributedBucketSampler sampler_;  // used only by the background thread after construction
  LoaderOptions options_;
  SamplerState consumed_state_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::variant<Batch, std::exception_ptr>> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: started after every other member exists
};

}  // namespace sdxl::data
