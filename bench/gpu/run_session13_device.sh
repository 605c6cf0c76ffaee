#!/usr/bin/env bash
# The session-13 H200 calls (2026-12-05): the UNet's ZeRO units per layer.
#   PHASES="build calibrate tests" bash bench/gpu/run_session13_device.sh   (first call)
#   PHASES="build caps hostacc" bash bench/gpu/run_session13_device.sh      (second call)
#   PHASES="build graphckpt" bash bench/gpu/run_session13_device.sh         (third call)
#  build: the cuda preset (TARGETS: only these; default every target);
#  tests: every gpu test (TESTS: a ctest regex instead);
#  calibrate: sdxl-1024.toml (AdamW + EMA, checkpointing), stage 0, batch 1 and 8, per layer,
#             and batch 8 per block as the control: the per-sample checkpointed activations
#             of per-layer recompute, and what the finer units cost in speed;
#  caps: the trainer's --fit 8GiB, 12GiB and 24GiB at global batch 8 (each caps the run at its
#        size), and stage 3 with everything offloaded at 2 x 4 under max_gpu_memory = 12GiB;
#  hostacc: stage 2, offload, delayed update, 4 x 2, the gradients accumulated on the device
#        and on the host (offload_accumulate_on_host), uncapped; all with sdxl-1024.toml.
#  graphckpt (added 2026-12-05, session 14): stage 2 with checkpointing (sdxl-1024.toml: EMA),
#        batch 1 and batch 8, eager against [device] cuda_graph: whether batch 1's 0.30 s
#        micro-step is launch-bound (the graph should take it to ~0.12 s) and what the graph
#        gives at batch 8 (the 17 images/s).
# Logs, JSON lines and summary.json under $OUT/s13.
set -uo pipefail
NAME=s13 DEFAULT_PHASES="build calibrate tests"
source bench/gpu/device_env.sh
device_script_begin
if has calibrate; then
  for batch in 1 8; do
    run_trainer "sdxl-calib-stage0-b$batch-layers" 240 --stage 0 --batch_size "$batch" --units layers
  done
  run_trainer "sdxl-calib-stage0-b8-blocks" 240 --stage 0 --batch_size 8 --units blocks
fi
if has caps; then
  run_trainer "sdxl-fit-12GiB-gb8" 300 --fit 12GiB --batch_size 8
  # What the planner predicts at 11.5 GiB under the block-unit calibration, given explicitly.
  run_trainer "sdxl-cap-12GiB-stage3-2x4" 300 --max_gpu_memory 12GiB --stage 3 --offload_optimizer true \
    --offload_params true --offload_delayed_update true --batch_size 2 --accumulation 4
  run_trainer "sdxl-fit-24GiB-gb8" 300 --fit 24GiB --batch_size 8
  run_trainer "sdxl-fit-8GiB-gb8" 300 --fit 8GiB --batch_size 8
fi
if has hostacc; then
  # What accumulating on the host costs against the device's accumulator, uncapped.
  common="--stage 2 --offload_optimizer true --offload_delayed_update true --batch_size 4 --accumulation 2"
  run_trainer "sdxl-offload-4x2-device-accumulation" 300 $common
  run_trainer "sdxl-offload-4x2-host-accumulation" 300 $common --offload_accumulate_on_host true
fi
if has graphckpt; then
  for batch in 1 8; do
    run_trainer "sdxl-stage2-ckpt-b$batch-eager" 240 --stage 2 --batch_size "$batch"
    run_trainer "sdxl-stage2-ckpt-b$batch-graph" 240 --stage 2 --batch_size "$batch" --cuda_graph true
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
if has tests; then run_gpu_tests "${TESTS:-all}"; fi  # last: the runs above are what the next call needs
say "done"
