#!/usr/bin/env bash
# Issue 17 (parameter groups) on one H200: the GPU engine tests (their
# configurations include parameter groups: a no-decay group, a head at half
# the learning rate with other betas, a gain group) at np 1 over NCCL and
# np 2 host-staged; then the SDXL trainer at stage 2, batch 8, 1024x1024, bf16,
# AdamW, no checkpointing, no EMA, channels-last, 20 steps: without groups and
# with no_weight_decay = ["*.bias", "*norm*"] and a down_blocks group at half
# the learning rate (4 groups; within each unit the parameters are laid out by
# group), interleaved, two rounds: what the per-group optimizer launches cost.
#   bash bench/gpu/run_groups_device.sh    (carry .deps)
# Logs, JSON lines and summary.json in $OUT/groups, packed into groups.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-groups}
STEPS=${STEPS:-20}
OUT_DIR=$OUT/groups
LOG=$OUT_DIR/groups.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

say "configure + build"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=ON -DZERO_BUILD_BENCH=OFF \
  "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT_DIR/configure.log" 2>&1 || { tail -20 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
timeout 400 ninja -C "$BUILD" train zero_gpu_engine_tests > "$OUT_DIR/build.log" 2>&1 || { grep -E "error" -A5 "$OUT_DIR/build.log" | head -40 | tee -a "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
for np in 1 2; do
  say "GPU engine tests np $np"
  timeout 300 mpirun -np $np --oversubscribe --bind-to none "$BUILD/tests/gpu_engine/zero_gpu_engine_tests" \
    > "$OUT_DIR/gpu-engine-np$np.log" 2>&1
  echo "gpu engine np$np: exit $?" | tee -a "$LOG"
  grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-engine-np$np.log" | head -12 | tee -a "$LOG"
done

source bench/gpu/trainer_run.sh
groups_config=$OUT_DIR/sdxl-1024-groups.toml
sed 's/^\[optimizer\]$/[optimizer]\nno_weight_decay = ["*.bias", "*norm*"]/' examples/sdxl/configs/sdxl-1024.toml > "$groups_config"
printf '\n[[optimizer.groups]]\nname = "down"\nparams = ["down_blocks.*"]\nlr_scale = 0.5\n' >> "$groups_config"
fast="--stage 2 --batch_size 8 --activation_checkpointing false --ema_decay 0 --channels_last true"
for round in ${ROUNDS:-1 2}; do
  run_trainer "sdxl-stage2-b8-nogroups-r$round" 170 $fast
  CONFIG=$groups_config run_trainer "sdxl-stage2-b8-groups-r$round" 170 $fast
done
grep -A8 "parameter groups" "$OUT_DIR/sdxl-stage2-b8-groups-r1.log" | head -9 | tee -a "$LOG"
summarize_runs "$OUT_DIR" | tee -a "$LOG"
cd "$OUT" && tar czf groups.tgz groups && rm -rf groups
