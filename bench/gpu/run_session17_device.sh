#!/usr/bin/env bash
# Session 17 (2026-12-05): what the offloaded forward+backward loses to the
# CPU. Session 16 measured, stage 2, offload, delayed update, 8 x 1, AdamW +
# EMA: forward+backward 0.836 s against 0.567 s on the device (sync offload,
# whose CPU is idle during backward: 0.63-0.65 s). Two OpenMP teams of
# cores-1 threads (the delayed update's and the host gradient worker's) run
# beside the thread that launches the kernels. This phase runs the same
# configuration with OpenMP's idle threads sleeping instead of spinning
# (OMP_WAIT_POLICY=passive) and with other team sizes
# (offload_update_threads, offload_gradient_threads), each against the
# default in the same call.
#   PHASES="build engine omp" TARGETS="train zero_gpu_engine_tests" STEPS=10 \
#     bash bench/gpu/run_session17_device.sh   (carry .deps)
# (Since this script was written, backward's thread no longer waits for the
# gradient copies either: "default" runs with that.)
set -uo pipefail
NAME=s17 DEFAULT_PHASES="omp"
source bench/gpu/device_env.sh
device_script_begin
# engine: the GPU engine tests at 1 and 2 ranks (the streamed downloads
# without host waits: the copies' events waited for on the host worker).
if has engine; then run_gpu_tests 'gpu\.engine\.np[12]$'; fi
# RUNS picks which trainer runs of the omp phase (default: all, in order).
want() { [[ " ${RUNS:-ondevice default update12-grad3 passive update8-grad2} " == *" $1 "* ]]; }
if has omp; then
  gb8=$(batch8_config) || exit 1
  delayed=(--stage 2 --offload_optimizer true --offload_delayed_update true)
  if want ondevice; then CONFIG=$gb8 run_trainer "sdxl-omp-ondevice" 150 --stage 2; fi
  if want default; then CONFIG=$gb8 run_trainer "sdxl-omp-default" 150 "${delayed[@]}"; fi
  if want update12-grad3; then CONFIG=$gb8 run_trainer "sdxl-omp-update12-grad3" 150 "${delayed[@]}" --offload_update_threads 12 --offload_gradient_threads 3; fi
  if want passive; then OMP_WAIT_POLICY=passive CONFIG=$gb8 run_trainer "sdxl-omp-passive" 150 "${delayed[@]}"; fi
  if want update8-grad2; then CONFIG=$gb8 run_trainer "sdxl-omp-update8-grad2" 150 "${delayed[@]}" --offload_update_threads 8 --offload_gradient_threads 2; fi
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
say "done"
