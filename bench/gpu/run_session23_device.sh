#!/usr/bin/env bash
# Session 23: the recalibrated activation constants on an 80 GB card. With the
# first calibration, sdxl-1024.toml's checkpoint_units = "fit" at batch 8,
# stage 2, AdamW + EMA recomputed 56 of 91 units under an 80 GiB cap (15.27
# images/s, 64.0 GiB on the H200, session 22). With the new constants the
# planner picks ~32 units on an H100 (79.1 GiB; predicted 74.9 GiB, ~16.0
# images/s by the H200 speed model). Both, alternated, on the same card:
#   PHASES="build fit" bash bench/gpu/run_session23_device.sh
#  fit: the config's default ("fit") and the old choice (56 units), twice each.
set -uo pipefail
NAME=session23 DEFAULT_PHASES="build fit"
TARGETS=${TARGETS:-train zero-plan}
STEPS=${STEPS:-12}
source bench/gpu/device_env.sh
device_script_begin
if has fit; then
  gb8=$(batch8_config) || exit 1
  for round in 1 2; do
    CONFIG=$gb8 run_trainer "sdxl-fit-stage2-b8-r$round" 150 --stage 2
    grep -m2 -i "checkpoint" "$OUT_DIR/sdxl-fit-stage2-b8-r$round.log" | tee -a "$LOG"
    CONFIG=$gb8 run_trainer "sdxl-units56-stage2-b8-r$round" 150 --stage 2 --checkpoint_units 56
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
