#!/usr/bin/env bash
# Issue 8 on one GPU: the SDXL trainer's speed at 1024x1024, bf16, AdamW,
# without activation checkpointing and without EMA (the reference eager step's
# setting), at stages 0..3 and batches 8 and 1, with the in-step peak memory
# (nvidia-smi, 5 ms), next to the UNet's forward+backward alone (unet_bench).
# Stages 0-1 replay the step's forward+backward as a CUDA graph
# ([device] cuda_graph); every run is channels-last ([device] channels_last)
# unless LAYOUT="" is given.
#   bash bench/gpu/run_speed_device.sh      (builds into $BUILD when needed)
# Logs, JSON lines and summary.json in $OUT/speed, packed into speed.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-speed-build}
STEPS=${STEPS:-20}
OUT_DIR=$OUT/speed
LOG=$OUT_DIR/speed.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ ! -x "$BUILD/examples/sdxl/train" ] || [ ! -x "$BUILD/examples/sdxl/unet_bench" ]; then
  PHASES=build TARGETS="train unet_bench" OUT=$OUT BUILD=$BUILD bash bench/gpu/run_speed_probe_device.sh > /dev/null 2>&1
fi
source bench/gpu/trainer_run.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

LAYOUT=${LAYOUT---channels_last true}
tag=$([ -n "$LAYOUT" ] && echo "-cl" || echo "")
fast="--activation_checkpointing false --ema_decay 0 $LAYOUT"
graph="--cuda_graph true"
bench_args=$([ -n "$LAYOUT" ] && echo "--channels_last" || echo "")
for batch in 8 1; do
  echo "==== $(date -u +%H:%M:%S) unet_bench batch $batch $bench_args" | tee -a "$LOG"
  timeout 120 "$BUILD/examples/sdxl/unet_bench" --device cuda --dtype bf16 --backward --batch $batch --steps 10 \
    --warmup 3 $bench_args --json "$OUT_DIR/unet-bench.jsonl" 2>&1 | grep forward | tee -a "$LOG"
  timeout 120 "$BUILD/examples/sdxl/unet_bench" --device cuda --dtype bf16 --backward --batch $batch --steps 10 \
    --warmup 3 $bench_args --cuda_graph --json "$OUT_DIR/unet-bench.jsonl" 2>&1 | grep forward | tee -a "$LOG"
done
for stage in ${GRAPH_STAGES:-0 1}; do
  run_trainer "sdxl-stage$stage-b8-nockpt-noema$tag-graph" 150 --stage "$stage" --batch_size 8 $fast $graph
done
for stage in ${EAGER_STAGES:-2 3}; do
  run_trainer "sdxl-stage$stage-b8-nockpt-noema$tag" 150 --stage "$stage" --batch_size 8 $fast
done
run_trainer "sdxl-stage0-b1-nockpt-noema$tag-graph" 120 --stage 0 --batch_size 1 $fast $graph
run_trainer "sdxl-stage0-b1-nockpt-noema$tag" 120 --stage 0 --batch_size 1 $fast
run_trainer "sdxl-stage2-b1-nockpt-noema$tag" 120 --stage 2 --batch_size 1 $fast
run_trainer "sdxl-stage2-b8-nockpt$tag" 150 --stage 2 --batch_size 8 --activation_checkpointing false $LAYOUT
summarize_runs "$OUT_DIR" | tee -a "$LOG"
cd "$OUT" && tar czf speed.tgz speed && rm -rf speed
