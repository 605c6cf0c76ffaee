#!/usr/bin/env bash
# Issue 17 (frozen parameters, hybrid sharding) on one H200: the GPU engine
# tests (their configurations include frozen parameters: part of two units
# and a whole unit) at np 1 over NCCL and np 2 host-staged; the GPU
# communicator tests (NCCL and staged split_hybrid) at np 1 and 2; and the CPU
# optimizer kernel with and without parameter groups on the 16 host cores.
#   bash bench/gpu/run_frozen_hsdp_device.sh    (carry .deps)
# Logs in $OUT/frozen-hsdp, the CPU benchmark as JSON beside them.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-frozen}
OUT_DIR=$OUT/frozen-hsdp
LOG=$OUT_DIR/frozen-hsdp.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

say "configure + build"
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=ON -DZERO_BUILD_BENCH=ON \
  "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT_DIR/configure.log" 2>&1 || { tail -20 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
timeout 420 ninja -C "$BUILD" zero_gpu_engine_tests zero_gpu_tests bench_cpu_optimizer > "$OUT_DIR/build.log" 2>&1 || { grep -E "error" -A5 "$OUT_DIR/build.log" | head -40 | tee -a "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
for np in 1 2; do
  say "GPU engine tests np $np"
  timeout 300 mpirun -np $np --oversubscribe --bind-to none "$BUILD/tests/gpu_engine/zero_gpu_engine_tests" \
    > "$OUT_DIR/gpu-engine-np$np.log" 2>&1
  echo "gpu engine np$np: exit $?" | tee -a "$LOG"
  grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-engine-np$np.log" | head -12 | tee -a "$LOG"
  say "GPU communicator tests np $np"
  timeout 200 mpirun -np $np --oversubscribe --bind-to none "$BUILD/tests/gpu/zero_gpu_tests" --test-case='comm*' \
    > "$OUT_DIR/gpu-comm-np$np.log" 2>&1
  echo "gpu comm np$np: exit $?" | tee -a "$LOG"
  grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-comm-np$np.log" | head -12 | tee -a "$LOG"
done
say "CPU optimizer kernel, one group vs four groups, $(nproc) cores"
OMP_NUM_THREADS=$(nproc) timeout 200 "$BUILD/bench/cpu/bench_cpu_optimizer" \
  --benchmark_filter='Vectorized_bf16|Memcpy' --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  --benchmark_out="$OUT_DIR/cpu-optimizer-groups.json" --benchmark_out_format=json 2>&1 | tee -a "$LOG" | tail -20
say "done"
