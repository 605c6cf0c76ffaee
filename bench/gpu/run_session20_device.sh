#!/usr/bin/env bash
# Session 20 (2026-12-05, no GPU lent): partial activation checkpointing
# ([train] checkpoint_units, docs/planner.md "Partial checkpointing"), to be
# measured against the planner's prediction.
#   PHASES="build bench partial" TARGETS="train zero-plan unet_bench" STEPS=12 bash bench/gpu/run_session20_device.sh
#   (RUNS: which partial runs, default "all 56 30 none fit fit-cap80"; UNITS:
#   unet_bench's counts, default "0 30 56 70")
#  build: the cuda preset (TARGETS: only these);
#  bench: unet_bench (the UNet alone) at batch 8 recomputing 0 (every unit),
#         30, 56 and 70 units, and without checkpointing: peak
#         allocated and time against the count;
#  partial: sdxl-1024.toml (AdamW + EMA) at batch 8, stage 2, on one GPU:
#           every unit recomputed, 56 and 30 of the 91 units, none; then the
#           config's checkpoint_units = "fit" on this GPU (predicted: none)
#           and under max_gpu_memory = 80GiB (an 80 GB card: the planner
#           picks 56 units, predicted peak 75.68 GiB, 15.0 images/s against
#           13.7 for every unit). The log holds zero-plan's prediction for
#           each count beside the measurement.
set -uo pipefail
NAME=s20 DEFAULT_PHASES="partial"
source bench/gpu/device_env.sh
device_script_begin
if has bench; then
  # The UNet alone (no engine, no optimizer): peak allocated and time of
  # forward+backward at batch 8 against the count recomputed, the
  # activation side of the planner's interpolation.
  for units in ${UNITS:-0 30 56 70}; do
    "$BUILD/examples/sdxl/unet_bench" --batch 8 --backward --checkpointing --checkpoint_units "$units" --steps 4 \
      --channels_last --json "$OUT_DIR/unet-bench-partial.jsonl" 2>&1 | tail -1 | tee -a "$LOG"
  done
  "$BUILD/examples/sdxl/unet_bench" --batch 8 --backward --steps 4 --channels_last \
    --json "$OUT_DIR/unet-bench-partial.jsonl" 2>&1 | tail -1 | tee -a "$LOG"
fi
if has partial; then
  gb8=$(batch8_config) || exit 1
  for run in ${RUNS:-all 56 30 none fit fit-cap80}; do
    case $run in
      none) CONFIG=$gb8 run_trainer "sdxl-partial-none-stage2-b8" 150 --stage 2 --activation_checkpointing false ;;
      # The config's default (checkpoint_units = "fit") on this GPU, and
      # capped at an 80 GB card's memory: the trainer picks the count.
      fit) CONFIG=$gb8 run_trainer "sdxl-partial-fit-stage2-b8" 150 --stage 2 ;;
      fit-cap80) CONFIG=$gb8 run_trainer "sdxl-partial-fit-cap80-stage2-b8" 150 --stage 2 --max_gpu_memory 80GiB ;;
      *)
        count=$run; [ "$run" = all ] && count=0
        plan_peak "checkpoint_units $run" --stage 2 --batch 8 --checkpointing --checkpoint-units "$count"
        CONFIG=$gb8 run_trainer "sdxl-partial-units$run-stage2-b8" 150 --stage 2 --checkpoint_units "$run" ;;
    esac
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
say "done"
