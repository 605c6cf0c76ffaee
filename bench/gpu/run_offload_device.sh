#!/usr/bin/env bash
# Issue 6 on one GPU: the full SDXL trainer (sdxl-1024.toml: bf16, AdamW, EMA,
# checkpointing) with the optimizer (and at stage 3 the parameters) offloaded
# to host memory, under GPU memory caps; the un-offloaded runs that must fail
# fast under the same cap; offloaded against on-device throughput at batch 8;
# the GPU engine tests. While each run trains, nvidia-smi samples the GPU's
# memory in use every 5 ms (NVML: no CUDA context of its own), so the true
# in-step peak is recorded next to the planner's prediction and the trainer's
# between-steps metric.
#   PHASES="build tests cap24 cap12 b8 dpu8 b8sync noema dpu1" bash bench/gpu/run_offload_device.sh
# Logs and JSON lines go to $OUT/offload, packed into offload.tgz at the end
# (the device tool returns at most 8 files). Needs .deps/ (toml++, CLI11)
# carried along; the build directory is reused when it exists.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-offload-build}
STEPS=${STEPS:-30}
PHASES=${PHASES:-"build tests cap24 cap12 b8"}
mkdir -p "$OUT/offload"
LOG=$OUT/offload/offload.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
step() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

if has build; then
  step "configure"
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=ON -DZERO_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT/offload/configure.log" 2>&1 || { tail -30 "$OUT/offload/configure.log" | tee -a "$LOG"; exit 1; }
  step "build"
  timeout "${BUILD_LIMIT:-360}" ninja -C "$BUILD" train zero-plan zero_gpu_engine_tests > "$OUT/offload/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/offload/build.log" | head -40 | tee -a "$LOG"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" | tee -a "$LOG"
fi

if has tests; then
  step "GPU engine tests (np 1 over NCCL, np 2 sharing the GPU)"
  for np in ${TEST_RANKS:-1 2}; do
    timeout 240 mpirun -np $np --oversubscribe --bind-to none "$BUILD/tests/gpu_engine/zero_gpu_engine_tests" \
      > "$OUT/offload/gpu-engine-np$np.log" 2>&1
    echo "gpu engine np$np: exit $?" | tee -a "$LOG"
    grep -E "test cases|assertions|ERROR" "$OUT/offload/gpu-engine-np$np.log" | head -12 | tee -a "$LOG"
  done
fi

OUT_DIR=$OUT/offload
source bench/gpu/trainer_run.sh

if has cap24; then
  # Must fail fast with the planner's message: no offload under 24 GiB.
  run_trainer sdxl-stage0-b1-cap24-nooffload 90 --stage 0 --batch_size 1 --max_gpu_memory 24GiB
  run_trainer sdxl-stage2-b1-cap24-offload 200 --stage 2 --batch_size 1 --offload_optimizer true --max_gpu_memory 24GiB
fi
if has cap12; then
  run_trainer sdxl-stage3-b1-cap12-offload-params 200 --stage 3 --batch_size 1 --offload_optimizer true --offload_params true \
    --max_gpu_memory 12GiB
fi
if has b8; then
  # Throughput at batch 8: offloaded against on-device, same stage, same session.
  run_trainer sdxl-stage2-b8-offload 170 --stage 2 --batch_size 8 --offload_optimizer true
  run_trainer sdxl-stage2-b8-device 120 --stage 2 --batch_size 8
fi

if has dpu8; then
  # The delayed parameter update (ZeRO-Offload's DPU) at batch 8 beside the
  # on-device run of the same session (and, with "b8sync", the synchronous offload).
  run_trainer sdxl-stage2-b8-offload-delayed 150 --stage 2 --batch_size 8 --offload_optimizer true \
    --offload_delayed_update true --delayed_update_warmup 1
  run_trainer sdxl-stage2-b8-device 120 --stage 2 --batch_size 8
fi
if has b8sync; then
  run_trainer sdxl-stage2-b8-offload 170 --stage 2 --batch_size 8 --offload_optimizer true
fi
if has noema; then
  # AdamW alone (no EMA: a fifth less host traffic per step), the same three ways.
  run_trainer sdxl-stage2-b8-offload-delayed-noema 150 --stage 2 --batch_size 8 --ema_decay 0 --offload_optimizer true \
    --offload_delayed_update true --delayed_update_warmup 1
  run_trainer sdxl-stage2-b8-device-noema 120 --stage 2 --batch_size 8 --ema_decay 0
  run_trainer sdxl-stage2-b8-offload-noema 170 --stage 2 --batch_size 8 --ema_decay 0 --offload_optimizer true
fi
if has dpu1; then  # batch 1 under the 24 GiB cap, delayed
  run_trainer sdxl-stage2-b1-cap24-offload-delayed 200 --stage 2 --batch_size 1 --offload_optimizer true \
    --offload_delayed_update true --delayed_update_warmup 1 --max_gpu_memory 24GiB
fi

summarize_runs "$OUT/offload" | tee -a "$LOG"
step "done"
cd "$OUT" && tar czf offload.tgz offload && rm -rf offload
