// The host gradient worker's thread (src/engine/host_gradient_worker.hpp):
// additions and statistics, the same bits as on the calling thread in queue
// order, tickets that wait for exactly what they name, errors carried to the
// waiter, and a prompt shutdown with work still queued.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "host_gradient_worker.hpp"
#include "zero/core/error.hpp"
#include "zero/optim/optimizer.hpp"

using namespace zero;

namespace {

std::vector<std::uint16_t> random_bf16(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> out(n);
  for (std::size_t i = 0; i < n; ++i) store_from_float(out.data(), i, DType::bf16, normal(rng));
  return out;
}

}  // namespace

TEST_CASE("host adder: additions in queue order, the same bits as on the calling thread") {
  std::mt19937 rng(20261205);
  auto backend = make_host_backend();
  constexpr std::size_t kBuckets = 3, kMicroSteps = 5, kElements = 300'000;  // above one OpenMP chunk
  std::vector<std::vector<std::uint16_t>> expected(kBuckets), sums(kBuckets);
  std::vector<std::vector<std::vector<std::uint16_t>>> slices(kBuckets);
  for (std::size_t b = 0; b < kBuckets; ++b) {
    expected[b] = sums[b] = random_bf16(kElements, rng);
    for (std::size_t s = 0; s < kMicroSteps; ++s) slices[b].push_back(random_bf16(kElements, rng));
  }
  detail::HostGradientWorker adder(*backend, DType::bf16);
  std::vector<std::uint64_t> last(kBuckets, 0);
  for (std::size_t s = 0; s < kMicroSteps; ++s)
    for (std::size_t b = 0; b < kBuckets; ++b) {
      cpu_accumulate(expected[b].data(), slices[b][s].data(), DType::bf16, kElements);
      const std::uint64_t ticket = adder.add(sums[b].data(), slices[b][s].data(), kElements);
      CHECK(ticket > last[b]);
      last[b] = ticket;
    }
  // Waiting for the first bucket's last addition covers everything queued before it.
  adder.wait(last[0]);
  CHECK(std::memcmp(sums[0].data(), expected[0].data(), kElements * 2) == 0);
  adder.wait_all();
  for (std::size_t b = 0; b < kBuckets; ++b)
    CHECK_MESSAGE(std::memcmp(sums[b].data(), expected[b].data(), kElements * 2) == 0, "bucket ", b);
  adder.wait(0);  // nothing to wait for
  adder.wait_all();  // nothing queued
  CHECK(adder.take_wait_seconds() >= 0);
  CHECK(adder.take_wait_seconds() == 0);  // taken: the next step starts from nothing
}

TEST_CASE("host adder: an addition's error reaches every later wait") {
  auto backend = make_host_backend();
  std::vector<float> a(16, 1.0f), b(16, 2.0f);
  detail::HostGradientWorker adder(*backend, static_cast<DType>(7));  // no such dtype: cpu_accumulate refuses it
  const std::uint64_t ticket = adder.add(a.data(), b.data(), a.size());
  CHECK_THROWS_AS(adder.wait(ticket), Error);
  CHECK_THROWS_AS(adder.wait_all(), Error);
  CHECK(a[0] == 1.0f);
}

TEST_CASE("host adder: destroyed with additions queued, it stops without running them") {
  auto backend = make_host_backend();
  std::vector<float> sum(1 << 20, 0.0f), one(1 << 20, 1.0f);
  {
    detail::HostGradientWorker adder(*backend, DType::fp32);
    for (int i = 0; i < 1000; ++i) adder.add(sum.data(), one.data(), sum.size());
  }  // returns after at most the addition under way
  CHECK(sum[0] < 1000.0f);
  CHECK(sum[0] == sum.back());  // no addition was cut short
}

// Statistics queued behind additions see the sums: the same bits as
// cpu_grad_stats over the finished sum on the calling thread; non-finite flagged.
TEST_CASE("host worker: statistics run after the additions queued before them, the same bits") {
  std::mt19937 rng(7);
  auto backend = make_host_backend();
  constexpr std::size_t kElements = 200'003;  // several OpenMP chunks and a partial one
  const std::vector<std::uint16_t> start = random_bf16(kElements, rng), part = random_bf16(kElements, rng);
  std::vector<std::uint16_t> finished = start;
  cpu_accumulate(finished.data(), part.data(), DType::bf16, kElements);
  std::vector<std::uint16_t> sum = start, poisoned = start;
  store_from_float(poisoned.data(), 99, DType::bf16, std::numeric_limits<float>::infinity());
  detail::HostGradientWorker worker(*backend, DType::bf16);
  GradStats before_add, after_add, of_poisoned;
  worker.stats(sum.data(), kElements, &before_add);
  worker.add(sum.data(), part.data(), kElements);
  worker.wait(worker.stats(sum.data(), kElements, &after_add));
  worker.stats(poisoned.data(), kElements, &of_poisoned);
  worker.wait_all();
  CHECK(before_add.sum_squares == cpu_grad_stats(start.data(), kElements, DType::bf16).sum_squares);
  CHECK(after_add.sum_squares == cpu_grad_stats(finished.data(), kElements, DType::bf16).sum_squares);
  CHECK(after_add.sum_squares != before_add.sum_squares);
  CHECK_FALSE(after_add.nonfinite);
  CHECK(of_poisoned.nonfinite);
}

TEST_CASE("host worker: a statistic's error reaches the waiter") {
  auto backend = make_host_backend();
  std::vector<float> a(16, 1.0f);
  detail::HostGradientWorker worker(*backend, static_cast<DType>(7));  // cpu_grad_stats refuses it
  GradStats out;
  CHECK_THROWS_AS(worker.wait(worker.stats(a.data(), a.size(), &out)), Error);
}
