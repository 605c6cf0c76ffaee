// EpochSchedule against the sampler it describes: the step it names as the
// end of epoch k is the step during which the sampler hands out the last
// global batch of epoch k - 1 (0-based), for accumulations that divide the
// epoch and ones that do not, at every world size with the same global batch.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "data/epoch_schedule.hpp"
#include "data/sampler.hpp"
#include "zero/core/error.hpp"

using namespace sdxl::data;

namespace {

// 23 samples of one latent size, 13 of another: neither fills whole global
// batches of 6 (3 + 2 = 5 batches per epoch, 6 samples left out each epoch).
std::vector<LatentSize> two_buckets() {
  std::vector<LatentSize> buckets;
  // i -> 7i mod 36 permutes 0..35: exactly 13 indices, spread out, land below 13.
  for (int i = 0; i < 36; ++i) buckets.push_back(i * 7 % 36 < 13 ? LatentSize{16, 8} : LatentSize{16, 16});
  return buckets;
}

// The steps (1-based) during which the sampler of rank 0 finishes an epoch.
std::vector<std::int64_t> sampler_epoch_ends(std::size_t batch, int world, std::int64_t accumulation,
                                             std::int64_t steps) {
  DistributedBucketSampler sampler(two_buckets(), {.batch_size = batch, .world_size = world, .rank = 0, .seed = 9});
  std::vector<std::int64_t> ends;
  for (std::int64_t step = 1; step <= steps; ++step) {
    bool ended = false;
    for (std::int64_t micro = 0; micro < accumulation; ++micro) {
      const RankBatch b = sampler.next();
      if (b.batch_in_epoch + 1 == sampler.batches_per_epoch()) ended = true;
    }
    if (ended) ends.push_back(step);
  }
  return ends;
}

}  // namespace

TEST_CASE("EpochSchedule: the dataset of the test has 5 global batches of 6 per epoch") {
  const std::vector<LatentSize> buckets = two_buckets();
  std::size_t small = 0;
  for (const auto& b : buckets) small += b == LatentSize{16, 8};
  CHECK(buckets.size() == 36);
  CHECK(small == 13);
  DistributedBucketSampler sampler(buckets, {.batch_size = 6, .world_size = 1, .rank = 0});
  CHECK(sampler.batches_per_epoch() == 5);  // 23 / 6 = 3, 13 / 6 = 2 (drop-last per bucket)
  CHECK(sampler.leftover_per_epoch() == 6);
}

TEST_CASE("EpochSchedule: epoch ends are the steps where the sampler finishes an epoch") {
  for (std::int64_t accumulation : {1, 2, 3, 5, 7, 12}) {
    const std::vector<std::int64_t> expected = sampler_epoch_ends(6, 1, accumulation, 40);
    const EpochSchedule schedule(5, static_cast<std::uint64_t>(accumulation));
    std::vector<std::int64_t> got;
    for (std::int64_t step = 1; step <= 40; ++step)
      if (schedule.completes_multiple_of(step, 1)) got.push_back(step);
    CAPTURE(accumulation);
    CHECK(got == expected);
    // end_step names the same steps; a step past several epochs (A > B) names them all.
    for (std::int64_t k = 1; schedule.end_step(k) <= 40; ++k) {
      CHECK(schedule.completed(schedule.end_step(k)) >= k);
      CHECK(schedule.completed(schedule.end_step(k) - 1) < k);
    }
  }
}

TEST_CASE("EpochSchedule: the same epoch ends at world sizes 1, 2, 3 with the same global batch") {
  const std::vector<std::int64_t> one = sampler_epoch_ends(6, 1, 2, 30);
  CHECK(one == sampler_epoch_ends(3, 2, 2, 30));
  CHECK(one == sampler_epoch_ends(2, 3, 2, 30));
  CHECK(one == std::vector<std::int64_t>{3, 5, 8, 10, 13, 15, 18, 20, 23, 25, 28, 30});
}

TEST_CASE("EpochSchedule: arithmetic") {
  const EpochSchedule divides(6, 2);
  CHECK(divides.steps_per_epoch() == 3.0);
  CHECK(divides.end_step(1) == 3);
  CHECK(divides.end_step(4) == 12);
  CHECK(divides.progress(4) == doctest::Approx(4.0 / 3.0));
  CHECK(divides.completed(5) == 1);
  CHECK(divides.completed(6) == 2);
  CHECK(divides.completes_multiple_of(6, 2));
  CHECK_FALSE(divides.completes_multiple_of(3, 2));
  CHECK(divides.completes_multiple_of(12, 2));
  CHECK(divides.describe() == "6 global batches per epoch, accumulation 2: 3 steps per epoch");

  const EpochSchedule straddles(5, 2);  // epoch ends at steps 3, 5, 8, 10, ...
  CHECK(straddles.end_step(1) == 3);
  CHECK(straddles.end_step(2) == 5);
  CHECK(straddles.end_step(3) == 8);
  CHECK(straddles.progress(3) == doctest::Approx(1.2));
  CHECK(straddles.describe().find("2.5 steps per epoch") != std::string::npos);

  const EpochSchedule wide(2, 5);  // each step passes 2.5 epochs
  CHECK(wide.end_step(1) == 1);
  CHECK(wide.end_step(3) == 2);
  CHECK(wide.completes_multiple_of(2, 3));   // epochs 3 and 4 end in step 2
  CHECK_FALSE(wide.completes_multiple_of(1, 3));  // epochs 1 and 2 end in step 1

  CHECK_THROWS_AS(EpochSchedule(0, 1), zero::InvalidArgument);
  CHECK_THROWS_AS(EpochSchedule(1, 0), zero::InvalidArgument);
  CHECK_THROWS_AS(EpochSchedule(1u << 30, 1).end_step(std::int64_t{1} << 40), zero::InvalidArgument);
}
