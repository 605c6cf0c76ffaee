// CudaBackend: memory, streams and events, and grad_stats against float64.

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "zero/cuda/cuda_backend.hpp"
#include "zero/cuda/kernels.hpp"

namespace zero::test {

TEST_CASE("backend: memory, copies, events and streams") {
  auto backend = make_cuda_backend(0);
  CHECK(backend->memory_kind() == MemoryKind::device);
  CHECK(backend->name() == "cuda:0");
  CHECK(backend->device_index() == 0);
  CHECK(backend->comm_stream() != nullptr);
  CHECK(backend->compute_stream() == nullptr);
  CHECK(backend->allocate(0) == nullptr);

  // An impossible allocation names the request and the device's memory.
  try {
    backend->allocate(std::size_t{1} << 50);
    FAIL("allocating 1 PiB did not throw");
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    CHECK(what.find("1125899906842624 bytes") != std::string::npos);
    CHECK(what.find("free of") != std::string::npos);
  }

  const std::size_t count = 1 << 20;
  void* a = backend->allocate(count * 4);
  void* b = backend->allocate(count * 4);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
  backend->copy_from_host(a, host.data(), count * 4);

  // compute: fill b with zeros; comm waits for that, then copies a -> b.
  backend->fill_zero(b, count * 4, backend->compute_stream());
  Event filled = backend->record_event(backend->compute_stream());
  backend->stream_wait(backend->comm_stream(), filled);
  backend->copy(b, a, count * 4, backend->comm_stream());
  Event copied = backend->record_event(backend->comm_stream());
  backend->stream_wait(backend->compute_stream(), copied);
  backend->accumulate(b, a, DType::fp32, count, backend->compute_stream());
  backend->synchronize(backend->compute_stream());
  backend->release_event(filled);
  backend->release_event(copied);
  std::vector<float> out(count);
  backend->copy_to_host(out.data(), b, count * 4);
  bool doubled = true;
  for (std::size_t i = 0; i < count; ++i) doubled = doubled && out[i] == 2.0f * host[i];
  CHECK(doubled);

  // convert through the backend: fp32 -> bf16 -> fp32 keeps bf16-exact values.
  backend->convert(a, DType::fp32, b, DType::bf16, count, backend->comm_stream());
  backend->convert(b, DType::bf16, a, DType::fp32, count, backend->comm_stream());
  backend->synchronize(backend->comm_stream());
  backend->copy_to_host(out.data(), a, count * 4);
  bool rounded = true;
  for (std::size_t i = 0; i < count; ++i) rounded = rounded && out[i] == round_to(DType::bf16, host[i]);
  CHECK(rounded);
  backend->deallocate(a, count * 4);
  backend->deallocate(b, count * 4);
  backend->deallocate(nullptr, 0);
}

TEST_CASE("backend: optimizer_step is the fused kernel on the given stream") {
  auto backend = make_cuda_backend(0);
  OptimizerOptions adamw;
  const StepScalars s = make_step_scalars(adamw, 2, adamw.lr, 1.0);
  const std::size_t n = 12345;
  std::mt19937_64 rng(fresh_seed());
  HostArray p = random_array(rng, DType::fp32, n, -1, 1), g = random_array(rng, DType::bf16, n, -1, 1);
  auto* d = static_cast<float*>(backend->allocate(n * 4 * 3 + n * 2));
  backend->copy_from_host(d, p.data(), n * 4);
  backend->fill_zero(d + n, n * 8, backend->comm_stream());
  backend->copy_from_host(d + 3 * n, g.data(), n * 2);
  ShardUpdate u{d, d + 3 * n, DType::bf16, d + n, d + 2 * n, nullptr, DType::bf16, n};
  backend->optimizer_step(adamw, s, u, backend->comm_stream());
  backend->synchronize(backend->comm_stream());
  std::vector<float> out(n);
  backend->copy_to_host(out.data(), d, n * 4);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float pp = p.get(i), m = 0, v = 0;
    adamw_element(pp, m, v, g.get(i), s);
    wrong += out[i] != pp;
  }
  CHECK(wrong == 0);
  backend->deallocate(d, 0);
}

