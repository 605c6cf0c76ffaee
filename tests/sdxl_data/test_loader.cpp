// PrefetchingLoader: the same batches as collating directly, resume through
// the consumed state, exceptions carried to the consumer, prompt shutdown.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "data/loader.hpp"
#include "data/synthetic.hpp"

using namespace sdxl::data;

namespace {

std::shared_ptr<SyntheticDataset> tiny_dataset(std::size_t n = 90) {
  return std::make_shared<SyntheticDataset>(SyntheticOptions{
      .num_samples = n,
      .seed = 4,
      .latent_sizes = {{8, 8}, {6, 10}},
      .text_dims = {.sequence_length = 7, .width = 64, .pooled_width = 32},
      .num_captions = 5});
}

void check_same(const Batch& a, const Batch& b) {
  REQUIRE(a.epoch == b.epoch);
  REQUIRE(a.batch_in_epoch == b.batch_in_epoch);
  REQUIRE(a.indices == b.indices);
  REQUIRE(a.latents_shape == b.latents_shape);
  REQUIRE(a.latents == b.latents);
  REQUIRE(a.prompt_embeds == b.prompt_embeds);
  REQUIRE(a.pooled_prompt_embeds == b.pooled_prompt_embeds);
  REQUIRE(a.time_ids == b.time_ids);
  REQUIRE(a.captions == b.captions);
}

// Delegates to a dataset; throws on the n-th sample() call, or sleeps per call.
class FaultyDataset final : public Dataset {
 public:
  FaultyDataset(std::shared_ptr<const Dataset> inner, long fail_at_call, std::chrono::milliseconds delay = {})
      : inner_(std::move(inner)), fail_at_call_(fail_at_call), delay_(delay) {}
  std::size_t size() const override { return inner_->size(); }
  LatentSize bucket_of(std::size_t i) const override { return inner_->bucket_of(i); }
  TextDims text_dims() const override { return inner_->text_dims(); }
  Sample sample(std::size_t i) const override {
    if (delay_.count()) std::this_thread::sleep_for(delay_);
    if (calls_.fetch_add(1) == fail_at_call_) ZERO_THROW(zero::IoError, "injected read failure at sample ", i);
    return inner_->sample(i);
  }
  long calls() const { return calls_.load(); }

 private:
  std::shared_ptr<const Dataset> inner_;
  long fail_at_call_;
  std::chrono::milliseconds delay_;
  mutable std::atomic<long> calls_{0};
};

}  // namespace

TEST_CASE("loader: yields the batches of direct collation, in order, with collated shapes") {
  auto dataset = tiny_dataset();
  const SamplerOptions options{.batch_size = 3, .world_size = 2, .rank = 1, .seed = 2};
  DistributedBucketSampler direct(*dataset, options);
  PrefetchingLoader loader(dataset, DistributedBucketSampler(*dataset, options), {.prefetch_batches = 3});
  CHECK(loader.state() == direct.state());
  const std::size_t steps = direct.batches_per_epoch() * 2 + 1;
  for (std::size_t s = 0; s < steps; ++s) {
    const Batch got = loader.next();
    const Batch expected = collate(*dataset, direct.next());
    check_same(got, expected);
    REQUIRE(got.latents_shape == std::array<std::int64_t, 4>{3, 4, got.bucket.height, got.bucket.width});
    REQUIRE(got.latents.size() == static_cast<std::size_t>(3 * 4 * got.bucket.height * got.bucket.width));
    REQUIRE(got.prompt_embeds_shape == std::array<std::int64_t, 3>{3, 7, 64});
    REQUIRE(got.prompt_embeds.size() == 3u * 7u * 64u);
    REQUIRE(got.pooled_prompt_embeds_shape == std::array<std::int64_t, 2>{3, 32});
    REQUIRE(got.time_ids_shape == std::array<std::int64_t, 2>{3, 6});
    // Sample k of the batch is at offset k in every buffer.
    const Sample second = dataset->sample(got.indices[1]);
    REQUIRE(std::equal(second.latents.begin(), second.latents.end(), got.latents.begin() + second.latents.size()));
    REQUIRE(got.time_ids[6] == second.time_ids[0]);
    // The state to checkpoint is the consumer's, not the prefetching thread's.
    REQUIRE(loader.state() == direct.state());
    REQUIRE(got.state_after == direct.state());
  }
}

