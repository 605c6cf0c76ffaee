// The delayed update's check, shared by the CPU (tests/mpi) and GPU
// (tests/gpu_engine) engine tests.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine_steps.hpp"
#include "mlp_training.hpp"

namespace zero::testing {

/// One configuration of the delayed update: where the gradients come from
/// (streamed with one micro-step, accumulated on the device and sent down at
/// step(), or streamed every micro-step and added on the host) and where the
/// parameters live (offload_params: two host shards).
struct DelayedCase {
  int stage = 1;
  bool offload_params = false;
  int accumulation = 1;
  GradAccumulation mode = GradAccumulation::reduce_each_micro_step;
  bool accumulate_on_host = false;
  bool streams_grads() const { return accumulation == 1 || accumulate_on_host; }
};

inline std::vector<DelayedCase> delayed_cases() {
  const auto each = GradAccumulation::reduce_each_micro_step, boundary = GradAccumulation::reduce_at_boundary;
  return {
      {1, false, 1, each}, {2, false, 1, each}, {3, false, 1, each},
      // Several micro-steps: the accumulator (stage 1 reducing at the
      // boundary: the full buffer, reduced in place) goes down at step().
      {1, false, 2, boundary}, {2, false, 3, each}, {3, false, 2, each},
      // Stage 3 with the parameters in host memory: the update writes the
      // shard the gathers do not read.
      {3, true, 1, each}, {3, true, 3, each},
      // Several micro-steps streamed and added on the host: backward of the
      // next step streams into the shard the running update does not read.
      {1, false, 2, each, true}, {2, false, 3, each, true}, {3, true, 3, each, true},
  };
}

inline EngineOptions delayed_options(const DelayedCase& c, DType dtype) {
  EngineOptions o;
  o.stage = c.stage;
  o.param_dtype = dtype;
  o.accumulation_steps = c.accumulation;
  o.accumulation = c.mode;
  o.buckets.alignment_elements = 4;
  o.optimizer.kind = OptimizerKind::adamw;
  o.optimizer.lr = 0.05;
  o.optimizer.weight_decay = 0.01;
  o.max_grad_norm = 1.0;
  o.ema.decay = 0.9;
  // Three micro-steps: the EMA every second step (the delayed update skips
  // and applies it as the synchronous one does); elsewhere every step.
  o.ema.every = c.accumulation == 3 ? 2 : 1;
  o.offload.optimizer = true;
  o.offload.params = c.offload_params;
  o.offload.accumulate_on_host = c.accumulate_on_host;
  return o;
}

// The state an update leaves, bit for bit: master, EMA and both moments.
inline void check_same_update_state(Engine& got, Engine& want) {
  CHECK(bitwise_equal(got.gather_master_params(), want.gather_master_params()));
  CHECK(bitwise_equal(got.gather_ema_params(), want.gather_ema_params()));
  CHECK(bitwise_equal(got.gather_optimizer_state(0), want.gather_optimizer_state(0)));
  CHECK(bitwise_equal(got.gather_optimizer_state(1), want.gather_optimizer_state(1)));
}

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
    for (const DelayedCase& c : delayed_cases())
      for (int warmup : {0, 2})
        for (DType state_dtype : {DType::fp32, DType::bf16}) {
          // bf16 optimizer state (its stochastic rounding keyed by the step and
          // the index) with bf16 parameters after two warm-up steps.
          if (state_dtype == DType::bf16 && (dtype != DType::bf16 || warmup != 2)) continue;
          CAPTURE(dtype);
          CAPTURE(c.stage);
          CAPTURE(c.offload_params);
          CAPTURE(c.accumulation);
          CAPTURE(static_cast<int>(c.mode));
          CAPTURE(c.accumulate_on_host);
          CAPTURE(warmup);
          CAPTURE(state_dtype);
          EngineOptions o = delayed_options(c, dtype);
          o.optimizer.state_dtype = state_dtype;
          // bf16 keeps the EMA on the device (the master goes up), fp32 on the
          // host: both against the synchronous update of the same placement.
          o.offload.ema_on_device = dtype == DType::bf16 && !c.offload_params;
          CAPTURE(o.offload.ema_on_device);
          Engine sync(mlp_units(), o, comm, backend);
          o.offload.delayed_update = true;
          o.offload.delayed_update_warmup_steps = warmup;
          // Other host teams than the synchronous engine's where several
          // micro-steps run: the kernels cut their work by chunks, not by
          // threads, so the bits are the same.
          if (c.accumulation > 1) {
            o.offload.update_threads = 3;
            o.offload.gradient_worker_threads = c.accumulate_on_host ? 2 : 0;
          }
          Engine delayed(mlp_units(), o, comm, backend);
          init_random_params(sync);
          init_random_params(delayed);
          // After 0, 1, ... updates.
          std::vector<std::vector<std::vector<float>>> seen = {read_model_params(sync, &backend)};
          for (int k = 1; k <= kDelayedSteps; ++k) {
            CAPTURE(k);
            // Update k-1 is up before step k when it was synchronous (a warm-up step).
            const auto& expected = (k - 1 <= warmup) ? seen[k - 1] : seen[k - 2];
            const auto weights = read_model_params(delayed, &backend);
            CHECK(bitwise_equal(weights, expected));
            const StepResult want =
                run_step_from(sync, expected, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
            const StepResult got =
                run_step_from(delayed, weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
            CHECK(got.applied);
            CHECK(got.grad_norm == want.grad_norm);
            CHECK(got.clip_coefficient == want.clip_coefficient);
            CHECK(got.clip_coefficient < 1);  // clipping is exercised
            seen.push_back(read_model_params(sync, &backend));
          }
          // Reading the state (exports, validation images) waits for the
          // running update, so it reads the latest weights, but leaves the
          // upload to the next step: the model still holds the update before.
          check_same_update_state(delayed, sync);
          CHECK(bitwise_equal(read_model_params(delayed, &backend), seen[seen.size() - 2]));
          // What settles the engine for writing (here the model's own gather;
          // save_state too) sends the finished update up.
          (void)delayed.gather_model_params();
          CHECK(bitwise_equal(read_model_params(delayed, &backend), seen.back()));
          // One more gradient shard where backward streams into one (one
          // micro-step, or accumulating on the host), and one more parameter
          // copy: a staging copy, or with offload_params a second host parameter shard.
          const std::size_t shard = delayed.layout().shard_numel();
          const std::size_t grad_shard = shard * size_of(o.effective_grad_dtype());
          // (Sending the master up, neither writes a copy.)
          const std::size_t copy = o.offload.ema_on_device ? 0 : shard * size_of(dtype);
          CHECK(delayed.host_memory().buffers ==
                sync.host_memory().buffers + copy + (c.streams_grads() ? grad_shard : 0));
          CHECK(delayed.host_memory().total() == delayed.predicted_host_state().total());
        }
}

// offload.upload_during_backward sends a finished update's slices up
// during the next backward, bucket by bucket as backward releases them,
// instead of at step(): the same values must arrive, the EMA on the device
// must take each slice once, and the gathers must start from what arrived.
// Against the same delayed engine sending everything at step(), bit for bit
// at every step. Reading the state before every second step joins the
// running update and leaves its upload pending, so in that backward every
// bucket is finished and goes up during it (the count is exact); on the
// other steps as many as the CPU has finished. Both with the gradients
// handed over first to last and last to first (as a model's backward does,
// which releases the buckets opposite to the order the update takes them).
inline void check_upload_during_backward(Communicator& comm, Backend& backend) {
  const auto each = GradAccumulation::reduce_each_micro_step, boundary = GradAccumulation::reduce_at_boundary;
  const DelayedCase cases[] = {{1, false, 1, each}, {2, false, 1, each}, {2, false, 3, each}, {1, false, 2, boundary}};
  for (bool backward_order : {false, true})
    for (DType dtype : {DType::fp32, DType::bf16})
      for (const DelayedCase& c : cases) {
        CAPTURE(backward_order);
        CAPTURE(dtype);
        CAPTURE(c.stage);
        CAPTURE(c.accumulation);
        EngineOptions o = delayed_options(c, dtype);
        o.offload.delayed_update = true;
        // bf16: the master goes up and the device keeps the EMA; fp32: the
        // CPU writes the parameters' copy, which goes up.
        o.offload.ema_on_device = dtype == DType::bf16;
        o.offload.upload_during_backward = false;
        Engine at_step(mlp_units(), o, comm, backend);
        o.offload.upload_during_backward = true;
        Engine during(mlp_units(), o, comm, backend);
        init_random_params(at_step);
        init_random_params(during);
        const std::size_t buckets = during.layout().buckets().size();
        for (int k = 1; k <= 6; ++k) {
          CAPTURE(k);
          const bool joined = k % 2 == 0;
          if (joined) CHECK(bitwise_equal(during.gather_ema_params(), at_step.gather_ema_params()));
          const auto weights = read_model_params(at_step, &backend);
          CHECK(bitwise_equal(read_model_params(during, &backend), weights));
          const StepResult want =
              run_step_from(at_step, weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend, backward_order);
          const StepResult got =
              run_step_from(during, weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend, backward_order);
          CHECK(got.grad_norm == want.grad_norm);
          CHECK(got.clip_coefficient == want.clip_coefficient);
          CHECK(want.buckets_up_during_backward == 0);
          // Step 1's backward had no finished update to send.
          if (joined) CHECK(got.buckets_up_during_backward == buckets);
          if (k == 1) CHECK(got.buckets_up_during_backward == 0);
          CHECK(got.host_to_device_bytes == want.host_to_device_bytes);
        }
        check_same_update_state(during, at_step);
        CHECK(bitwise_equal(during.gather_model_params(), at_step.gather_model_params()));
        CHECK(bitwise_equal(read_model_params(during, &backend), read_model_params(at_step, &backend)));
      }
}

// A checkpoint taken mid-run completes the pending update first, so a run
// resumed from it continues bit for bit like the one that saved it (which
// goes on from the same completed state): every step's parameters, norms,
// and the final master, state, EMA and parameters.
inline void check_delayed_update_resume(Communicator& comm, Backend& backend) {
  // Every rank names the same files (rank 0's pid), apart from concurrent runs.
  double pid = ::getpid();
  comm.all_reduce_host_f64(&pid, 1, ReduceOp::max);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("zero-test-delayed" + std::to_string(static_cast<long>(pid)) + "-rank" +
                             std::to_string(comm.rank()) + ".safetensors"))
                               .string();
  const DelayedCase cases[] = {{2, false, 1},
                               {2, false, 3},
                               {3, true, 1},
                               {3, true, 2},
                               {3, true, 2, GradAccumulation::reduce_each_micro_step, /*accumulate_on_host=*/true}};
  for (const DelayedCase& c : cases) {
    CAPTURE(c.stage);
    CAPTURE(c.offload_params);
    CAPTURE(c.accumulation);
    CAPTURE(c.accumulate_on_host);
    EngineOptions o = delayed_options(c, DType::bf16);
    o.offload.delayed_update = true;
    o.offload.delayed_update_warmup_steps = 1;
    // One case with the EMA on the device: saved from and loaded into device memory.
    o.offload.ema_on_device = !c.offload_params && c.accumulation == 1;
    CAPTURE(o.offload.ema_on_device);
    Engine straight(mlp_units(), o, comm, backend);
    init_random_params(straight);
    for (int k = 1; k <= 3; ++k)
      run_step_from(straight, read_model_params(straight, &backend), k, comm.rank(), StepGradient::pull_to_half, -1,
                    &backend);
    straight.save_state(path);
    Engine resumed(mlp_units(), o, comm, backend);
    init_random_params(resumed, 99);  // other values, all overwritten by the load
    resumed.load_state(path);
    CHECK(resumed.steps_applied() == 3);
    for (int k = 4; k <= 7; ++k) {
      CAPTURE(k);
      const auto want_weights = read_model_params(straight, &backend);
      const auto weights = read_model_params(resumed, &backend);
      CHECK(bitwise_equal(weights, want_weights));
      const StepResult want =
          run_step_from(straight, want_weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
      const StepResult got = run_step_from(resumed, weights, k, comm.rank(), StepGradient::pull_to_half, -1, &backend);
      CHECK(got.grad_norm == want.grad_norm);
      CHECK(got.clip_coefficient == want.clip_coefficient);
    }
    check_same_update_state(resumed, straight);
    CHECK(bitwise_equal(read_model_params(resumed, &backend), read_model_params(straight, &backend)));
    std::filesystem::remove(path);
  }
}

}  // namespace zero::testing
