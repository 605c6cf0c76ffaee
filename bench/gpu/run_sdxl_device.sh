#!/usr/bin/env bash
# One pass on a GPU machine for the SDXL parts: build the UNet bench, the
# trainer and unet_forward against the local PyTorch's LibTorch, then
#  - time forward+backward of the full SDXL UNet (bf16, 1024x1024) at batch 1
#    and 8, with and without activation checkpointing (JSON lines);
#  - check the bf16 UNet on the GPU against diffusers' float64 fixture output;
#  - train the tiny config on the GPU at stages 2 and 3 (zero::torch on CUDA, NCCL).
# Logs and JSON go to $OUT. Needs .deps/ (toml++, CLI11 headers) carried along.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-build/sdxl-dev}
mkdir -p "$OUT"
LOG=$OUT/sdxl.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
step() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

step "configure"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=OFF -DZERO_BUILD_BENCH=OFF \
  "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log" | tee -a "$LOG"; exit 1; }
step "build"
timeout "${BUILD_LIMIT:-240}" ninja -C "$BUILD" unet_bench train unet_forward > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -40 | tee -a "$LOG"; exit 1; }

step "SDXL UNet forward+backward, bf16, 128x128 latents"
for batch in 1 8; do
  for ckpt in "" "--checkpointing"; do
    timeout 60 "$BUILD/examples/sdxl/unet_bench" --device cuda --dtype bf16 --batch $batch --backward $ckpt \
      --steps 5 --warmup 2 --json "$OUT/sdxl-unet-fwdbwd.jsonl" 2>&1 | tee -a "$LOG"
  done
done

step "bf16 UNet on the GPU vs diffusers float64 (tiny fixture)"
timeout 30 "$BUILD/examples/sdxl/unet_forward" --model tests/fixtures/sdxl/tiny_a_weights.safetensors \
  --inputs tests/fixtures/sdxl/tiny_a_io.safetensors --output "$OUT/tiny_bf16_out.safetensors" --device cuda --dtype bf16 2>&1 | tee -a "$LOG"
python3 - "$OUT/tiny_bf16_out.safetensors" <<'PY' 2>&1 | tee -a "$LOG"
import sys, torch
from safetensors.torch import load_file
got = load_file(sys.argv[1])["sample"].double()
want = load_file("tests/fixtures/sdxl/tiny_a_io.safetensors")["expected_f64"]
print(f"bf16 on GPU: relative L2 vs expected_f64 = {((got - want).norm() / want.norm()).item():.3e} (limit 2e-2)")
PY

for stage in 2 3; do
  step "tiny trainer on the GPU, stage $stage"
  timeout 60 mpirun -np 1 "$BUILD/examples/sdxl/train" --config examples/sdxl/configs/tiny.toml --device cuda \
    --precision bf16 --stage $stage --steps 30 --log_every 10 --checkpoint_every 0 --output_dir "/tmp/tiny-s$stage" 2>&1 \
    | grep -vE "^[a-z_]+ = |^\[|^$" | tee -a "$LOG"
  cp "/tmp/tiny-s$stage/metrics.jsonl" "$OUT/tiny-gpu-stage$stage.jsonl" 2>/dev/null
done
step "done"
