// Per-rank memory by category equals the ZeRO model-state formula; bad input
// gives clear errors on every rank (no hang, no crash); fp16 overflow skips.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <vector>

#include "zero/comm/mpi_communicator.hpp"
#include "zero/engine/engine.hpp"
#include "zero/engine/model_steps.hpp"
#include "zero/engine/planner.hpp"

using namespace zero;

namespace {

// A model the size of a few transformer layers, with awkward (prime) sizes.
std::vector<std::vector<ParamSpec>> awkward_units() {
  std::vector<std::vector<ParamSpec>> units;
  const std::size_t sizes[] = {1, 4099, 65537, 3, 131071, 17, 8191, 0, 524287};
  for (int u = 0; u < 3; ++u) {
    std::vector<ParamSpec> unit;
    for (int i = 0; i < 3; ++i) unit.push_back({"u" + std::to_string(u) + ".p" + std::to_string(i), sizes[u * 3 + i], {}});
    units.push_back(unit);
  }
  return units;
}

// One optimizer step: accumulation_steps micro-steps, then step().
void run_one_step(Engine& engine) {
  for (int micro = 0; micro < engine.options().accumulation_steps; ++micro) {
    for (std::size_t u = 0; u < engine.unit_count(); ++u) engine.gather_unit(u);
    for (std::size_t p = 0; p < engine.param_count(); ++p) {
      void* g = engine.grad_data(p);
      for (std::size_t k = 0; k < engine.params()[p].numel; ++k)
        store_from_float(g, k, engine.options().effective_grad_dtype(), 1e-3f * static_cast<float>(k % 7));
      engine.grad_ready(p);
    }
    for (std::size_t u = 0; u < engine.unit_count(); ++u) engine.release_unit(u);
    engine.finish_micro_step();
  }
  engine.step();
}

}  // namespace

TEST_CASE("per-rank memory equals the ZeRO formula at every stage") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  const std::size_t n = static_cast<std::size_t>(comm.size());
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType dtype : {DType::bf16, DType::fp32}) {
      for (int accumulation : {1, 4}) {
        for (GradAccumulation mode : {GradAccumulation::reduce_each_micro_step, GradAccumulation::reduce_at_boundary}) {
          CAPTURE(stage);
          CAPTURE(dtype);
          CAPTURE(accumulation);
          CAPTURE(static_cast<int>(mode));
          EngineOptions o;
          o.stage = stage;
          o.param_dtype = dtype;
          o.accumulation_steps = accumulation;
          o.accumulation = mode;
          Engine engine(awkward_units(), o, comm, *backend);
          const std::size_t psi = engine.layout().param_numel();
          const std::size_t padded = engine.layout().padded_numel();
          // Stated padding: at most one aligned slot per rank per parameter and bucket.
          CHECK(padded - psi <= (engine.layout().params().size() + engine.unit_count()) * n * o.buckets.alignment_elements);
          const MemoryByCategory m = engine.memory();
          const MemoryByCategory f = engine.predicted_model_state();
          CHECK(m.params == f.params);
          CHECK(m.grads == f.grads);
          CHECK(m.master == f.master);
          CHECK(m.optimizer_state == f.optimizer_state);
          CHECK(m.buffers == 0);  // nothing transient before the first step
          const std::size_t p = size_of(dtype);
          // One rank, one micro-step: the reduce-scatter is the identity and
          // stages 2-3 write the full buffer, as stage 1 does (StagePlan).
          const bool identity = n == 1 && accumulation == 1;
          const bool full_grads =
              stage <= 1 || identity || (mode == GradAccumulation::reduce_at_boundary && accumulation > 1);
          const bool shard_grads =
              (stage >= 2 && !identity) || (mode == GradAccumulation::reduce_each_micro_step && accumulation > 1);
          CHECK(m.params == (stage == 3 ? padded / n : padded) * p);
          CHECK(m.grads == (full_grads ? padded * p : 0) + (shard_grads ? padded / n * p : 0));
          CHECK(m.master == (dtype == DType::fp32 ? 0 : (stage == 0 ? padded : padded / n) * 4));
          CHECK(m.optimizer_state == (stage == 0 ? padded : padded / n) * 8);
          if (stage == 3 && dtype == DType::bf16 && accumulation == 1)
            CHECK(m.model_state() == (2 + 2 + 12) * padded / n);  // the ZeRO paper's stage-3 figure
          // After a step: transient buffers are released to the cache, model
          // state unchanged; stage 3 holds no gathered unit.
          run_one_step(engine);
          const MemoryByCategory after = engine.memory();
          CHECK(after.model_state() == m.model_state());
          if (stage == 3) {
            // While gathered, all units' full parameters were counted as params
            // (one rank uses them where they lie in the shard: no more), each
            // at its block's capacity: the largest unit's size where that is
            // at most twice its own (BufferPool: one block serves most units).
            std::size_t largest = 0, all_units = 0;
            for (const Bucket& b : engine.layout().buckets()) largest = std::max(largest, b.padded * p);
            for (const Bucket& b : engine.layout().buckets())
              all_units += largest <= 2 * b.padded * p ? largest : b.padded * p;
            CHECK(engine.peak_memory().params == padded / n * p + (n == 1 ? 0 : all_units));
          }
        }
      }
    }
  }
}

