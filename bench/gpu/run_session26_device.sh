#!/usr/bin/env bash
# Session 26: the offloaded step with per-bucket (stages 1-2) and per-unit
# (stage 3) ordering of the compute stream after the parameter gathers, and
# the pool trimmed before the update queues its uploads (engine.cpp, step()).
#   PHASES="build buildbase tests" BASE_TREE=ab_base bash bench/gpu/run_session26_device.sh
#   PHASES="ab" BASE_TREE=ab_base STEPS=14 bash bench/gpu/run_session26_device.sh   (same machine)
#  build:     every target of the cuda preset (TARGETS: only these).
#  buildbase: the trainer from BASE_TREE (a `git archive` of the base commit,
#             unpacked in an untracked folder of the working tree).
#  tests:     TESTS (a ctest regex; default: the engine at one and two ranks,
#             the trainer's graphs at stages 0-3 against eager).
#  ab:        on-device stage 2 at batch 8 once, then the offloaded run
#             (stage 2, offload_optimizer, delayed update, EMA, checkpointing)
#             with this build, BASE_TREE's, and this build with the EMA on the
#             GPU (offload_ema_on_device), alternated (VARIANTS, default
#             "new base emadevice"; ROUNDS, default 1; EMA_EVERY, default 1).
#  offload:   the offloaded run with this build only (EMA_EVERY, EXTRA).
set -uo pipefail
NAME=session26 DEFAULT_PHASES="build tests"
STEPS=${STEPS:-14}
source bench/gpu/device_env.sh
device_script_begin
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$LOG"
if has buildbase; then build_base_tree; fi
if has tests; then run_gpu_tests "${TESTS:-gpu.engine.np1|gpu.engine.np2|gpu.sdxl.train_graph}"; fi
offloaded() {  # offloaded NAME BUILD EMA_EVERY [options...]
  local name=$1 build=$2 every=$3
  shift 3
  bash -c 'source bench/gpu/trainer_run.sh; BUILD='"$build"' OUT_DIR='"$OUT_DIR"' LOG='"$LOG"' STEPS='"$STEPS"' \
    CONFIG='"$gb8"' run_trainer "$@"' _ "$name" 300 --stage 2 --offload_optimizer true --offload_delayed_update true \
    --ema_every "$every" "$@"
}
if has ab || has offload; then gb8=$(batch8_config) || exit 1; fi
if has ab; then
  base=${BASE_TREE:?set BASE_TREE to the folder with the sources of the base commit}
  CONFIG=$gb8 run_trainer "sdxl-device-stage2-8x1" 240 --stage 2
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for every in ${EMA_EVERY:-1}; do
      for variant in ${VARIANTS:-new base emadevice}; do
        case $variant in
          new) offloaded "sdxl-offload-new-ema-every$every-r$round" "$BUILD" "$every" ;;
          base) offloaded "sdxl-offload-base-ema-every$every-r$round" "$base/build/cuda" "$every" ;;
          emadevice) offloaded "sdxl-offload-emadevice-ema-every$every-r$round" "$BUILD" "$every" \
            --offload_ema_on_device true ;;
        esac
      done
    done
  done
fi
if has offload; then
  for every in ${EMA_EVERY:-1}; do offloaded "sdxl-offload-${VARIANT:-new}-ema-every$every" "$BUILD" "$every" ${EXTRA:-}; done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
