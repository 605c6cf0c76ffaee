#!/usr/bin/env bash
# Issue 20, item 4: the planner's predicted images/s against measured trainer runs on one H200.
# Full SDXL UNet, sdxl-1024.toml (bf16, AdamW, EMA), synthetic 1024^2 data, global batch 8 in every
# run (batch x accumulation = 8), the configurations below; each run 9 steps, images/s = the mean of
# the metrics.jsonl records after step 3 (log_every 3). Also re-runs the LibTorch-2.11 CPU tests of the
# VAE/CLIP loaders (the remove_all crash) first. Predictions: zero-plan (same build) with
#   --unet-config sdxl-base --ema --fit 200GiB --global-batch 8 --json
# matched by trainer options.        bash bench/gpu/run_speed_prediction_device.sh   (carry .deps)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
D=$OUT/speedpred
mkdir -p "$D"
LOG=$D/run.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
T0=$SECONDS
( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train zero-plan zero_sdxl_vae_clip_tests ) 2>&1 | tail -4 | tee -a "$LOG"
B=build/cuda
(cd $B && ctest -R "sdxl.vae_clip" --output-on-failure 2>&1 | tail -4) | tee -a "$LOG"
$B/examples/sdxl/zero-plan --unet-config sdxl-base --ema --fit 200GiB --global-batch 8 --json > "$D/plan.json" 2>&1
run() {  # NAME OPTIONS...
  local name=$1; shift
  if [ $((SECONDS - T0)) -gt ${BUDGET_S:-520} ]; then say "skip $name (time)"; return; fi
  say "$name: $*"
  rm -rf "/tmp/$name"
  local start=$SECONDS
  timeout 170 mpirun -np 1 --bind-to none $B/examples/sdxl/train --config examples/sdxl/configs/sdxl-1024.toml \
    --steps 9 --warmup_steps 5 --log_every 3 --checkpoint_every 0 --save_final false --export_unet false \
    --output_dir "/tmp/$name" "$@" > "$D/$name.log" 2>&1
  echo "$name exit $? wall $((SECONDS - start)) s" | tee -a "$LOG"
  grep -E "step +9|error|Error" "$D/$name.log" | tail -2 | tee -a "$LOG"
  cp "/tmp/$name/metrics.jsonl" "$D/$name.jsonl" 2>/dev/null
}
ck=(--activation_checkpointing true)
run s2-b8-ckpt          --stage 2 --batch_size 8 --accumulation 1 "${ck[@]}"
run s2-b8-nockpt        --stage 2 --batch_size 8 --accumulation 1 --activation_checkpointing false
run s2-b4a2-ckpt        --stage 2 --batch_size 4 --accumulation 2 "${ck[@]}"
run s2-b1a8-ckpt        --stage 2 --batch_size 1 --accumulation 8 "${ck[@]}"
run s3-b8-ckpt          --stage 3 --batch_size 8 --accumulation 1 "${ck[@]}"
run s2-off-b8-ckpt      --stage 2 --batch_size 8 --accumulation 1 "${ck[@]}" --offload_optimizer true
run s2-offdpu-b8-ckpt   --stage 2 --batch_size 8 --accumulation 1 "${ck[@]}" --offload_optimizer true --offload_delayed_update true
run s3-offp-b4a2-ckpt   --stage 3 --batch_size 4 --accumulation 2 "${ck[@]}" --offload_optimizer true --offload_params true
run s3-off-b1a8-ckpt    --stage 3 --batch_size 1 --accumulation 8 "${ck[@]}" --offload_optimizer true
say "done"
