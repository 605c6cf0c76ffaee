#!/usr/bin/env bash
# Session 25: the offloaded optimizer's host memory, the batch-1 step on the
# H200, and the engine/CMake changes of the session checked on the GPU.
#   PHASES="build hostbench" bash bench/gpu/run_session25_device.sh
#   PHASES="tests trace" bash bench/gpu/run_session25_device.sh      (same machine)
#  build: every target of the cuda preset (the precompiled LibTorch header
#         now reused by ~50 translation units, cmake/ReuseTorchHeader.cmake),
#         timed, and how many translation units GCC refused the header for.
#  hostbench: gpu_bench_host_state: the CPU AdamW + EMA pass on pinned
#         (cudaHostAlloc, as the engine allocates it), pageable 4 KiB,
#         transparent-huge-page and huge-page-then-registered memory.
#  tests: the gpu tests of the fused linear, the engine and the trainer's graph.
#  trace: batch 1, stage 0, graph, channels-last, Kineto trace of step 15.
#  offload: offloaded AdamW + EMA at global batch 8 (stage 2, delayed update,
#         8 x 1) against on-device stage 2 in the same call (issue 20;
#         EMA_EVERY: the ema_every values, default 1; SKIP_DEVICE_REF=1: no reference).
#  ab:    the same offloaded run, this build against BASE_TREE's, alternated
#         (ROUNDS, default 1; EMA_EVERY, default "1 4"), and the on-device reference once.
#   TARGETS=train PHASES="build ab" BASE_TREE=ab_base bash bench/gpu/run_session25_device.sh
set -uo pipefail
NAME=session25 DEFAULT_PHASES="build hostbench"
TARGETS=${TARGETS:-}
STEPS=${STEPS:-16}
source bench/gpu/device_env.sh
if has build; then
  start=$SECONDS
  say "build all targets"
  ( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build ${TARGETS:-} ) > "$OUT_DIR/build.log" 2>&1
  tail -3 "$OUT_DIR/build.log" | tee -a "$LOG"
  say "build took $((SECONDS - start)) s"
  echo "warnings of a refused precompiled header: $(grep -c 'Winvalid-pch' "$OUT_DIR/build.log")" | tee -a "$LOG"
  echo "compile commands with the precompiled header: $(cd $BUILD && ninja -t commands | grep -c 'cmake_pch.hxx')" | tee -a "$LOG"
fi
source bench/gpu/trainer_run.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
lscpu | grep -E "Model name|Socket|NUMA node|^CPU\(s\)|Thread" | tee -a "$LOG"
if has hostbench; then
  say "hostbench"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-15} timeout 400 $BUILD/bench/gpu/gpu_bench_host_state --elements "${HOST_ELEMENTS:-805306368}" \
    --reps 5 --json "$OUT_DIR/host-state.json" 2>&1 | tee -a "$LOG"
fi
if has tests; then run_gpu_tests "${TESTS:-gpu.sdxl.fused_linear|gpu.engine.np1|gpu.sdxl.train_graph}"; fi
if has trace; then trace_batch1_stage0; fi
if has offload; then
  gb8=$(batch8_config) || exit 1
  for round in $(seq 1 "${ROUNDS:-1}"); do
    [ -z "${SKIP_DEVICE_REF:-}" ] && CONFIG=$gb8 run_trainer "sdxl-device-stage2-8x1-r$round" 240 --stage 2
    for every in ${EMA_EVERY:-1}; do
      CONFIG=$gb8 run_trainer "sdxl-offload-stage2-delayed-8x1-ema-every$every-r$round" 300 --stage 2 \
        --offload_optimizer true --offload_delayed_update true --ema_every "$every"
    done
  done
fi
if has ab; then
  # The pool trimmed before the update (engine.cpp, step()) against BASE_TREE
  # (a `git archive` of the commit before it, an untracked folder of the
  # working tree), offloaded AdamW + EMA at batch 8, alternated; the on-device
  # reference once, with this build.
  base=${BASE_TREE:?set BASE_TREE to the folder with the sources of the base commit}
  ln -sfn ../.deps "$base/.deps"
  say "build base ($base)"
  ( cd "$base" && source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train ) 2>&1 | tail -2 | tee -a "$LOG"
  gb8=$(batch8_config) || exit 1
  CONFIG=$gb8 run_trainer "sdxl-device-stage2-8x1" 240 --stage 2
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for every in ${EMA_EVERY:-1 4}; do
      for variant in trim-first base; do
        build=$BUILD; [ "$variant" = base ] && build=$base/build/cuda
        bash -c "source bench/gpu/trainer_run.sh; BUILD=$build OUT_DIR=$OUT_DIR LOG=$LOG STEPS=$STEPS CONFIG=$gb8 \
          run_trainer sdxl-offload-$variant-ema-every$every-r$round 300 --stage 2 --offload_optimizer true \
          --offload_delayed_update true --ema_every $every"
      done
    done
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
