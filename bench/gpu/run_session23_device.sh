#!/usr/bin/env bash
# Session 23: the recalibrated activation constants on an 80 GB card. With the
# first calibration, sdxl-1024.toml's checkpoint_units = "fit" at batch 8,
# stage 2, AdamW + EMA recomputed 56 of 91 units under an 80 GiB cap (15.27
# images/s, 64.0 GiB on the H200, session 22). With the new constants the
# planner picks ~32 units on an H100 (79.1 GiB; predicted 74.9 GiB, ~16.0
# images/s by the H200 speed model). Both, alternated, on the same card:
#   PHASES="build fit" bash bench/gpu/run_session23_device.sh
#  fit: the config's default ("fit") and the old choice (56 units), twice each.
#  trace: where a step's GPU time goes at stage 0 with the CUDA graph, no EMA,
#         no checkpointing, channels-last (issue 20's batch-1 line: 10.2
#         images/s on the H200, 12 asked): a Kineto trace of step 15 at batch
#         1 and 8, summarized by bench/gpu/kernel_summary.py (the recorded
#         summary came from an interim script of commit 2a7b87a, bench/gpu/trace_summary.py, since removed as a duplicate).
#         PHASES="build trace" STEPS=16
#  refuse: batch 8 of that (predicted 85.26 GiB) on an 80 GB card without a
#          cap: refused before loading, with a proposal (it used to load and
#          die in step 1); then the proposal itself runs.
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
if has trace; then
  fast="--activation_checkpointing false --ema_decay 0 --channels_last true --cuda_graph true --profile_step 15"
  for batch in ${TRACE_BATCHES:-1 8}; do
    run_trainer "sdxl-trace-stage0-b$batch" 150 --stage 0 --batch_size "$batch" $fast
    python3 bench/gpu/kernel_summary.py "/tmp/sdxl-trace-stage0-b$batch/profile-step-15.json" --top 40 \
      --json "$OUT_DIR/trace-stage0-b$batch.json" 2>&1 | tee -a "$LOG"
  done
fi
if has refuse; then
  fast="--activation_checkpointing false --ema_decay 0 --channels_last true --cuda_graph true"
  run_trainer "sdxl-refuse-stage0-b8" 150 --stage 0 --batch_size 8 $fast
  grep -m1 -o "this GPU has.*" "$OUT_DIR/sdxl-refuse-stage0-b8.log" | tee -a "$LOG"
  units=$(grep -m1 -o "checkpoint_units = [0-9]\+" "$OUT_DIR/sdxl-refuse-stage0-b8.log" | grep -o "[0-9]\+$")
  [ -n "$units" ] && run_trainer "sdxl-proposal-stage0-b8" 150 --stage 0 --batch_size 8 --ema_decay 0 \
    --channels_last true --cuda_graph true --activation_checkpointing true --checkpoint_units "$units"
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
