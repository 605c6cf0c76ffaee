#!/usr/bin/env bash
# Issue 8 on one GPU: the SDXL trainer's speed at 1024x1024, bf16, AdamW + EMA
# without activation checkpointing (the reference eager step's setting), at
# stages 0..3 and batches 8 and 1, and the effect of cuDNN's algorithm
# benchmark, with the in-step peak memory (nvidia-smi, 5 ms).
#   bash bench/gpu/run_speed_device.sh      (after run_offload_device.sh's build, or builds itself)
# Logs, JSON lines and summary.json in $OUT/speed, packed into speed.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-offload-build}
STEPS=${STEPS:-20}
OUT_DIR=$OUT/speed
LOG=$OUT_DIR/speed.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ ! -x "$BUILD/examples/sdxl/train" ]; then
  PHASES=build OUT=$OUT BUILD=$BUILD bash bench/gpu/run_offload_device.sh > /dev/null 2>&1
fi
source bench/gpu/trainer_run.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

run_trainer sdxl-stage2-b8-nockpt-nocudnnbench 120 --stage 2 --batch_size 8 --activation_checkpointing false \
  --cudnn_benchmark false
for stage in ${STAGES:-2 0 1 3}; do
  run_trainer "sdxl-stage$stage-b8-nockpt" 120 --stage "$stage" --batch_size 8 --activation_checkpointing false
done
for stage in ${B1_STAGES:-0 2}; do
  run_trainer "sdxl-stage$stage-b1-nockpt" 100 --stage "$stage" --batch_size 1 --activation_checkpointing false
done
summarize_runs "$OUT_DIR" | tee -a "$LOG"
cd "$OUT" && tar czf speed.tgz speed && rm -rf speed
