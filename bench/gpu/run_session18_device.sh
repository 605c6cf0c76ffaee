#!/usr/bin/env bash
# Session 18 (2026-12-05): stage 3's prefetch depth ([zero] prefetch_units).
# Session 15 measured stage 3 with everything offloaded under a 12 GiB cap,
# 2 x 4 (sdxl-1024.toml: AdamW + EMA, checkpointing): 2.81 images/s, uploads
# at 22-27 GB/s effective against ~50 GB/s bulk. Then checkpointed units were
# not prefetched at all, and gather_unit waited on the host for each unit.
# Now a checkpointed unit's recompute prefetches like any backward entry,
# and prefetch_units sets the depth. This phase runs the same configuration
# at depths 0, 1 (the default) and 3 in one call.
#   PHASES="build prefetch" TARGETS="train" STEPS=8 bash bench/gpu/run_session18_device.sh
# threads: the offloaded batch-8 run with other host team sizes against the
# default in the same call (session 17's omp phase, one variant).
# pool: after the buffer-pool change (a step's working set no longer freed
# block by block, each free a cudaFree after a wait for both streams): the
# on-device reference and the offloaded run at batch 8 (stage 2, delayed),
# and the 12 GiB stage-3 run at prefetch depths 1 and 3, in one call:
#   PHASES="build pool" TARGETS=train STEPS=10 bash bench/gpu/run_session18_device.sh
set -uo pipefail
NAME=s18 DEFAULT_PHASES="prefetch"
source bench/gpu/device_env.sh
device_script_begin
if has prefetch; then
  capped=(--max_gpu_memory 12GiB --stage 3 --offload_optimizer true --offload_params true
          --offload_delayed_update true --batch_size 2 --accumulation 4)
  for depth in ${DEPTHS:-1 0 3}; do
    run_trainer "sdxl-prefetch$depth-cap12-stage3-2x4" 200 "${capped[@]}" --prefetch_units "$depth"
  done
fi
if has threads; then
  gb8=$(batch8_config) || exit 1
  delayed=(--stage 2 --offload_optimizer true --offload_delayed_update true)
  CONFIG=$gb8 run_trainer "sdxl-threads-default" 150 "${delayed[@]}"
  CONFIG=$gb8 run_trainer "sdxl-threads-update12-grad3" 150 "${delayed[@]}" --offload_update_threads 12 --offload_gradient_threads 3
fi
if has pool; then
  gb8=$(batch8_config) || exit 1
  CONFIG=$gb8 run_trainer "sdxl-pool-ondevice-stage2-8x1" 150 --stage 2
  CONFIG=$gb8 run_trainer "sdxl-pool-offload-delayed-stage2-8x1" 150 --stage 2 --offload_optimizer true --offload_delayed_update true
  for depth in 1 3; do
    run_trainer "sdxl-pool-prefetch$depth-cap12-stage3-2x4" 200 --max_gpu_memory 12GiB --stage 3 --offload_optimizer true \
      --offload_params true --offload_delayed_update true --batch_size 2 --accumulation 4 --prefetch_units "$depth"
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
say "done"
