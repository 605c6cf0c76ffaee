// The delayed update's check, shared by the CPU (tests/mpi) and GPU
// (tests/gpu_engine) engine tests.
#pragma once

#include <doctest/doctest.h>

#include <vector>

#include "engine_steps.hpp"
#include "mlp_training.hpp"

namespace zero::testing {

// The delayed update (ZeRO-Offload's DPU) changes one thing: the forward and
// backward of step k see the parameters before update k-1 (the update runs
// on the CPU meanwhile). So it must equal, bit for bit, a synchronous
// offloaded engine whose step-k gradients are computed from its own weights
// one update older, once the warm-up steps (synchronous) are over. The
// gradients depend on the weights (pull_to_half) and clipping is on, so a
// wrong lag, a lost update or a stale statistic shows in master, state, EMA,
// norms and the parameters each step sees.
inline void check_delayed_update(Communicator& comm, Backend& backend) {
  constexpr int kDelayedSteps = 7;
  for (DType dtype : {DType::fp32, DType::bf16})
    for (int stage = 1; stage <= 3; ++stage)
      for (int warmup : {0, 2}) {
        CAPTURE(dtype);
        CAPTURE(stage);
        CAPTURE(warmup);
        EngineOptions o;
        o.stage = stage;
        o.param_dtype = dtype;
        o.buckets.alignment_elements = 4;
        o.optimizer.kind = OptimizerKind::adamw;
        o.optimizer.lr = 0.05;
        o.optimizer.weight_decay = 0.01;
        o.max_grad_norm = 1.0;
        o.ema.decay = 0.9;
        o.offload.optimizer = true;
        Engine sync(mlp_units(), o, comm, backend);
        o.offload.delayed_update = true;
        o.offload.delayed_update_warmup_steps = warmup;
        Engine delayed(mlp_units(), o, comm, backend);
        init_random_params(sync);
        init_random_params(delayed);
        std::vector<std::vector<std::vector<float>>> seen = {read_model_params(sync, &backend)};  // after 0, 1, ... updates
        for (int k = 1; k <= kDelayedSteps; ++k) {
          CAPTURE(k);
          // Update k-1 is up before step k when it was synchronous (a warm-up step).
          const auto& expected = (k - 1 <= warmup) ? seen[k - 1] : seen[k - 2];
          const auto weights = read_model_params(delayed, &backend);
          CHECK(bitwise_equal(weights, expected));
          const StepResult want = run_step_from(sync, expected, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
          const StepResult got = run_step_from(delayed, weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
          CHECK(got.applied);
          CHECK(got.grad_norm == want.grad_norm);
          CHECK(got.clip_coefficient == want.clip_coefficient);
          CHECK(got.clip_coefficient < 1);  // clipping is exercised
          seen.push_back(read_model_params(sync, &backend));
        }
        // Reading the state completes the pending update and uploads it.
        CHECK(bitwise_equal(delayed.gather_master_params(), sync.gather_master_params()));
        CHECK(bitwise_equal(delayed.gather_ema_params(), sync.gather_ema_params()));
        CHECK(bitwise_equal(delayed.gather_optimizer_state(0), sync.gather_optimizer_state(0)));
        CHECK(bitwise_equal(delayed.gather_optimizer_state(1), sync.gather_optimizer_state(1)));
        CHECK(bitwise_equal(read_model_params(delayed, &backend), seen.back()));
        CHECK(delayed.host_memory().buffers == 2 * sync.host_memory().buffers);
        CHECK(delayed.host_memory().total() == delayed.predicted_host_state().total());
      }
}

}  // namespace zero::testing
