#!/usr/bin/env bash
# Session 34: bf16 optimizer state (OptimizerOptions::state_dtype), on the GPU.
#   PHASES (default "build kernels optbench b1ab"):
#   build:    the cuda preset's train, zero_gpu_tests and gpu_bench_optimizer;
#   kernels:  zero_gpu_tests' kernel cases (the bf16-state case: the device's
#             bits against the host reference at odd offsets and cuts);
#   optbench: gpu_bench_optimizer at 2^30 parameters, no sweep: AdamW with
#             bf16 gradients and copy, fp32 state against bf16 state (predicted
#             20 / 28 = 0.71 of the time) and the copy ceiling;
#   hostbench: (session 35) bench_cpu_optimizer's AdamW + EMA in one pass at
#             2^27 parameters with fp32 and with bf16 moments, and the copy
#             ceiling, on this machine's host (the offloaded update's kernel;
#             build it with TARGETS);
#   b1ab:     bench/gpu/run_session27_device.sh's phase b1ab (batch 1, stage 0,
#             graph) with B1_VARIANTS (default "noprefetch pinned bf16state") B1_ROUNDS
#             times (default 1).
# Output: $OUT/session34/run.log, kernels.log, optimizer.json and the trainer
# runs' summaries (under session27/).
set -uo pipefail
NAME=session34 DEFAULT_PHASES="build kernels optbench b1ab"
TARGETS=${TARGETS:-train zero_gpu_tests gpu_bench_optimizer}
source bench/gpu/device_env.sh
device_script_begin
if has kernels; then
  say "kernels"
  timeout 300 "$BUILD/tests/gpu/zero_gpu_tests" -tc="kernels:*" > "$OUT_DIR/kernels.log" 2>&1
  echo "kernels exit $?" | tee -a "$LOG"
  grep -E "test cases|ERROR|values" "$OUT_DIR/kernels.log" | head -20 | tee -a "$LOG"
fi
if has optbench; then
  say "optimizer bench"
  timeout 240 "$BUILD/bench/gpu/gpu_bench_optimizer" --no-sweep --json "$OUT_DIR/optimizer.json" 2>&1 | tee -a "$LOG"
fi
if has hostbench; then
  say "host optimizer bench"
  timeout 240 "$BUILD/bench/cpu/bench_cpu_optimizer" --benchmark_filter="EMA_bf16_fused|Memcpy" \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$OUT_DIR/cpu-optimizer.json" --benchmark_out_format=json 2>&1 | grep -E "median|Run on" | tee -a "$LOG"
fi
if has b1ab; then
  OUT=$OUT PHASES=b1ab B1_ROUNDS=${B1_ROUNDS:-1} B1_VARIANTS=${B1_VARIANTS:-noprefetch pinned bf16state} \
    bash bench/gpu/run_session27_device.sh > /dev/null 2>&1
  tail -15 "$OUT/session27/run.log" | tee -a "$LOG"
fi
say "done"
