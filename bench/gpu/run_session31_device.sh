#!/usr/bin/env bash
# Session 31: where the offloaded step (stage 2, batch 8, delayed update, EMA
# on the GPU) spends its time with this build and BASE_TREE's (a `git archive`
# of the base commit in an untracked folder): a Kineto trace of step 10 of
# each, gzipped whole into the output folder (the host's CUDA runtime calls
# show where step() blocks), and their stream timelines in the log.
#   PHASES="build buildbase trace" BASE_TREE=ab_base bash bench/gpu/run_session31_device.sh
set -uo pipefail
NAME=session31 DEFAULT_PHASES="build buildbase trace"
TARGETS=${TARGETS:-train}
STEPS=${STEPS:-12}
source bench/gpu/device_env.sh
device_script_begin
if has buildbase; then build_base_tree; fi
if has trace; then
  gb8=$(batch8_config) || exit 1
  for variant in ${VARIANTS:-new base}; do
    build=build/cuda
    [ "$variant" = base ] && build=${BASE_TREE:?set BASE_TREE for the base variant}/build/cuda
    BUILD=$build CONFIG=$gb8 run_trainer "sdxl-offload-$variant-trace" 300 --stage 2 --offload_optimizer true \
      --offload_delayed_update true --ema_every 1 --offload_ema_on_device true --profile_step 10 ${EXTRA:-}
    trace=/tmp/sdxl-offload-$variant-trace/profile-step-10.json
    python3 bench/gpu/stream_timeline.py "$trace" --top 12 2>&1 | tee -a "$LOG"
    gzip -c "$trace" > "$OUT_DIR/trace-$variant.json.gz"
  done
fi
# The device returns a handful of files: the log and the traces.
rm -f "$OUT_DIR"/*.smi "$OUT_DIR"/sdxl-*.log
say "done"
