#!/usr/bin/env bash
# The session's last H200 call (2026-12-04), after merging prepare, sample, --fit and the delayed
# update with accumulation / offload_params:
#  A. build the cuda preset's tools and the new CPU tests against LibTorch 2.11; run sdxl.vae_clip
#     (the remove_all crash fixed by the link order), sdxl.prepare, sdxl.sample there;
#  B. `sample` against diffusers' StableDiffusionXLPipeline on the tiny models (CPU, fp32);
#  C. a full-size random-weight pipeline: `prepare` throughput at 1024^2 (cuda, bf16), and `sample`
#     seconds per image at 30 steps;
#  D. the delayed update with accumulation and with offload_params on full SDXL (AdamW + EMA);
#  E. held-out checks of the planner's speed prediction.
#   bash bench/gpu/run_session10_final.sh     (carry .deps; PYTHONPATH for diffusers is set here)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
D=$OUT/final
mkdir -p "$D"
LOG=$D/run.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD/.deps/diffusers/src
say() { echo "==== $(date -u +%H:%M:%S) [$((SECONDS))s] $*" | tee -a "$LOG"; }
budget() { [ $SECONDS -lt "${BUDGET_S:-540}" ] || { say "skip $1 (time)"; return 1; }; }
B=build/cuda
say "A. build"
( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train zero-plan prepare sample \
    zero_sdxl_vae_clip_tests prepare_make_images prepare_check_values ) 2>&1 | tail -3 | tee -a "$LOG"
(cd $B && ctest -R "sdxl.vae_clip|sdxl.prepare|sdxl.sample" --output-on-failure -j3 > "$D/ctest-cpu-2.11.log" 2>&1)
grep -E "Test +#|tests passed|FAIL" "$D/ctest-cpu-2.11.log" | tee -a "$LOG"
say "B. sample vs diffusers (tiny, CPU, fp32)"
python3 bench/gpu/check_sample_vs_diffusers.py $PWD/$B /tmp/svd > "$D/sample_vs_diffusers.log" 2>&1
echo "exit $?" >> "$D/sample_vs_diffusers.log"; tail -6 "$D/sample_vs_diffusers.log" | tee -a "$LOG"
cp /tmp/svd/sample_vs_diffusers.json "$D/" 2>/dev/null
say "C. full-size pipeline, images, prepare at 1024^2"
python3 bench/gpu/make_full_pipeline.py /tmp/pipe 2>&1 | tail -1 | tee -a "$LOG"
python3 bench/gpu/make_images.py /tmp/imgs 64 2>&1 | tail -1 | tee -a "$LOG"
printf 'a red fox in snow\na lighthouse at dusk\n' > /tmp/prompts.txt
start=$SECONDS
mpirun -np 1 --bind-to none $B/examples/sdxl/prepare --pipeline /tmp/pipe --images /tmp/imgs --output /tmp/ds \
  --resolution 1024 --device cuda --dtype bf16 --batch_size 8 --shard_size 16 --validation_prompts /tmp/prompts.txt \
  > "$D/prepare.log" 2>&1
echo "prepare exit $? wall $((SECONDS - start)) s" | tee -a "$LOG"; tail -4 "$D/prepare.log" | tee -a "$LOG"
python3 -c "import json;d=json.load(open('/tmp/ds/index.json'));print('dataset:',d['num_samples'],'samples',len(d['shards']),'shards; buckets',sorted({tuple(s['latent_shape']) for s in d['samples']}))" 2>&1 | tee -a "$LOG"
if budget sample; then
  start=$SECONDS
  $B/examples/sdxl/sample --pipeline /tmp/pipe --prompt "a red fox in snow" --steps 30 --guidance 5 --seed 1 \
    --num_images 3 --device cuda --dtype bf16 --output "$D/fox.png" > "$D/sample.log" 2>&1
  echo "sample exit $? wall $((SECONDS - start)) s" | tee -a "$LOG"; cat "$D/sample.log" | tee -a "$LOG"
fi
say "D/E. trainer runs (sdxl-1024.toml, 9 steps, global batch 8)"
run() {  # NAME OPTIONS...
  local name=$1; shift
  budget "$name" || return
  say "$name: $*"
  local start=$SECONDS
  timeout 150 mpirun -np 1 --bind-to none $B/examples/sdxl/train --config examples/sdxl/configs/sdxl-1024.toml \
    --steps 9 --warmup_steps 5 --log_every 3 --checkpoint_every 0 --save_final false --export_unet false \
    --output_dir "/tmp/$name" "$@" > "$D/$name.log" 2>&1
  echo "$name exit $? wall $((SECONDS - start)) s" | tee -a "$LOG"
  grep -E "step +9|error|Error|refus" "$D/$name.log" | tail -2 | tee -a "$LOG"
}
ck=(--activation_checkpointing true)
run s3-offp-dpu-b4a2-ckpt --stage 3 --batch_size 4 --accumulation 2 "${ck[@]}" --offload_optimizer true --offload_params true --offload_delayed_update true
run s2-offdpu-b4a2-ckpt   --stage 2 --batch_size 4 --accumulation 2 "${ck[@]}" --offload_optimizer true --offload_delayed_update true
run s2-b2a4-ckpt          --stage 2 --batch_size 2 --accumulation 4 "${ck[@]}"
$B/examples/sdxl/zero-plan --unet-config sdxl-base --ema --fit 200GiB --global-batch 8 --json > "$D/plan.json" 2>&1
say "done"
