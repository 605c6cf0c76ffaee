#!/usr/bin/env bash
# Issue 19 on the H200 machine: LoRA files loaded by diffusers, and TF32.
#  1. The tiny trainer with [lora] (fp32, merge_lora), on CPU ranks (N = 2)
#     and on the GPU (N = 1, strict fp32); diffusers (source in
#     .deps/diffusers/src) loads the diffusers/PEFT and the kohya file into
#     the same base and the merged UNet: tests/gpu/check_lora_diffusers.py.
#  2. TF32: the full SDXL UNet, fp32 forward+backward at batch 2, 1024^2
#     (unet_bench, random weights) with and without --tf32; the tiny UNet's
#     output with --tf32 against strict fp32 and the CPU.
#   bash bench/gpu/run_lora_device.sh    (carry .deps)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-lora}
OUT_DIR=$OUT/lora
LOG=$OUT_DIR/lora.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
say "configure + build"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT_DIR/configure.log" 2>&1 \
  || { tail -20 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
timeout 480 ninja -C "$BUILD" train unet_forward unet_bench > "$OUT_DIR/build.log" 2>&1 \
  || { grep -E "error" -A5 "$OUT_DIR/build.log" | head -40 | tee -a "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
W=tests/fixtures/sdxl/tiny_a_weights.safetensors
LORA="--model_weights $W --lora_rank 4 --lora_alpha 8 --lr 1e-2 --ema_decay 0 --steps 10 --warmup_steps 2
      --synthetic_samples 64 --checkpoint_every 0 --save_final false --merge_lora true --precision fp32"
export PYTHONPATH=$PWD/.deps/diffusers/src
for where in cpu cuda; do
  np=2; [ $where = cuda ] && np=1
  say "LoRA training on $where, N = $np"
  rm -rf "$OUT_DIR/run-$where"
  timeout 300 mpirun -np $np --oversubscribe --bind-to none "$BUILD/examples/sdxl/train" \
    --config examples/sdxl/configs/tiny.toml --output_dir "$OUT_DIR/run-$where" --device $where $LORA \
    > "$OUT_DIR/train-$where.log" 2>&1
  echo "train $where: exit $?" | tee -a "$LOG"
  grep -E "^LoRA|exported|step 10/" "$OUT_DIR/train-$where.log" | tee -a "$LOG"
  say "diffusers against zero ($where)"
  timeout 300 python3 tests/gpu/check_lora_diffusers.py "$OUT_DIR/run-$where" $W examples/sdxl/configs/tiny_unet.json \
    --device $where 2>"$OUT_DIR/diffusers-$where.err" | tee -a "$LOG" "$OUT_DIR/diffusers-$where.json"
  tail -3 "$OUT_DIR/diffusers-$where.err" | tee -a "$LOG"
  rm -rf "$OUT_DIR/run-$where/tensorboard" "$OUT_DIR/run-$where/unet"
done
say "TF32: tiny UNet output, strict fp32 vs --tf32 vs CPU"
IN=$OUT_DIR/run-cpu/export_check.safetensors
"$BUILD/examples/sdxl/unet_forward" --model $W --inputs $IN --output $OUT_DIR/tiny-cpu.safetensors | tee -a "$LOG"
"$BUILD/examples/sdxl/unet_forward" --model $W --inputs $IN --output $OUT_DIR/tiny-strict.safetensors --device cuda | tee -a "$LOG"
"$BUILD/examples/sdxl/unet_forward" --model $W --inputs $IN --output $OUT_DIR/tiny-tf32.safetensors --device cuda --tf32 | tee -a "$LOG"
python3 - "$OUT_DIR" <<'PY' | tee -a "$LOG"
import sys, json
from safetensors.torch import load_file
d = sys.argv[1]
ref = load_file(f"{d}/tiny-cpu.safetensors")["sample"].double()
r = {k: float((load_file(f"{d}/tiny-{k}.safetensors")["sample"].double() - ref).norm() / ref.norm()) for k in ("strict", "tf32")}
print(json.dumps({"tiny_unet_rel_l2_vs_cpu_fp32": r}))
PY
for tf in "" "--tf32"; do
  say "unet_bench full SDXL fp32 batch 2 1024^2 fwd+bwd $tf"
  timeout 300 "$BUILD/examples/sdxl/unet_bench" --device cuda --dtype fp32 --batch 2 --latent 128 --backward \
    --steps 5 --warmup 2 $tf --json "$OUT_DIR/tf32-bench.jsonl" 2>&1 | tail -3 | tee -a "$LOG"
done
say "done"
