// SyntheticDataset: deterministic, bucketed, and learnable (caption -> pattern).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <set>

#include "data/cached_dataset.hpp"
#include "data/synthetic.hpp"
#include "test_util.hpp"

using namespace sdxl::data;

namespace {

SyntheticOptions options(std::uint64_t seed = 0, float noise = 0.1f) {
  return {.num_samples = 200,
          .seed = seed,
          .latent_sizes = {{8, 8}, {6, 10}, {10, 6}},
          .text_dims = {.sequence_length = 7, .width = 64, .pooled_width = 32},
          .num_captions = 6,
          .noise_std = noise};
}

float mean_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += std::fabs(a[i] - b[i]);
  return static_cast<float>(sum / static_cast<double>(a.size()));
}

}  // namespace

TEST_CASE("synthetic: deterministic from (seed, index)") {
  SyntheticDataset a(options(1)), b(options(1)), c(options(2));
  for (std::size_t i : {0u, 1u, 57u, 199u}) {
    const Sample x = a.sample(i), y = b.sample(i), again = a.sample(i);
    CHECK(x.latents == y.latents);
    CHECK(x.latents == again.latents);
    CHECK(x.prompt_embeds == y.prompt_embeds);
    CHECK(x.pooled_prompt_embeds == y.pooled_prompt_embeds);
    CHECK(x.caption == y.caption);
    CHECK(x.time_ids == y.time_ids);
  }
  int differing = 0;
  for (std::size_t i = 0; i < 20; ++i) differing += a.sample(i).latents != c.sample(i).latents;
  CHECK(differing == 20);
  CHECK_THROWS_AS(a.sample(200), zero::InvalidArgument);

  // Golden values: codes and sizes come from integer draws of the project's
  // own PRNG, so they are the same on every platform.
  SyntheticDataset golden(options(0));
  const std::vector<std::size_t> codes{2, 2, 1, 0, 4, 5, 5, 3};
  const std::vector<LatentSize> sizes{{8, 8}, {6, 10}, {6, 10}, {10, 6}, {8, 8}, {10, 6}, {8, 8}, {6, 10}};
  for (std::size_t i = 0; i < codes.size(); ++i) {
    CHECK(golden.caption_code(i) == codes[i]);
    CHECK(golden.bucket_of(i) == sizes[i]);
  }
}

TEST_CASE("synthetic: buckets, shapes and time ids") {
  SyntheticDataset dataset(options());
  std::set<LatentSize> used;
  for (std::size_t i = 0; i < dataset.size(); ++i) {
    const LatentSize bucket = dataset.bucket_of(i);
    used.insert(bucket);
    if (i % 10 == 0) {
      const Sample s = dataset.sample(i);
      CHECK(s.latent_size() == bucket);
      CHECK(s.latents.size() == static_cast<std::size_t>(4 * bucket.height * bucket.width));
      CHECK(s.prompt_embeds.size() == 7u * 64u);
      CHECK(s.pooled_prompt_embeds.size() == 32u);
      CHECK(s.time_ids == std::array<float, 6>{8.0f * bucket.height, 8.0f * bucket.width, 0, 0,
                                               8.0f * bucket.height, 8.0f * bucket.width});
    }
  }
  CHECK(used.size() == 3);
  CHECK_NOTHROW(check_text_dims(dataset, {7, 64, 32}));
  CHECK_THROWS_AS(check_text_dims(dataset, TextDims{}), zero::InvalidArgument);
  SyntheticOptions no_sizes = options();
  no_sizes.latent_sizes.clear();
  CHECK_THROWS_AS(SyntheticDataset{no_sizes}, zero::InvalidArgument);
}