TEST_CASE("loader: a loader restored from state() continues with the next batch") {
  auto dataset = tiny_dataset();
  const SamplerOptions options{.batch_size = 4, .seed = 6};
  PrefetchingLoader uninterrupted(dataset, DistributedBucketSampler(*dataset, options));
  std::vector<Batch> expected;
  for (int s = 0; s < 40; ++s) expected.push_back(uninterrupted.next());

  SamplerState saved;
  {
    PrefetchingLoader first(dataset, DistributedBucketSampler(*dataset, options), {.prefetch_batches = 4});
    for (int s = 0; s < 17; ++s) first.next();
    saved = first.state();  // the thread has loaded further ahead by now
  }
  DistributedBucketSampler sampler(*dataset, options);
  sampler.restore(saved);
  PrefetchingLoader resumed(dataset, std::move(sampler));
  for (int s = 17; s < 40; ++s) check_same(resumed.next(), expected[static_cast<std::size_t>(s)]);
}

TEST_CASE("loader: an exception in the background thread is rethrown by next()") {
  auto inner = tiny_dataset();
  // Batches of 2: calls 0..5 make three good batches, call 6 fails in the fourth.
  auto faulty = std::make_shared<FaultyDataset>(inner, 6);
  const SamplerOptions options{.batch_size = 2, .seed = 1};
  DistributedBucketSampler direct(*inner, options);
  PrefetchingLoader loader(faulty, DistributedBucketSampler(*inner, options), {.prefetch_batches = 2});
  for (int s = 0; s < 3; ++s) check_same(loader.next(), collate(*inner, direct.next()));
  const SamplerState before_failure = loader.state();
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      loader.next();
      FAIL("next() returned after the failure");
    } catch (const zero::IoError& e) {
      CHECK(std::string(e.what()).find("injected read failure") != std::string::npos);
    }
  }
  // A checkpoint after the failure resumes at the batch that failed.
  CHECK(loader.state() == before_failure);
}

TEST_CASE("loader: destruction does not hang, whatever the thread is doing") {
  auto inner = tiny_dataset();
  const SamplerOptions options{.batch_size = 3, .seed = 1};
  const auto start = std::chrono::steady_clock::now();
  {  // never consumed: the thread waits on a full queue
    PrefetchingLoader loader(inner, DistributedBucketSampler(*inner, options), {.prefetch_batches = 1});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {  // destroyed at once, possibly before the thread ran
    PrefetchingLoader loader(inner, DistributedBucketSampler(*inner, options));
  }
  {  // destroyed after some consumption
    PrefetchingLoader loader(inner, DistributedBucketSampler(*inner, options));
    loader.next();
    loader.next();
  }
  {  // destroyed while the thread is mid-batch in a slow dataset
    auto slow = std::make_shared<FaultyDataset>(inner, -1, std::chrono::milliseconds(30));
    PrefetchingLoader loader(slow, DistributedBucketSampler(*inner, options), {.prefetch_batches = 8});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  {  // destroyed after the thread died of an error
    auto failing = std::make_shared<FaultyDataset>(inner, 0);
    PrefetchingLoader loader(failing, DistributedBucketSampler(*inner, options));
    CHECK_THROWS_AS(loader.next(), zero::IoError);
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed < std::chrono::seconds(5));
  CHECK_THROWS_AS(PrefetchingLoader(nullptr, DistributedBucketSampler(*inner, options)), zero::InvalidArgument);
}
