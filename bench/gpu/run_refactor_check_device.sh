#!/usr/bin/env bash
# Issue 16 (the engine refactor) on one H200, before and after on the same
# machine: the tree before the refactor (commit 3053e9d, carried as .before/)
# and this tree are built side by side; the GPU tests run on the new build
# (the engine over NCCL at np 1 and host-staged at np 2 sharing the GPU, the
# CUDA backend and kernels, the UNet's fused kernels); then the SDXL trainer
# at 1024x1024, bf16, AdamW, no checkpointing, no EMA, channels-last:
# stage 0 batch 8 with the CUDA graph and stage 2 batch 8 eager, 20 steps
# each, after and before interleaved.
#   git archive 3053e9d | tar -x -C .before   (here, once; .before/ is ignored)
#   PHASES="build" bash bench/gpu/run_refactor_check_device.sh      (carry .deps .before)
#   PHASES="tests speed" bash bench/gpu/run_refactor_check_device.sh
# Logs, JSON lines and summary.json in $OUT/refactor, packed into refactor.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
PHASES=${PHASES:-"build tests speed"}
AFTER=${AFTER:-/root/zero-after}
BEFORE=${BEFORE:-/root/zero-before}
STEPS=${STEPS:-20}
OUT_DIR=$OUT/refactor
LOG=$OUT_DIR/refactor.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

configure() {  # configure SOURCE BUILD
  local TP
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=ON -DZERO_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT_DIR/configure-$(basename "$2").log" 2>&1
}
if has build; then
  say "configure + build, before (.before) and after (this tree), side by side"
  [ -d .before/.deps ] || cp -r .deps .before/.deps
  configure "$PWD/.before" "$BEFORE" || { tail -20 "$OUT_DIR/configure-$(basename "$BEFORE").log" | tee -a "$LOG"; exit 1; }
  configure "$PWD" "$AFTER" || { tail -20 "$OUT_DIR/configure-$(basename "$AFTER").log" | tee -a "$LOG"; exit 1; }
  timeout 560 ninja -C "$AFTER" -j 10 train unet_bench zero_gpu_engine_tests zero_gpu_tests zero_sdxl_geglu_tests \
    zero_sdxl_group_norm_nhwc_tests > "$OUT_DIR/build-after.log" 2>&1 &
  after=$!
  timeout 560 ninja -C "$BEFORE" -j 6 train > "$OUT_DIR/build-before.log" 2>&1
  echo "before build: exit $?" | tee -a "$LOG"
  wait $after
  echo "after build: exit $?" | tee -a "$LOG"
  grep -E "error" -A5 "$OUT_DIR"/build-*.log | head -40 | tee -a "$LOG"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
fi
if has tests; then
  for np in 1 2; do
    say "GPU engine tests np $np"
    timeout 300 mpirun -np $np --oversubscribe --bind-to none "$AFTER/tests/gpu_engine/zero_gpu_engine_tests" \
      > "$OUT_DIR/gpu-engine-np$np.log" 2>&1
    echo "gpu engine np$np: exit $?" | tee -a "$LOG"
    grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-engine-np$np.log" | head -12 | tee -a "$LOG"
  done
  say "CUDA backend and kernels (gpu.kernels)"
  timeout 300 "$AFTER/tests/gpu/zero_gpu_tests" --test-case-exclude='comm*' > "$OUT_DIR/gpu-kernels.log" 2>&1
  echo "gpu kernels: exit $?" | tee -a "$LOG"
  grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-kernels.log" | head -6 | tee -a "$LOG"
  for t in zero_sdxl_geglu_tests zero_sdxl_group_norm_nhwc_tests; do
    say "$t --gpu"
    timeout 300 "$AFTER/tests/sdxl/$t" --gpu > "$OUT_DIR/$t.log" 2>&1
    echo "$t: exit $?" | tee -a "$LOG"
    grep -E "test cases|assertions|ERROR" "$OUT_DIR/$t.log" | head -6 | tee -a "$LOG"
  done
fi
if has speed; then
  source bench/gpu/trainer_run.sh
  fast="--activation_checkpointing false --ema_decay 0 --channels_last true"
  for round in ${ROUNDS:-1}; do
    for which in after before; do
      BUILD=$([ $which = after ] && echo "$AFTER" || echo "$BEFORE")
      run_trainer "sdxl-stage0-b8-graph-$which-r$round" 170 --stage 0 --batch_size 8 $fast --cuda_graph true
    done
    for which in after before; do
      BUILD=$([ $which = after ] && echo "$AFTER" || echo "$BEFORE")
      run_trainer "sdxl-stage2-b8-$which-r$round" 170 --stage 2 --batch_size 8 $fast
    done
  done
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
cd "$OUT" && tar czf refactor.tgz refactor && rm -rf refactor
