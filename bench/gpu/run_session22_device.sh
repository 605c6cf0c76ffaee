#!/usr/bin/env bash
# Session 22 (2026-12-06): stage 0's update beside the next forward
# (Engine::Impl::update_beside_forward, commits c64c4d6 and 2b42327), against
# the commit before it. Measured slower on an H100 and reverted (see
# docs/perf-notes.md, session 22); kept to rerun such an A/B: check out the
# change, bundle main before it as runs/base.bundle.
# Here: mkdir -p runs && git bundle create runs/base.bundle main (before committing the change);
# device calls carry .deps and runs/base.bundle.
#   PHASES="build tests" bash bench/gpu/run_session22_device.sh
#   PHASES="speed" bash bench/gpu/run_session22_device.sh   (same warm machine)
#  build: this tree's train and zero_gpu_engine_tests (build/cuda), and the
#         base commit's train (runs/base/build/cuda);
#  tests: gpu.engine.np1/np2 (stage 0 against stages 1-3, bit for bit) and
#         gpu.sdxl.train_graph (graph replays against eager, bit for bit);
#  speed: the trainer at batch 1, stage 0, CUDA graph (the 12
#         images/s), base and new alternately (ROUNDS, default 2), then batch
#         8 stage 0 graph, base and new (no EMA, no checkpointing,
#         channels-last: run_speed_device.sh's settings).
set -uo pipefail
NAME=s22 DEFAULT_PHASES="build tests speed"
source bench/gpu/device_env.sh
if has build; then
  build_targets train zero_gpu_engine_tests
  if [ ! -d runs/base/.git ]; then git clone -q -b main runs/base.bundle runs/base || exit 1; fi
  cp -r .deps runs/base/ 2>/dev/null
  (cd runs/base && git log --oneline -1 && source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train) \
    2>&1 | tail -3 | tee -a "$LOG"
fi
source bench/gpu/trainer_run.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
if has tests; then run_gpu_tests 'gpu\.engine\.np[12]$|gpu\.sdxl\.train_graph'; fi
if has speed; then
  fast="--activation_checkpointing false --ema_decay 0 --channels_last true --cuda_graph true"
  NEW=$BUILD
  for round in $(seq 1 "${ROUNDS:-2}"); do
    BUILD=runs/base/build/cuda run_trainer "sdxl-base-stage0-b1-graph-r$round" 120 --stage 0 --batch_size 1 $fast
    BUILD=$NEW run_trainer "sdxl-new-stage0-b1-graph-r$round" 120 --stage 0 --batch_size 1 $fast
  done
  if [ -z "${SKIP_B8:-}" ]; then
    BUILD=runs/base/build/cuda run_trainer "sdxl-base-stage0-b8-graph" 150 --stage 0 --batch_size 8 $fast
    BUILD=$NEW run_trainer "sdxl-new-stage0-b8-graph" 150 --stage 0 --batch_size 8 $fast
  fi
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
say "done"