TEST_CASE("synthetic: the caption determines the pattern, distinct captions give distinct latents") {
  SyntheticDataset dataset(options(3, 0.0f));
  // First sample of each (caption, bucket) pair.
  std::map<std::pair<std::size_t, LatentSize>, std::size_t> first;
  for (std::size_t i = 0; i < dataset.size(); ++i) {
    const auto key = std::make_pair(dataset.caption_code(i), dataset.bucket_of(i));
    auto [it, inserted] = first.emplace(key, i);
    if (!inserted) {
      // Same caption, same size, no noise: the same latent and text.
      const Sample a = dataset.sample(it->second), b = dataset.sample(i);
      REQUIRE(a.latents == b.latents);
      REQUIRE(a.prompt_embeds == b.prompt_embeds);
      REQUIRE(a.caption == b.caption);
    }
  }
  REQUIRE(first.size() == 18);  // 6 captions x 3 sizes all occur in 200 samples
  const LatentSize square{8, 8};
  for (std::size_t c = 0; c < 6; ++c) {
    for (std::size_t d = c + 1; d < 6; ++d) {
      const Sample a = dataset.sample(first.at({c, square})), b = dataset.sample(first.at({d, square}));
      CAPTURE(c);
      CAPTURE(d);
      CHECK(a.caption != b.caption);
      CHECK(mean_abs_difference(a.latents, b.latents) > 0.1f);
      CHECK(mean_abs_difference(a.prompt_embeds, b.prompt_embeds) > 0.5f);
      CHECK(mean_abs_difference(a.pooled_prompt_embeds, b.pooled_prompt_embeds) > 0.5f);
    }
  }
  // With noise, samples of one caption differ a little and stay close.
  SyntheticDataset noisy(options(3, 0.1f));
  const auto [key, i] = *first.begin();
  for (std::size_t j = i + 1; j < noisy.size(); ++j) {
    if (noisy.caption_code(j) != key.first || noisy.bucket_of(j) != key.second) continue;
    const float difference = mean_abs_difference(noisy.sample(i).latents, noisy.sample(j).latents);
    CHECK(difference > 0.0f);
    CHECK(difference < 0.2f);
    break;
  }
}

TEST_CASE("synthetic -> CachedDatasetWriter (fp32) -> CachedDataset reproduces the samples exactly") {
  sdxl::data::testing::TempDir dir;
  SyntheticDataset dataset({.num_samples = 30,
                            .seed = 9,
                            .latent_sizes = {{8, 8}, {6, 10}},
                            .text_dims = {.sequence_length = 7, .width = 64, .pooled_width = 32}});
  CachedDatasetWriter writer(dir.path(), {.samples_per_shard = 8,
                                          .latents_dtype = zero::DType::fp32,
                                          .text_dtype = zero::DType::fp32,
                                          .text_dims = dataset.text_dims()});
  for (std::size_t i = 0; i < dataset.size(); ++i) writer.add(dataset.sample(i));
  writer.finish();
  auto cached = CachedDataset::open(dir.path());
  REQUIRE(cached->size() == dataset.size());
  CHECK(cached->buckets() == dataset.buckets());
  for (std::size_t i = 0; i < dataset.size(); ++i) {
    const Sample a = dataset.sample(i), b = cached->sample(i);
    REQUIRE(a.latents == b.latents);
    REQUIRE(a.prompt_embeds == b.prompt_embeds);
    REQUIRE(a.pooled_prompt_embeds == b.pooled_prompt_embeds);
    REQUIRE(a.time_ids == b.time_ids);
    REQUIRE(a.caption == b.caption);
  }
}

TEST_CASE("synthetic: a deterministic empty prompt, unlike every caption's conditioning") {
  const SyntheticDataset a(options(3)), b(options(3)), other_seed(options(4));
  REQUIRE(a.empty_prompt() != nullptr);
  const EmptyPrompt& empty = *a.empty_prompt();
  const TextDims text = a.text_dims();
  CHECK(empty.prompt_embeds.size() == static_cast<std::size_t>(text.sequence_length * text.width));
  CHECK(empty.pooled_prompt_embeds.size() == static_cast<std::size_t>(text.pooled_width));
  CHECK(empty.prompt_embeds == b.empty_prompt()->prompt_embeds);
  CHECK(empty.pooled_prompt_embeds == b.empty_prompt()->pooled_prompt_embeds);
  CHECK(empty.prompt_embeds != other_seed.empty_prompt()->prompt_embeds);
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Sample s = a.sample(i);
    CHECK(s.prompt_embeds != empty.prompt_embeds);
    CHECK(s.pooled_prompt_embeds != empty.pooled_prompt_embeds);
  }
}