TEST_CASE("offloaded optimizer: the state moves to host memory, by the formula") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  const std::size_t n = static_cast<std::size_t>(comm.size());
  struct Case {
    int stage;
    bool offload_params;
    int accumulation_steps;
  };
  for (const Case k : {Case{1, false, 1}, Case{2, false, 1}, Case{3, false, 1}, Case{3, true, 1}, Case{2, false, 2},
                       Case{3, true, 2}}) {
    for (DType dtype : {DType::bf16, DType::fp32}) {
      CAPTURE(k.stage);
      CAPTURE(k.offload_params);
      CAPTURE(k.accumulation_steps);
      CAPTURE(dtype);
      EngineOptions o;
      o.stage = k.stage;
      o.param_dtype = dtype;
      o.ema.decay = 0.99;
      o.offload.optimizer = true;
      o.offload.params = k.offload_params;
      o.accumulation_steps = k.accumulation_steps;
      Engine engine(awkward_units(), o, comm, *backend);
      const std::size_t padded = engine.layout().padded_numel(), p = size_of(dtype), shard = padded / n;
      const MemoryByCategory device = engine.memory(), host = engine.host_memory();
      CHECK(device.master == 0);
      CHECK(device.optimizer_state == 0);
      CHECK(device.ema == 0);
      CHECK(device.params == engine.predicted_model_state().params);
      CHECK(device.grads == engine.predicted_model_state().grads);
      // One micro-step: gradients stream down as they are reduced, so stages
      // 2-3 keep no gradient shard on the device.
      if (k.stage >= 2 && k.accumulation_steps == 1) CHECK(device.grads == 0);
      if (k.stage >= 2 && k.accumulation_steps > 1) CHECK(device.grads == shard * p);
      CHECK(device.params == (k.offload_params ? 0 : (k.stage == 3 ? shard : padded) * p));
      CHECK(host.params == (k.offload_params ? shard * p : 0));
      CHECK(host.master == shard * 4);  // kept even for fp32 parameters
      CHECK(host.optimizer_state == shard * 8);
      CHECK(host.ema == shard * 4);
      // Gradient shard down, model shard up (offloaded parameters are updated in place).
      CHECK(host.buffers == shard * (k.offload_params ? 1 : 2) * p);
      const MemoryByCategory predicted = engine.predicted_host_state();
      CHECK(host.params == predicted.params);
      CHECK(host.master == predicted.master);
      CHECK(host.optimizer_state == predicted.optimizer_state);
      CHECK(host.ema == predicted.ema);
      CHECK(host.buffers == predicted.buffers);
      run_one_step(engine);
      CHECK(engine.host_memory().total() == host.total());
      if (k.stage >= 2) CHECK(engine.memory().buffers > 0);  // blocks kept for reuse
      // The same without the block cache: nothing transient outlives its use.
      o.buckets.cache_bytes = 0;
      Engine uncached(awkward_units(), o, comm, *backend);
      run_one_step(uncached);
      CHECK(uncached.memory().buffers == 0);
      CHECK(uncached.peak_memory().buffers <= engine.peak_memory().buffers);
      CHECK(engine.memory().model_state() == device.model_state());
    }
  }
}

