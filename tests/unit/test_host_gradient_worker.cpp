// The host gradient worker's thread (src/engine/host_gradient_worker.hpp):
// additions and statistics, the same bits as on the calling thread in queue
// order, tickets that wait for exactly what they name, errors carried to the
// waiter, and a prompt shutdown with work still queued.
#include <doctest/doctest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
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

namespace {

// A backend whose events stand for copies still on their way: wait_event
// blocks until the test opens that event's gate. Everything else is inert;
// the worker's jobs run the host kernels (Backend's defaults).
class GatedBackend final : public Backend {
 public:
  MemoryKind memory_kind() const override { return MemoryKind::host; }
  std::string name() const override { return "gated"; }
  void* allocate(std::size_t) override { return nullptr; }
  void deallocate(void*, std::size_t) override {}
  void* allocate_host(std::size_t) override { return nullptr; }
  void deallocate_host(void*, std::size_t) override {}
  Stream compute_stream() const override { return nullptr; }
  Stream comm_stream() const override { return nullptr; }
  Event record_event(Stream) override { return nullptr; }
  void stream_wait(Stream, Event) override {}
  void release_event(Event) override {}
  void synchronize(Stream) override {}
  void fill_zero(void*, std::size_t, Stream) override {}
  void copy(void*, const void*, std::size_t, Stream) override {}
  void copy_to_host(void*, const void*, std::size_t) override {}
  void copy_from_host(void*, const void*, std::size_t) override {}
  void convert(const void*, DType, void*, DType, std::size_t, Stream) override {}
  void accumulate(void*, const void*, DType, std::size_t, Stream) override {}
  void ema_update(float*, const float*, std::size_t, double, Stream) override {}
  void optimizer_step(const OptimizerOptions&, const StepScalars&, const ShardUpdate&, Stream) override {}
  GradStats grad_stats(const Span*, std::size_t, DType, Stream) override { return {}; }

  void wait_event(Event event) override {
    std::unique_lock<std::mutex> lock(mutex_);
    waiting_.push_back(event);
    changed_.notify_all();
    changed_.wait(lock, [&] { return std::find(open_.begin(), open_.end(), event) != open_.end(); });
  }
  void open(Event event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_.push_back(event);
    }
    changed_.notify_all();
  }
  /// Blocks until some thread waits for `event`.
  void await_waiter(Event event) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return std::find(waiting_.begin(), waiting_.end(), event) != waiting_.end(); });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Event> waiting_, open_;
};

}  // namespace

TEST_CASE("host gradient worker: a job queued with a copy's event waits for it, not the thread that queued") {
  std::mt19937 rng(20261205);
  constexpr std::size_t kElements = 200'000;
  GatedBackend backend;
  detail::HostGradientWorker worker(backend, DType::bf16);
  Event copy_a = reinterpret_cast<Event>(std::uintptr_t{0x10}), copy_b = reinterpret_cast<Event>(std::uintptr_t{0x20});
  // The slices still hold what was there before their copies land.
  std::vector<std::uint16_t> landing = random_bf16(kElements, rng), staged = random_bf16(kElements, rng);
  std::vector<std::uint16_t> sum = random_bf16(kElements, rng);
  GradStats stats;
  stats.sum_squares = -1;
  // Queued at once (this thread does not wait for either copy).
  const std::uint64_t add_ticket = worker.add(sum.data(), staged.data(), kElements, copy_a);
  const std::uint64_t stats_ticket = worker.stats(landing.data(), kElements, &stats, copy_b);
  CHECK(stats_ticket > add_ticket);
  backend.await_waiter(copy_a);  // the worker waits for the first copy
  // The copies land: new values in both slices, then their events complete.
  const std::vector<std::uint16_t> arrived_staged = random_bf16(kElements, rng);
  const std::vector<std::uint16_t> arrived = random_bf16(kElements, rng);
  std::vector<std::uint16_t> expected_sum = sum;
  cpu_accumulate(expected_sum.data(), arrived_staged.data(), DType::bf16, kElements);
  const GradStats expected_stats = cpu_grad_stats(arrived.data(), kElements, DType::bf16, CpuKernel::vectorized);
  std::copy(arrived_staged.begin(), arrived_staged.end(), staged.begin());  // in place: the worker holds the pointer
  backend.open(copy_a);
  backend.await_waiter(copy_b);  // the addition ran; the statistics wait for their copy
  CHECK(stats.sum_squares == -1);
  std::copy(arrived.begin(), arrived.end(), landing.begin());
  backend.open(copy_b);
  worker.wait(stats_ticket);
  CHECK(std::memcmp(sum.data(), expected_sum.data(), kElements * 2) == 0);
  CHECK(stats.sum_squares == expected_stats.sum_squares);
  CHECK(stats.nonfinite == expected_stats.nonfinite);
}
