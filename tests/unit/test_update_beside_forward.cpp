// Stage 0's update beside the next forward: step() queues the update bucket
// by bucket on the comm stream and returns without making the compute
// stream wait for it; a unit's first use waits for its own bucket's event
// only (in a CUDA graph capture, as a wait the replays keep). The values are
// those of stage 1 (one update per bucket slice on the compute stream).
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "zero/comm/simulated_communicator.hpp"
#include "zero/engine/backend.hpp"
#include "zero/engine/engine.hpp"

namespace {

using zero::Event;
using zero::Stream;

const Stream kCompute = reinterpret_cast<Stream>(std::uintptr_t{0x1});
const Stream kComm = reinterpret_cast<Stream>(std::uintptr_t{0x2});

/// What the engine asked of the streams, in order.
struct Call {
  enum Kind { update, ema, zero_fill, record_at, wait, wait_external } kind;
  Stream stream;             // where it ran (waits: the waiting stream)
  Event event = nullptr;     // record_at, waits
  const void* data = nullptr;  // update: the master's first element; zero_fill: the first byte
};

/// The host backend's data operations (real values) with two named streams
/// and event calls logged. Temporary events (order_after) are numbered from
/// 0x100000, persistent ones (create_event) from 0x1000.
class StreamLogBackend final : public zero::Backend {
 public:
  std::vector<Call> calls;
  std::vector<Event> persistent;
  std::vector<std::pair<Event, Stream>> temporary;  // record_event: the stream it was recorded on

  zero::MemoryKind memory_kind() const override { return zero::MemoryKind::host; }
  std::string name() const override { return "stream-log"; }
  void* allocate(std::size_t bytes) override { return host_->allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) override { host_->deallocate(p, bytes); }
  void* allocate_host(std::size_t bytes) override { return host_->allocate_host(bytes); }
  void deallocate_host(void* p, std::size_t bytes) override { host_->deallocate_host(p, bytes); }
  Stream compute_stream() const override { return kCompute; }
  Stream comm_stream() const override { return kComm; }
  Event record_event(Stream stream) override {
    Event e = reinterpret_cast<Event>(std::uintptr_t{0x100000} + temporary.size());
    temporary.emplace_back(e, stream);
    return e;
  }
  void stream_wait(Stream waiter, Event event) override { calls.push_back({Call::wait, waiter, event}); }
  void release_event(Event) override {}
  Event create_event() override {
    persistent.push_back(reinterpret_cast<Event>(std::uintptr_t{0x1000} + persistent.size()));
    return persistent.back();
  }
  void record_event_at(Event event, Stream stream) override { calls.push_back({Call::record_at, stream, event}); }
  void stream_wait_external(Stream waiter, Event event) override {
    calls.push_back({Call::wait_external, waiter, event});
  }
  void synchronize(Stream) override {}
  void wait_event(Event) override {}
  void fill_zero(void* data, std::size_t bytes, Stream stream) override {
    calls.push_back({Call::zero_fill, stream, nullptr, data});
    host_->fill_zero(data, bytes, nullptr);
  }
  void copy(void* d, const void* s, std::size_t bytes, Stream) override { host_->copy(d, s, bytes, nullptr); }
  void copy_to_host(void* d, const void* s, std::size_t bytes) override { host_->copy_to_host(d, s, bytes); }
  void copy_from_host(void* d, const void* s, std::size_t bytes) override { host_->copy_from_host(d, s, bytes); }
  void convert(const void* s, zero::DType sd, void* d, zero::DType dd, std::size_t n, Stream) override {
    host_->convert(s, sd, d, dd, n, nullptr);
  }
  void accumulate(void* d, const void* s, zero::DType t, std::size_t n, Stream) override {
    host_->accumulate(d, s, t, n, nullptr);
  }
  void ema_update(float* ema, const float* w, std::size_t n, double decay, Stream stream) override {
    calls.push_back({Call::ema, stream, nullptr, ema});
    host_->ema_update(ema, w, n, decay, nullptr);
  }
  void optimizer_step(const zero::OptimizerOptions& o, const zero::StepScalars& s, const zero::ShardUpdate& u,
                      Stream stream) override {
    calls.push_back({Call::update, stream, nullptr, u.master});
    host_->optimizer_step(o, s, u, nullptr);
  }
  zero::GradStats grad_stats(const Span* spans, std::size_t n, zero::DType t, Stream) override {
    return host_->grad_stats(spans, n, t, nullptr);
  }
  /// The stream an order_after's temporary event was recorded on (null: not one of them).
  Stream recorded_on(Event e) const {
    for (const auto& [event, stream] : temporary)
      if (event == e) return stream;
    return nullptr;
  }

 private:
  std::unique_ptr<zero::Backend> host_ = zero::make_host_backend();
};

constexpr std::size_t kUnits = 4;

std::vector<std::vector<zero::ParamSpec>> units_of_sizes() {
  std::vector<std::vector<zero::ParamSpec>> units;
  for (std::size_t u = 0; u < kUnits; ++u)
    units.push_back({{"unit" + std::to_string(u) + ".weight", 700 + 130 * u, {}},
                     {"unit" + std::to_string(u) + ".bias", 17 + u, {}}});
  return units;
}

zero::EngineOptions options_at(int stage) {
  zero::EngineOptions options;
  options.stage = stage;
  options.param_dtype = zero::DType::bf16;  // fp32 master + bf16 parameters
  options.grad_dtype = zero::DType::fp32;
  options.ema.decay = 0.9;
  options.ema.warmup = false;
  return options;
}

/// One micro-step of fresh random gradients (the same for the same seed).
void backward(zero::Engine& engine, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  for (std::size_t p = 0; p < engine.params().size(); ++p) {
    auto* g = static_cast<float*>(engine.grad_data(p));
    for (std::size_t i = 0; i < engine.params()[p].numel; ++i) g[i] = normal(rng);
    engine.grad_ready(p);
  }
  engine.finish_micro_step();
}

std::vector<std::uint16_t> parameters(zero::Engine& engine) {
  std::vector<std::uint16_t> out;
  for (std::size_t p = 0; p < engine.params().size(); ++p) {
    const auto* v = static_cast<const std::uint16_t*>(engine.param_data(p));
    out.insert(out.end(), v, v + engine.params()[p].numel);
  }
  return out;
}

}  // namespace

