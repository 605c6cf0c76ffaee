#!/usr/bin/env bash
# One call on the H200 for this session's merges (2026-12-04):
#  1. build against the machine's LibTorch 2.11 (CUDA): the trainer, unet_forward and the new
#     CPU tests (VAE/CLIP, schedulers/sampling, CLIP tokenizer: utf8proc from .deps/utf8proc), run them;
#  2. full SDXL batch 8 at 1024^2 (sdxl-1024.toml): full fine-tuning vs LoRA rank 32 after the
#     adapter's one-GEMM accumulation, with the load-imbalance fields in metrics.jsonl.
#   bash bench/gpu/run_session9_device.sh     (carry .deps)
#   BUILD=$PWD/build/cuda bash ...           (reuse tools/gpu-quickstart.sh's build)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-$PWD/build/device-s9}
OUT_DIR=$OUT/s9
LOG=$OUT_DIR/s9.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
source bench/gpu/trainer_run.sh
say "configure + build"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
[ -f "$BUILD/CMakeCache.txt" ] || cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_BENCH=OFF "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" \
  > "$OUT_DIR/configure.log" 2>&1 || { tail -20 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
grep -i "utf8proc\|warning" "$OUT_DIR/configure.log" | head -5 | tee -a "$LOG"
timeout 420 ninja -C "$BUILD" train unet_forward zero_sdxl_vae_clip_tests zero_sdxl_sampling_tests \
  sdxl_tokenizer_tests \
  > "$OUT_DIR/build.log" 2>&1 || { grep -E "error" -A5 "$OUT_DIR/build.log" | head -60 | tee -a "$LOG"; exit 1; }
say "new CPU tests built against LibTorch $(python3 -c 'import torch;print(torch.__version__)')"
(cd "$BUILD" && ctest -R "sdxl.vae_clip|sdxl.sampling|sdxl.tokenizer" --output-on-failure 2>&1 | tail -15) | tee -a "$LOG"
say "batch 8, 1024^2, sdxl-1024.toml: full fine-tuning vs LoRA rank 32"
STEPS=${STEPS:-10}
run_trainer sdxl-full-b8 150 --batch_size 8
run_trainer sdxl-lora32-b8 150 --batch_size 8 --lora_rank 32 --lora_alpha 32
summarize_runs "$OUT_DIR" | tee -a "$LOG"
tail -2 "$OUT_DIR/sdxl-lora32-b8.jsonl" | tee -a "$LOG"
say "done"
