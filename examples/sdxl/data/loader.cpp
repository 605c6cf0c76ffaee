#include "data/loader.hpp"

#include <algorithm>
#include <utility>

#include "zero/core/error.hpp"

namespace sdxl::data {

Batch collate(const Dataset& dataset, const RankBatch& rank_batch) {
  const std::size_t b = rank_batch.indices.size();
  ZERO_CHECK(b > 0, "collate: empty batch");
  const TextDims text = dataset.text_dims();
  const LatentSize size = rank_batch.bucket;
  const std::size_t latent_elements = static_cast<std::size_t>(kLatentChannels * size.height * size.width);
  const std::size_t embed_elements = static_cast<std::size_t>(text.sequence_length * text.width);
  const std::size_t pooled_elements = static_cast<std::size_t>(text.pooled_width);

  Batch batch;
  batch.epoch = rank_batch.epoch;
  batch.batch_in_epoch = rank_batch.batch_in_epoch;
  batch.bucket = size;
  batch.indices = rank_batch.indices;
  const auto n = static_cast<std::int64_t>(b);
  batch.latents_shape = {n, kLatentChannels, size.height, size.width};
  batch.prompt_embeds_shape = {n, text.sequence_length, text.width};
  batch.pooled_prompt_embeds_shape = {n, text.pooled_width};
  batch.time_ids_shape = {n, static_cast<std::int64_t>(kTimeIdCount)};
  batch.latents.resize(b * latent_elements);
  batch.prompt_embeds.resize(b * embed_elements);
  batch.pooled_prompt_embeds.resize(b * pooled_elements);
  batch.time_ids.resize(b * kTimeIdCount);
  batch.captions.reserve(b);

  for (std::size_t k = 0; k < b; ++k) {
    const std::size_t index = rank_batch.indices[k];
    Sample sample = dataset.sample(index);
    // A mismatch here is a Dataset whose bucket_of() and sample() disagree;
    // stacking it would read past or short of the buffers.
    ZERO_CHECK(sample.latent_size() == size && sample.latents.size() == latent_elements, "collate: sample ",
               index, " has latent ", sample.latent_size(), " but its batch is from bucket ", size);
    ZERO_CHECK(sample.prompt_embeds.size() == embed_elements && sample.pooled_prompt_embeds.size() == pooled_elements,
               "collate: sample ", index, " has text embeddings of another size than the dataset's ", text);
    std::copy(sample.latents.begin(), sample.latents.end(), batch.latents.begin() + k * latent_elements);
    std::copy(sample.prompt_embeds.begin(), sample.prompt_embeds.end(),
              batch.prompt_embeds.begin() + k * embed_elements);
    std::copy(sample.pooled_prompt_embeds.begin(), sample.pooled_prompt_embeds.end(),
              batch.pooled_prompt_embeds.begin() + k * pooled_elements);
    std::copy(sample.time_ids.begin(), sample.time_ids.end(), batch.time_ids.begin() + k * kTimeIdCount);
    batch.captions.push_back(std::move(sample.caption));
  }
  return batch;
}

PrefetchingLoader::PrefetchingLoader(std::shared_ptr<const Dataset> dataset, DistributedBucketSampler sampler,
                                     LoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(options) {
  ZERO_CHECK(dataset_ != nullptr, "PrefetchingLoader: null dataset");
  ZERO_CHECK(options_.prefetch_batches > 0, "PrefetchingLoader: prefetch_batches must be > 0");
  consumed_state_ = sampler_.state();
  worker_ = std::thread([this] { run(); });
}

PrefetchingLoader::~PrefetchingLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void PrefetchingLoader::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [this] { return stop_ || queue_.size() < options_.prefetch_batches; });
      if (stop_) return;
    }
    // Load outside the lock so that next() can take finished batches meanwhile.
    std::variant<Batch, std::exception_ptr> item;
    bool failed = false;
    try {
      Batch batch = collate(*dataset_, sampler_.next());
      batch.state_after = sampler_.state();
      item = std::move(batch);
    } catch (...) {
      item = std::current_exception();
      failed = true;
    }
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(item));
    }
    changed_.notify_all();
    // After a failure the sampler has moved past a batch that was never
    // delivered; continuing would skip data silently, so the thread ends and
    // next() keeps reporting the error.
    if (failed) return;
  }
}

Batch PrefetchingLoader::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return !queue_.empty(); });
  if (auto* error = std::get_if<std::exception_ptr>(&queue_.front())) std::rethrow_exception(*error);
  Batch batch = std::move(std::get<Batch>(queue_.front()));
  queue_.pop_front();
  lock.unlock();
  changed_.notify_all();
  consumed_state_ = batch.state_after;
  return batch;
}

}  // namespace sdxl::data
