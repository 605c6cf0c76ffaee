#!/usr/bin/env bash
# The session-15 H200 call (2026-12-05): what session 13-14's calls left.
#   PHASES="build graphtest fit calibrate" bash bench/gpu/run_session15_device.sh
#  build: the cuda preset (TARGETS: only these; default every target);
#  graphtest: gpu.sdxl.train_graph, graph vs eager with [device] deterministic
#        (bit for bit at stages 0-3, with and without checkpointing);
#  fit: the trainer's --fit 12GiB, 8GiB and 24GiB at global batch 8. The batch comes
#        from the config file (sdxl-1024.toml with batch_size = 8), not the
#        command line: --fit keeps options given on the command line, so the
#        session-13 script's `--fit 12GiB --batch_size 8` pinned batch 8 and
#        was refused (no configuration at micro-batch 8 fits 12 GiB);
#  calibrate: sdxl-1024.toml, stage 0, batch 1 and 8 with per-layer units and
#        batch 8 per block (as run_session13_device.sh's calibrate).
#  gathers (for the next session): stage 3 without the host wait per unit
#        (2026-12-05): stage 3 eager at batch 1 and 8 against stage 2 (was +41%
#        and +2.5%), and stage 3 with offload_params under 12 GiB at 2 x 4 (2.81
#        images/s with the wait; prediction in docs/perf-notes.md).
# Logs, JSON lines and summary.json under $OUT/s15. Name fewer than 8 files
# back or tar them: $OUT returns at most 8 files.
set -uo pipefail
NAME=s15 DEFAULT_PHASES="build graphtest fit calibrate"
source bench/gpu/device_env.sh
device_script_begin
if has graphtest; then run_gpu_tests "gpu.sdxl.train_graph"; cp "$OUT_DIR/ctest.log" "$OUT_DIR/ctest-train-graph.log"; fi
if has fit; then
  gb8=$(batch8_config) || exit 1
  grep -q '^batch_size = 8$' "$gb8" || say "could not set batch_size = 8 in $gb8"
  CONFIG=$gb8 run_trainer "sdxl-fit-12GiB-gb8" 300 --fit 12GiB
  CONFIG=$gb8 run_trainer "sdxl-fit-8GiB-gb8" 300 --fit 8GiB
  CONFIG=$gb8 run_trainer "sdxl-fit-24GiB-gb8" 300 --fit 24GiB
fi
if has calibrate; then
  for batch in 1 8; do
    run_trainer "sdxl-calib-stage0-b$batch-layers" 240 --stage 0 --batch_size "$batch" --units layers
  done
  run_trainer "sdxl-calib-stage0-b8-blocks" 240 --stage 0 --batch_size 8 --units blocks
fi
if has gathers; then run_gathers_phase; fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
say "done"
