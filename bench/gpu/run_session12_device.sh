#!/usr/bin/env bash
# The session-12 H200 calls (2026-12-04): [device] cuda_graph at stages 2-3
# (the whole micro-step captured: gradient writes, reduce-scatters, stage-3 gathers).
#   PHASES="build tests" bash bench/gpu/run_session12_device.sh   (first call)
#   PHASES="speed" bash bench/gpu/run_session12_device.sh         (second call)
#  build: the cuda preset's train, unet_bench and GPU engine tests (TARGETS=all: everything);
#  tests: gpu.engine.np1 (captured micro-step == eager, stages 0-3, bitwise) and
#         gpu.sdxl.train_graph (the trainer, graph vs eager, stages 0-3); TESTS=all: every gpu test;
#  speed: full SDXL at 1024^2, bf16, AdamW, no EMA, no checkpointing, channels-last,
#         batch 8 and 1: stages 2 and 3 with the graph against eager, stage 0's graph as the control.
# Logs, JSON lines and summary.json under $OUT/s12.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
OUT_DIR=$OUT/s12
LOG=$OUT_DIR/run.log
BUILD=build/cuda
STEPS=${STEPS:-20}
PHASES=${PHASES:-"build tests speed"}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
say() { echo "==== $(date -u +%H:%M:%S) [$((SECONDS))s] $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
if has build; then
  say "build"
  targets=${TARGETS:-train unet_bench zero_gpu_engine_tests}
  [ "$targets" = all ] && targets=""
  ( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build $targets ) 2>&1 |
    tail -5 | tee -a "$LOG"
fi
if has tests; then
  say "tests"
  # TESTS=all: every test labelled gpu (then build with TARGETS=all).
  if [ "${TESTS:-}" = all ]; then select=(-L gpu); else select=(-R "${TESTS:-gpu.engine.np1|gpu.sdxl.train_graph}"); fi
  ctest --test-dir $BUILD "${select[@]}" --output-on-failure --timeout 500 > "$OUT_DIR/ctest.log" 2>&1
  grep -E "Test +#|tests passed|FAIL|max relative|images/s|Error|error" "$OUT_DIR/ctest.log" | head -60 | tee -a "$LOG"
fi
if has speed; then
  source bench/gpu/trainer_run.sh
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
  fast="--activation_checkpointing false --ema_decay 0 --channels_last true"
  for batch in ${BATCHES:-8 1}; do
    for run in ${RUNS:-2-graph 2-eager 3-graph 3-eager 0-graph}; do  # STAGE-MODE
      stage=${run%-*} mode=${run#*-}
      extra=$([ "$mode" = graph ] && echo "--cuda_graph true" || echo "")
      run_trainer "sdxl-stage$stage-b$batch-$mode" 150 --stage "$stage" --batch_size "$batch" $fast $extra
    done
  done
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
say "done"