TEST_CASE("ranks that disagree on the model get a clear error on every rank") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  auto units = awkward_units();
  if (comm.rank() == comm.size() - 1) units[0].push_back({"extra", 10, {}});
  if (comm.size() > 1) {
    CHECK_THROWS_WITH_AS(Engine(units, EngineOptions{}, comm, *backend), doctest::Contains("ranks disagree on the model"),
                         InvalidArgument);
  }
}

TEST_CASE("misuse of the engine API is a clear error") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  EngineOptions o;
  o.stage = 3;
  Engine engine(awkward_units(), o, comm, *backend);
  CHECK_THROWS_WITH_AS(engine.param_data(0), doctest::Contains("is not gathered"), InvalidArgument);
  CHECK_THROWS_WITH_AS(engine.param_data(99), doctest::Contains("parameter index 99 of 9"), InvalidArgument);
  CHECK_THROWS_WITH_AS(engine.release_unit(0), doctest::Contains("unit 0 is not gathered"), InvalidArgument);
  CHECK_THROWS_WITH_AS(engine.step(), doctest::Contains("step() after 0 micro-steps"), InvalidArgument);
  engine.grad_data(1);
  engine.grad_ready(1);
  CHECK_THROWS_WITH_AS(engine.grad_ready(1), doctest::Contains("called twice"), InvalidArgument);
  CHECK_THROWS_WITH_AS(engine.grad_data(1), doctest::Contains("already declared ready"), InvalidArgument);
  engine.finish_micro_step();
  CHECK_THROWS_WITH_AS(engine.grad_data(1), doctest::Contains("call step() first"), InvalidArgument);
  engine.step();
  EngineOptions bad;
  bad.stage = 5;
  CHECK_THROWS_WITH_AS(Engine(awkward_units(), bad, comm, *backend), doctest::Contains("stage must be 0, 1, 2 or 3"),
                       InvalidArgument);
}

TEST_CASE("fp16: an overflow on one rank skips the step everywhere and backs the loss scale off") {
  MpiCommunicator comm;
  auto backend = make_host_backend();
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    EngineOptions o;
    o.stage = stage;
    o.param_dtype = DType::fp16;
    o.loss_scaler = {.initial_scale = 1024, .hysteresis = 1};
    o.max_consecutive_nonfinite = 3;
    Engine engine(awkward_units(), o, comm, *backend);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    for (std::size_t p = 0; p < engine.param_count(); ++p) {
      std::vector<float> values(engine.params()[p].numel);
      for (float& x : values) x = normal(rng);
      engine.set_param(p, values.data());
    }
    const auto before = engine.gather_master_params();
    auto micro_step = [&](bool overflow) {
      for (std::size_t p = 0; p < engine.param_count(); ++p) {
        void* g = engine.grad_data(p);
        const std::size_t numel = engine.params()[p].numel;
        for (std::size_t k = 0; k < numel; ++k) store_from_float(g, k, DType::fp16, 0.5f);
        // The last rank's gradient overflows fp16 in one element.
        if (overflow && comm.rank() == comm.size() - 1 && numel > 0) store_from_float(g, numel - 1, DType::fp16, INFINITY);
        engine.grad_ready(p);
      }
      engine.finish_micro_step();
    };
    micro_step(true);
    StepResult r = engine.step();
    CHECK_FALSE(r.applied);
    CHECK(r.loss_scale == 512);
    CHECK(engine.steps_skipped() == 1);
    CHECK(engine.gather_master_params() == before);  // master weights untouched
    micro_step(false);
    r = engine.step();
    CHECK(r.applied);
    CHECK(r.step == 1);
    CHECK(engine.gather_master_params() != before);
    micro_step(true);
    engine.step();
    micro_step(true);
    engine.step();
    micro_step(true);
    CHECK_THROWS_WITH_AS(engine.step(), doctest::Contains("3 steps in a row had non-finite gradients"), Error);
  }
}

