#!/usr/bin/env bash
# The planner's SDXL activation constants again (examples/sdxl/sdxl_calibration.hpp,
# the recorded runs in tests/sdxl/test_plan_sdxl.cpp and docs/planner.md). Session 22
# measured every peak 6-14 GiB below the prediction at batch 8 (stage 2, AdamW +
# EMA: 53.78 GiB recomputing every unit against 67.41 predicted, 94.70 without
# checkpointing against 101.02), while the interpolation between the two ends
# held (63.85 from the measured ends against 64.02 measured at 56 units). The
# constants predate the NHWC group norm, the GEGLU kernel and the unit-level
# checkpointing. These runs replace the whole calibration table at once:
#   PHASES="build ckpt" bash bench/gpu/run_recalibration_device.sh   (one call, ~6 min)
#   PHASES="full" bash bench/gpu/run_recalibration_device.sh         (same warm machine)
#  ckpt: sdxl-1024.toml (bf16, AdamW + EMA) recomputing every unit, stages
#        0-3 at batch 1 and 8 (STAGES, BATCHES): the runs of the table;
#  full: no checkpointing, stage 2, batch 1 and 4 (FULL_BATCHES), beside
#        session 22's batch 8 (94.70 GiB): the no-checkpointing slope.
#  bench: unet_bench (the UNet alone, channels-last) at batch 1 and 8
#         (BENCH_BATCHES), with and without checkpointing every unit: peak
#         allocated, for the planner's unet_bench table (sdxl.plan).
#         PHASES="build bench" TARGETS=unet_bench.
# Each run records the trainer's between-steps maximum (mem_max_bytes, what
# the table holds) and the in-step peak (nvidia-smi, 5 ms), beside zero-plan's
# prediction in the log.
set -uo pipefail
NAME=recal DEFAULT_PHASES="build ckpt"
TARGETS=${TARGETS:-train zero-plan}
STEPS=${STEPS:-6}
source bench/gpu/device_env.sh
device_script_begin
if has ckpt; then
  for batch in ${BATCHES:-1 8}; do
    for stage in ${STAGES:-0 1 2 3}; do
      plan_peak "stage $stage batch $batch, every unit" --stage "$stage" --batch "$batch" --checkpointing --checkpoint-units 0
      run_trainer "sdxl-ckptall-stage$stage-b$batch" 120 --stage "$stage" --batch_size "$batch" --checkpoint_units all
    done
  done
fi
if has full; then
  for batch in ${FULL_BATCHES:-1 4}; do
    plan_peak "stage 2 batch $batch, no checkpointing" --stage 2 --batch "$batch"
    run_trainer "sdxl-full-stage2-b$batch" 120 --stage 2 --batch_size "$batch" --activation_checkpointing false
  done
fi
if has bench; then
  for batch in ${BENCH_BATCHES:-1 8}; do
    for ckpt in "" "--checkpointing"; do
      say "unet_bench batch $batch ${ckpt:-no checkpointing}"
      "$BUILD/examples/sdxl/unet_bench" --batch "$batch" --backward $ckpt --steps 4 --channels_last \
        --json "$OUT_DIR/unet-bench.jsonl" 2>&1 | tail -1 | tee -a "$LOG"
    done
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
