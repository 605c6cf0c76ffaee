#!/usr/bin/env bash
# Session 19 (2026-12-05): the transient-block pool after the fix of its miss
# rule (bench/results/session19-h100.md). Calls 4-5 of that session ran these
# phases' runs by hand on an H100; this script repeats them in one call.
#   PHASES="build pool" TARGETS="train zero_gpu_engine_tests" STEPS=8 bash bench/gpu/run_session19_device.sh
#  build: the cuda preset (TARGETS: only these);
#  engine: gpu.engine.np1/np2 (the pool on CUDA streams, bitwise);
#  pool: on the same machine, the on-device reference and the offloaded run
#        at batch 8 (stage 2, delayed), and the 12 GiB stage-3 run (2 x 4,
#        everything offloaded, delayed) at prefetch depths 1 and 3;
#  trace: a Kineto trace of step 7 of the capped and the offloaded runs,
#        summed by bench/gpu/kernel_summary.py into the log (the traces
#        themselves are 30-130 MB: not kept).
# Metrics (engine/block_allocations, _frees, _waits per step) show whether
# the pool frees in the middle of the passes; zero-plan predicts them.
set -uo pipefail
NAME=s19 DEFAULT_PHASES="pool"
source bench/gpu/device_env.sh
device_script_begin
if has engine; then run_gpu_tests 'gpu\.engine\.np[12]$'; fi
gb8=$(batch8_config) || exit 1
capped=(--max_gpu_memory 12GiB --stage 3 --offload_optimizer true --offload_params true
        --offload_delayed_update true --batch_size 2 --accumulation 4)
delayed=(--stage 2 --offload_optimizer true --offload_delayed_update true)
if has pool; then
  CONFIG=$gb8 run_trainer "sdxl-pool-ondevice-stage2-8x1" 100 --stage 2
  CONFIG=$gb8 run_trainer "sdxl-pool-offload-delayed-stage2-8x1" 120 "${delayed[@]}"
  for depth in 1 3; do
    run_trainer "sdxl-pool-prefetch$depth-cap12-stage3-2x4" 150 "${capped[@]}" --prefetch_units "$depth"
  done
fi
if has trace; then
  run_trainer "sdxl-trace-cap12-stage3-2x4" 150 "${capped[@]}" --profile_step 7
  CONFIG=$gb8 run_trainer "sdxl-trace-offload-delayed-stage2-8x1" 120 "${delayed[@]}" --profile_step 7
  for name in sdxl-trace-cap12-stage3-2x4 sdxl-trace-offload-delayed-stage2-8x1; do
    python3 bench/gpu/kernel_summary.py "/tmp/$name/profile-step-7.json" --top 15 2>&1 | tee -a "$LOG"
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
say "done"
