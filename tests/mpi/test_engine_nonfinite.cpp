// Non-finite gradients: a NaN in one element of one rank's gradient skips the
// step on every rank (the NaN lands in one rank's shard; the others learn of
// it only through the agreed check), leaves the master weights, optimizer
// state, EMA and model weights bitwise as they were, is counted, and the
// max_consecutive_nonfinite-th skipped step in a row throws.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "engine_steps.hpp"
#include "zero/engine/engine.hpp"

using namespace zero;

namespace {

std::vector<std::vector<ParamSpec>> units() {
  return {{{"a", 1000, {}}, {"b", 37, {}}}, {{"c", 4099, {}}}, {{"d", 3, {}}, {"e", 517, {}}}};
}

EngineOptions options(int stage, DType dtype, int max_consecutive_nonfinite) {
  EngineOptions o;
  o.stage = stage;
  o.param_dtype = dtype;
  o.buckets.alignment_elements = 8;
  o.optimizer.lr = 1e-2;
  o.ema.decay = 0.9;
  o.max_grad_norm = 1.0;
  o.max_consecutive_nonfinite = max_consecutive_nonfinite;
  return o;
}

void init(Engine& engine) { testing::init_random_params(engine); }

// One step with gradients that depend on (step, rank). poison_rank >= 0: that
// rank writes a NaN into element 0 of parameter "a", which the reduce-scatter
// hands to rank 0's shard only (the bucket's first slice).
StepResult train_step(Engine& engine, int step, int rank, int poison_rank) {
  return testing::run_step(engine, step, rank, testing::StepGradient::noise, poison_rank);
}

struct Snapshot {
  std::vector<std::vector<float>> master, model, ema, state0, state1;
};

Snapshot snapshot(Engine& engine) {
  return {engine.gather_master_params(), engine.gather_model_params(), engine.gather_ema_params(),
          engine.gather_optimizer_state(0), engine.gather_optimizer_state(1)};
}

using testing::bitwise_equal;

bool same(const Snapshot& a, const Snapshot& b) {
  return bitwise_equal(a.master, b.master) && bitwise_equal(a.model, b.model) && bitwise_equal(a.ema, b.ema) &&
         bitwise_equal(a.state0, b.state0) && bitwise_equal(a.state1, b.state1);
}

}  // namespace

TEST_CASE("non-finite gradients on one rank skip the step everywhere and leave the weights untouched") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  const int poison_rank = comm.size() - 1;  // with N >= 2 not the rank whose shard receives the NaN
  for (DType dtype : {DType::fp32, DType::bf16}) {
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(dtype);
      CAPTURE(stage);
      constexpr int kLimit = 3;
      Engine engine(units(), options(stage, dtype, kLimit), comm, *backend);
      init(engine);
      int step = 0;
      for (; step < 2; ++step) REQUIRE(train_step(engine, step, comm.rank(), -1).applied);

      // kLimit - 1 poisoned steps in a row: skipped, counted, nothing moves.
      const Snapshot before = snapshot(engine);
      for (int k = 1; k < kLimit; ++k, ++step) {
        const StepResult r = train_step(engine, step, comm.rank(), poison_rank);
        CHECK_FALSE(r.applied);
        CHECK(r.step == 2);
        CHECK(engine.steps_skipped() == k);
        CHECK(same(snapshot(engine), before));
      }
      // A finite step applies and resets the count.
      REQUIRE(train_step(engine, step++, comm.rank(), -1).applied);
      CHECK(engine.steps_applied() == 3);
      const Snapshot after = snapshot(engine);
      CHECK_FALSE(bitwise_equal(after.master, before.master));
      for (const auto& tensor : after.master)
        for (float x : tensor) REQUIRE(std::isfinite(x));

      // kLimit in a row: the first kLimit - 1 are skipped, the kLimit-th throws
      // on every rank, and still nothing moved.
      for (int k = 1; k < kLimit; ++k) CHECK_FALSE(train_step(engine, step++, comm.rank(), poison_rank).applied);
      CHECK_THROWS_WITH_AS(train_step(engine, step++, comm.rank(), poison_rank),
                           doctest::Contains("3 steps in a row had non-finite gradients (limit 3)"), Error);
      CHECK(engine.steps_skipped() == 2 * (kLimit - 1) + 1);
      CHECK(same(snapshot(engine), after));
    }
  }
}

TEST_CASE("max_consecutive_nonfinite = 0 skips non-finite steps without ever stopping") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  Engine engine(units(), options(2, DType::fp32, 0), comm, *backend);
  init(engine);
  REQUIRE(train_step(engine, 0, comm.rank(), -1).applied);
  const Snapshot before = snapshot(engine);
  for (int step = 1; step <= 25; ++step) CHECK_FALSE(train_step(engine, step, comm.rank(), comm.size() - 1).applied);
  CHECK(engine.steps_skipped() == 25);
  CHECK(same(snapshot(engine), before));
  CHECK(train_step(engine, 26, comm.rank(), -1).applied);
}