namespace {

struct SpanData {
  std::size_t offset;  // elements into the shared buffer
  std::size_t count;
};

GradStats run_stats(Backend& backend, DType dtype, const HostArray& values,
                    const std::vector<SpanData>& spans) {
  void* d = backend.allocate(values.bytes.size() + 64);
  backend.copy_from_host(d, values.bytes.data(), values.bytes.size());
  std::vector<Backend::Span> table;
  for (const SpanData& s : spans)
    table.push_back({static_cast<unsigned char*>(d) + s.offset * size_of(dtype), s.count});
  const GradStats stats = backend.grad_stats(table.data(), table.size(), dtype, backend.comm_stream());
  backend.deallocate(d, 0);
  return stats;
}

double reference_squares(const HostArray& values, const std::vector<SpanData>& spans) {
  double total = 0;
  for (const SpanData& s : spans)
    for (std::size_t i = 0; i < s.count; ++i) {
      const double x = values.get(s.offset + i);
      total += x * x;
    }
  return total;
}

}  // namespace

TEST_CASE("backend: grad_stats matches float64 over several spans") {
  auto backend = make_cuda_backend(0);
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (DType dtype : kAllDTypes) {
    const std::size_t total = 3000017;
    HostArray values = random_array(rng, dtype, total, -3.0f, 3.0f);
    const std::vector<SpanData> spans = {{0, 0},       {1, 1},     {3, 7},         {17, 1000003},
                                         {1000021, 8}, {1000030, 33}, {1000065, 1999000}};
    const GradStats stats = run_stats(*backend, dtype, values, spans);
    const double ref = reference_squares(values, spans);
    INFO("dtype ", std::string(name_of(dtype)), ", seed ", seed);
    CHECK(!stats.nonfinite);
    CHECK(std::abs(stats.sum_squares - ref) <= 1e-6 * ref);
    // The same spans give the same bits (fixed reduction order).
    CHECK(run_stats(*backend, dtype, values, spans).sum_squares == stats.sum_squares);

    // No spans, empty spans.
    CHECK(backend->grad_stats(nullptr, 0, dtype, nullptr).sum_squares == 0.0);
    CHECK(run_stats(*backend, dtype, values, {{5, 0}}).sum_squares == 0.0);

    // A NaN or an infinity anywhere sets the flag, in the vector body and the tail.
    for (std::size_t where : {std::size_t{20}, std::size_t{1000003 + 16}, std::size_t{4}}) {
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        HostArray poisoned = values;
        poisoned.set(where, bad);
        CHECK(run_stats(*backend, dtype, poisoned, spans).nonfinite);
      }
    }
  }
}

TEST_CASE("backend: grad_stats keeps large finite values finite") {
  auto backend = make_cuda_backend(0);
  HostArray values(DType::fp32, 1024);
  for (std::size_t i = 0; i < 1024; ++i) values.set(i, (i % 2 ? 1 : -1) * 3e20f);
  const GradStats stats = run_stats(*backend, DType::fp32, values, {{0, 1024}, {1, 1000}});
  CHECK(!stats.nonfinite);
  const double ref = reference_squares(values, {{0, 1024}, {1, 1000}});
  CHECK(std::abs(stats.sum_squares - ref) <= 1e-6 * ref);
}

TEST_CASE("backend: grad_stats over more spans than one launch takes") {
  auto backend = make_cuda_backend(0);
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const std::size_t span_count = 70001;
  HostArray values = random_array(rng, DType::bf16, span_count * 4, -1.0f, 1.0f);
  std::vector<SpanData> spans;
  for (std::size_t s = 0; s < span_count; ++s) spans.push_back({s * 4, 1 + s % 4});
  const GradStats stats = run_stats(*backend, DType::bf16, values, spans);
  const double ref = reference_squares(values, spans);
  INFO("seed ", seed);
  CHECK(!stats.nonfinite);
  CHECK(std::abs(stats.sum_squares - ref) <= 1e-9 * ref);
}

}  // namespace zero::test