TEST_CASE("the planner's engine bytes are the engine's own accounting, byte for byte") {
  // The planner runs the real engine on a counting backend; here the engine
  // runs for real (host memory, MPI) and both must agree exactly: persistent
  // state by category, host staging, and the transient peak by kind.
  MpiCommunicator comm;
  auto backend = make_host_backend();
  struct Case {
    int stage;
    bool offload, offload_params, delayed;
    int accumulation;
    GradAccumulation mode;
    bool checkpointing;
    std::optional<std::size_t> cache;
    int prefetch = 1;  // buckets.prefetch_units
  };
  const auto each = GradAccumulation::reduce_each_micro_step, boundary = GradAccumulation::reduce_at_boundary;
  const Case cases[] = {
      {0, false, false, false, 1, each, false, {}},  {1, false, false, false, 1, each, false, {}},
      {2, false, false, false, 1, each, false, {}},  {3, false, false, false, 1, each, false, {}},
      {3, false, false, false, 1, each, true, {}},   {3, false, false, false, 1, each, false, 0},
      {2, false, false, false, 3, each, false, {}},  {2, false, false, false, 3, boundary, false, {}},
      {1, false, false, false, 2, each, false, {}},  {1, true, false, false, 1, each, false, {}},
      {2, true, false, false, 1, each, false, {}},   {2, true, false, true, 1, each, false, {}},
      {3, true, false, false, 2, each, true, {}},    {3, true, true, false, 1, each, true, {}},
      // The delayed update with several micro-steps and with offload_params
      // (a second host parameter shard).
      {2, true, false, true, 3, each, false, {}},    {1, true, false, true, 2, boundary, false, {}},
      {3, true, true, true, 1, each, true, {}},      {3, true, true, true, 2, each, false, {}},
      // Stage 3 without prefetch, and three units ahead.
      {3, false, false, false, 1, each, false, {}, 0}, {3, true, true, true, 1, each, true, {}, 3},
  };
  const auto units = awkward_units();
  for (const Case& k : cases) {
    CAPTURE(k.stage);
    CAPTURE(k.offload);
    CAPTURE(k.offload_params);
    CAPTURE(k.delayed);
    CAPTURE(k.accumulation);
    CAPTURE(k.checkpointing);
    CAPTURE(k.prefetch);
    EngineOptions o;
    o.stage = k.stage;
    o.accumulation_steps = k.accumulation;
    o.accumulation = k.mode;
    o.ema.decay = 0.9;
    o.offload = {.optimizer = k.offload, .params = k.offload_params, .delayed_update = k.delayed};
    o.buckets.cache_bytes = k.cache;
    o.buckets.alignment_elements = 64;
    o.buckets.prefetch_units = k.prefetch;

    plan::PlanInput in;
    for (std::size_t u = 0; u < units.size(); ++u) {
      plan::PlanUnit unit{"u" + std::to_string(u), {}, /*checkpointed=*/u != 0};  // the first, like an embedding, is not
      for (const ParamSpec& p : units[u]) unit.tensors.push_back(p.numel);
      in.units.push_back(unit);
    }
    in.world_size = comm.size();
    in.engine = o;
    in.activation_checkpointing = k.checkpointing;
    const plan::Plan predicted = plan::make_plan(in);

    Engine engine(units, o, comm, *backend);
    const MemoryByCategory persistent = engine.memory();
    const DType gdt = o.effective_grad_dtype();
    run_model_steps(engine, 2, [&](std::size_t p, void* g) {
      for (std::size_t k = 0; k < engine.params()[p].numel; ++k)
        store_from_float(g, k, gdt, 1e-3f * static_cast<float>((k + p) % 7));
    });
    const TransientMemory used = engine.transient_memory();

    CHECK(predicted.padded_numel == engine.layout().padded_numel());
    CHECK(predicted.model_state.params == persistent.params);
    CHECK(predicted.model_state.grads == persistent.grads);
    CHECK(predicted.model_state.master == persistent.master);
    CHECK(predicted.model_state.optimizer_state == persistent.optimizer_state);
    CHECK(predicted.model_state.ema == persistent.ema);
    CHECK(predicted.host_state.total() == engine.host_memory().total());
    CHECK(predicted.host_state.buffers == engine.host_memory().buffers);
    CHECK(predicted.engine.gathered_units == used.gathered_units_at_peak);
    CHECK(predicted.engine.bucket_buffers == used.bucket_buffers_at_peak);
    CHECK(predicted.engine.cached_blocks == used.cached_blocks_at_peak);
    CHECK(predicted.engine.at_step_end == used.now);
    // And the accounting is the memory model's formula.
    CHECK(predicted.model_state.model_state() == engine.predicted_model_state().model_state());
  }
}
