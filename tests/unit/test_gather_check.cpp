// Stage 3 on a device communicator: the host does not wait for a unit's
// gather when the unit is entered (the device orders its use after the
// gather), but checks every gather a bounded number of units later and all
// of them by the end of the micro-step, so that a failed peer is still
// noticed (the communicator's timeout) within the micro-step.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "zero/comm/simulated_communicator.hpp"
#include "zero/engine/counting_backend.hpp"
#include "zero/engine/engine.hpp"

namespace {

/// The gathers' waits, in order, by the index of the gather (0, 1, ...).
struct GatherLog {
  int issued = 0;
  std::vector<int> waited;
};

class LoggedWork final : public zero::Work {
 public:
  LoggedWork(GatherLog& log, int index) : log_(log), index_(index) {}
  ~LoggedWork() override {
    if (!done_) log_.waited.push_back(-1 - index_);  // destroyed unwaited: a miss the test reports
  }
  void wait() override {
    if (!done_) log_.waited.push_back(index_);
    done_ = true;
  }
  bool test() override { return done_; }
  void detach() override { done_ = true; }

 private:
  GatherLog& log_;
  int index_;
  bool done_ = false;
};

/// A simulated world whose all-gathers hand out logged works (device memory).
class LoggingCommunicator final : public zero::Communicator {
 public:
  LoggingCommunicator(int world, GatherLog& log) : inner_(world), log_(log) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int local_rank() const override { return inner_.local_rank(); }
  int local_size() const override { return inner_.local_size(); }
  zero::MemoryKind memory_kind() const override { return zero::MemoryKind::device; }
  std::string backend_name() const override { return "logging"; }
  zero::WorkPtr reduce_scatter(const void* s, void* r, std::size_t n, zero::DType d, zero::ReduceOp op,
                               zero::Stream st) override {
    return inner_.reduce_scatter(s, r, n, d, op, st);
  }
  zero::WorkPtr all_gather(const void* s, void* r, std::size_t n, zero::DType d, zero::Stream st) override {
    inner_.all_gather(s, r, n, d, st)->wait();
    return std::make_unique<LoggedWork>(log_, log_.issued++);
  }
  zero::WorkPtr all_reduce(void* b, std::size_t n, zero::DType d, zero::ReduceOp op, zero::Stream st) override {
    return inner_.all_reduce(b, n, d, op, st);
  }
  zero::WorkPtr broadcast(void* b, std::size_t n, zero::DType d, int root, zero::Stream st) override {
    return inner_.broadcast(b, n, d, root, st);
  }
  void barrier() override {}
  void all_reduce_host_f64(double* v, std::size_t n, zero::ReduceOp op) override { inner_.all_reduce_host_f64(v, n, op); }

 private:
  zero::SimulatedCommunicator inner_;
  GatherLog& log_;
};

}  // namespace

TEST_CASE("stage 3 on a device communicator: gathers checked two units behind, all by the micro-step's end") {
  constexpr std::size_t kUnits = 6;
  std::vector<std::vector<zero::ParamSpec>> units;
  for (std::size_t u = 0; u < kUnits; ++u) units.push_back({{"unit" + std::to_string(u), 1000 + 100 * u, {}}});
  zero::EngineOptions options;
  options.stage = 3;
  GatherLog log;
  LoggingCommunicator comm(4, log);  // rank 0 of 4: every unit is gathered
  zero::CountingBackend backend;
  zero::Engine engine(units, options, comm, backend);
  REQUIRE(engine.plan().gathers_units);
  // Forward: unit u's gather (index u) is issued when unit u-1 is entered
  // (prefetch) or, for unit 0, when unit 0 is.
  for (std::size_t u = 0; u < kUnits; ++u) {
    engine.enter_unit(u, zero::Pass::forward);
    // Entered units: 0..u. Their gathers checked: all but the last two.
    std::vector<int> expected;
    for (int g = 0; g + 2 <= static_cast<int>(u); ++g) expected.push_back(g);
    CHECK(log.waited == expected);
    engine.release_unit(u);
  }
  for (std::size_t u = kUnits; u-- > 0;) {
    engine.enter_unit(u, zero::Pass::backward);
    for (std::size_t p : engine.unit_params(u)) {
      engine.grad_data(p);
      engine.grad_ready(p);
    }
    engine.release_unit(u);
  }
  const int issued = log.issued;
  CHECK(static_cast<std::size_t>(issued) >= 2 * kUnits - 1);  // forward's and backward's gathers
  CHECK(log.waited.size() < static_cast<std::size_t>(issued));  // some are still unchecked here
  engine.finish_micro_step();
  // By the end of the micro-step every gather was waited for, once, in issue order.
  std::vector<int> all;
  for (int g = 0; g < issued; ++g) all.push_back(g);
  CHECK(log.waited == all);
  engine.step();
}