TEST_CASE("stage 0 update beside the next forward: per bucket on the comm stream, waited for per unit") {
  zero::SimulatedCommunicator comm(1, 0, zero::MemoryKind::host);
  StreamLogBackend backend;
  zero::Engine engine(units_of_sizes(), options_at(0), comm, backend);
  REQUIRE(backend.persistent.size() == kUnits);  // one event per bucket
  backward(engine, 7);
  backend.calls.clear();
  const zero::StepResult result = engine.step();
  REQUIRE(result.applied);

  // Every update, EMA and gradient zeroing of the step on the comm stream,
  // bucket by bucket: bucket b's event recorded after its own work and
  // before the next bucket's.
  std::size_t bucket = 0;
  bool work_since_record = false;
  for (const Call& c : backend.calls) {
    if (c.kind == Call::update || c.kind == Call::ema || c.kind == Call::zero_fill) {
      CHECK(c.stream == kComm);
      work_since_record = true;
    }
    if (c.kind == Call::record_at) {
      REQUIRE(bucket < kUnits);
      CHECK(c.event == backend.persistent[bucket]);
      CHECK(c.stream == kComm);
      CHECK(work_since_record);
      work_since_record = false;
      ++bucket;
    }
  }
  CHECK(bucket == kUnits);
  // The compute stream does not wait for the comm stream after the update
  // (that would serialize the next forward behind all of it).
  bool compute_waits_for_comm = false;
  bool after_update = false;
  for (const Call& c : backend.calls) {
    if (c.kind == Call::update) after_update = true;
    if (after_update && (c.kind == Call::wait || c.kind == Call::wait_external) && c.stream == kCompute)
      compute_waits_for_comm = true;
  }
  CHECK_FALSE(compute_waits_for_comm);

  // The next forward: entering unit 2 waits for bucket 2's update only,
  // once; unit 0 then for bucket 0's.
  backend.calls.clear();
  engine.enter_unit(2, zero::Pass::forward);
  REQUIRE(backend.calls.size() == 1);
  CHECK(backend.calls[0].kind == Call::wait_external);
  CHECK(backend.calls[0].stream == kCompute);
  CHECK(backend.calls[0].event == backend.persistent[2]);
  engine.enter_unit(2, zero::Pass::backward);
  CHECK(backend.calls.size() == 1);
  engine.enter_unit(0, zero::Pass::forward);
  REQUIRE(backend.calls.size() == 2);
  CHECK(backend.calls[1].event == backend.persistent[0]);
  // Reading a parameter waits for its bucket too (unit 3's, not yet waited for).
  backend.calls.clear();
  (void)engine.param_data(engine.unit_params(3).front());
  REQUIRE(backend.calls.size() == 1);
  CHECK(backend.calls[0].event == backend.persistent[3]);
  // The gradients are zero for the next step (the update zeroed them).
  for (std::size_t p = 0; p < engine.params().size(); ++p) {
    const auto* g = static_cast<const float*>(engine.grad_data(p));
    for (std::size_t i = 0; i < engine.params()[p].numel; ++i) REQUIRE(g[i] == 0.0f);
  }
}

TEST_CASE("stage 0 update beside the next forward: the values of stage 1, a skipped step zeroes the gradients") {
  zero::SimulatedCommunicator comm0(1, 0, zero::MemoryKind::host), comm1(1, 0, zero::MemoryKind::host);
  StreamLogBackend backend0, backend1;
  zero::Engine stage0(units_of_sizes(), options_at(0), comm0, backend0);
  zero::Engine stage1(units_of_sizes(), options_at(1), comm1, backend1);
  const std::vector<std::uint16_t> initial = parameters(stage0);
  for (std::uint32_t step = 1; step <= 3; ++step) {
    backward(stage0, 100 + step);
    backward(stage1, 100 + step);
    CHECK(stage0.step().applied);
    CHECK(stage1.step().applied);
    CHECK(parameters(stage0) == parameters(stage1));
  }
  CHECK(parameters(stage0) != initial);
  // One more step, then a non-finite gradient: skipped, nothing updated,
  // the gradients zeroed by reset_gradients (on the compute stream) instead.
  backward(stage0, 200);
  CHECK(stage0.step().applied);
  const std::vector<std::uint16_t> kept = parameters(stage0);
  backward(stage0, 300, std::numeric_limits<float>::infinity());
  backend0.calls.clear();
  const zero::StepResult skipped = stage0.step();
  CHECK_FALSE(skipped.applied);
  bool zeroed_on_compute = false;
  for (const Call& c : backend0.calls) {
    CHECK(c.kind != Call::update);
    CHECK(c.kind != Call::record_at);
    if (c.kind == Call::zero_fill && c.stream == kCompute) zeroed_on_compute = true;
  }
  CHECK(zeroed_on_compute);
  CHECK(parameters(stage0) == kept);
  for (std::size_t p = 0; p < stage0.params().size(); ++p) {
    const auto* g = static_cast<const float*>(stage0.grad_data(p));
    for (std::size_t i = 0; i < stage0.params()[p].numel; ++i) REQUIRE(g[i] == 0.0f);
  }
}
