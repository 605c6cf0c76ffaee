#!/usr/bin/env bash
# Issue 19 on the H200, full SDXL: LoRA against full fine-tuning, the smallest
# memory cap for batch-1 LoRA, strict fp32 against diffusers' float64, and the
# full single-file export read by diffusers' from_single_file.
#   bash bench/gpu/run_lora_sdxl_device.sh a   (build; fp32 vs f64; from_single_file; LoRA vs full at batch 8)
#   bash bench/gpu/run_lora_sdxl_device.sh b   (batch-1 LoRA: peaks uncapped, then caps)
# carry .deps (toml++, CLI11, diffusers' source).
set -uo pipefail
PHASE=${1:-a}
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-$PWD/build/device-lora}
OUT_DIR=$OUT/lora-sdxl
LOG=$OUT_DIR/lora-sdxl-$PHASE.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/.deps/diffusers/src
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
source bench/gpu/trainer_run.sh
say "configure + build"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_BENCH=OFF "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" \
  > "$OUT_DIR/configure.log" 2>&1 || { tail -20 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
timeout 400 ninja -C "$BUILD" train unet_forward > "$OUT_DIR/build-$PHASE.log" 2>&1 \
  || { grep -E "error" -A5 "$OUT_DIR/build-$PHASE.log" | head -40 | tee -a "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
LORA="--lora_rank 32 --lora_alpha 32"
if [ "$PHASE" = a ]; then
  say "strict fp32 full SDXL UNet vs diffusers float64 (random weights)"
  D=/tmp/fp64; rm -rf $D
  timeout 240 python3 tests/gpu/check_sdxl_fp32_vs_f64.py make $D 2>&1 | tail -3 | tee -a "$LOG"
  timeout 120 "$BUILD/examples/sdxl/unet_forward" --model $D/unet --inputs $D/inputs.safetensors \
    --output $D/zero_fp32.safetensors --device cuda --dtype fp32 2>&1 | tail -2 | tee -a "$LOG"
  python3 tests/gpu/check_sdxl_fp32_vs_f64.py compare $D $D/zero_fp32.safetensors | tee -a "$LOG" "$OUT_DIR/fp32-vs-f64.json"
  rm -rf $D
  say "full single-file export (tiny, CPU ranks) read by diffusers from_single_file"
  W=/tmp/export-check; rm -rf $W; mkdir -p $W
  timeout 300 python3 tests/sdxl_train/check_export.py "$BUILD/examples/sdxl/train" mpirun \
    examples/sdxl/configs/tiny.toml $W -np 2 --oversubscribe > "$OUT_DIR/check_export.log" 2>&1
  echo "check_export.py: exit $? ($(grep -c "^ok " "$OUT_DIR/check_export.log") ok, $(grep -c "^FAIL" "$OUT_DIR/check_export.log") FAIL)" | tee -a "$LOG"
  timeout 120 python3 tests/gpu/check_full_checkpoint_diffusers.py $W/fp32/full_checkpoint.safetensors $W/fp32/unet_ema \
    examples/sdxl/configs/tiny_unet.json 2>"$OUT_DIR/from_single_file.err" | tee -a "$LOG" "$OUT_DIR/from-single-file.json"
  tail -3 "$OUT_DIR/from_single_file.err" | tee -a "$LOG"
  say "batch 8, 1024^2, sdxl-1024.toml (bf16, stage 2, EMA, checkpointing): full fine-tuning vs LoRA rank 32"
  STEPS=20
  run_trainer sdxl-full-b8 200 --batch_size 8
  run_trainer sdxl-lora32-b8 200 --batch_size 8 $LORA
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
else
  STEPS=10
  say "batch-1 LoRA rank 32, uncapped: stage 2, and stage 3 with the base offloaded"
  run_trainer sdxl-lora32-b1-stage2 150 --batch_size 1 $LORA
  run_trainer sdxl-lora32-b1-stage3-offload 200 --batch_size 1 $LORA --stage 3 --offload_optimizer --offload_params
  # Caps from the uncapped run's in-step peak (nvidia-smi): the next whole GiB above it, and 1 GiB less.
  peak=$(python3 -c "import sys; v=[int(x) for x in open(sys.argv[1]).read().split() if x.isdigit()]; print((max(v)-v[0])/1024)" \
    "$OUT_DIR/sdxl-lora32-b1-stage3-offload.smi" 2>/dev/null || echo 3)
  first=$(python3 -c "import math; print(math.ceil($peak + 0.25))")
  for cap in ${CAPS:-${first}GiB $((first - 1))GiB}; do
    run_trainer sdxl-lora32-b1-stage3-offload-cap$cap 200 --batch_size 1 $LORA --stage 3 --offload_optimizer \
      --offload_params --max_gpu_memory $cap
  done
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
say "done"
