#!/usr/bin/env bash
# One pass on a GPU machine: configure (LibTorch from the local PyTorch when
# there is one), build zero's GPU targets only, run the GPU tests, zero-info
# and both benches. Logs and JSON go to $OUT (default /tmp/zero-device-out).
#
#   bash bench/gpu/run_device.sh            # from the repository root
#
# Each step has its own time limit so that one hang cannot eat the others'.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-build/dev}
mkdir -p "$OUT"
LOG=$OUT/all.log
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
step() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

step "machine"
{ nvidia-smi; nvcc --version | tail -2; cmake --version | head -1; mpirun --version | head -1; } 2>&1 | tee -a "$LOG"

step "configure"
TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
configure() {
  timeout 240 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_EXAMPLES=OFF "$@" 2>&1 | tee -a "$LOG" | tail -5
}
if ! configure -DZERO_WITH_TORCH=AUTO ${TORCH_PREFIX:+-DCMAKE_PREFIX_PATH=$TORCH_PREFIX}; then
  step "configure with LibTorch failed; again without it"
  rm -rf "$BUILD"
  configure -DZERO_WITH_TORCH=OFF
fi

step "build"
TARGETS="zero_gpu_tests gpu_bench_optimizer gpu_bench_collectives zero-info"
if ! timeout 360 ninja -C "$BUILD" $TARGETS > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log" | tee -a "$LOG"
  step "build of all targets failed; building each on its own"
  for t in $TARGETS; do timeout 200 ninja -C "$BUILD" "$t" >> "$OUT/build.log" 2>&1 || echo "FAILED: $t" | tee -a "$LOG"; done
fi
grep -E "warning|error" "$OUT/build.log" | grep -v "^ninja" | head -20 | tee -a "$LOG"

step "zero-info, 1 rank and 2 ranks (2 ranks on 1 GPU must say: shared, exit 4)"
timeout 60 "$BUILD/zero-info" 2>&1 | tee -a "$LOG"; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
timeout 60 mpirun -np 2 --oversubscribe --allow-run-as-root "$BUILD/zero-info" 2>&1 | tee -a "$LOG"; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"

step "tests (label gpu)"
timeout 420 ctest --test-dir "$BUILD" -L gpu -R '^gpu[.](kernels|comm)' --output-on-failure --timeout 300 2>&1 | tee "$OUT/tests.log" | tail -15 | tee -a "$LOG"
# doctest's per-case summary lines and skip messages, for the record
grep -hE "test cases|skipped|MESSAGE" "$OUT/tests.log" | sort | uniq -c | head -20 | tee -a "$LOG"

step "bench: optimizer"
timeout 240 "$BUILD/bench/gpu/gpu_bench_optimizer" --json "$OUT/gpu-optimizer.json" 2>&1 | tee -a "$LOG"

step "bench: collectives, NCCL, world 1"
timeout 120 "$BUILD/bench/gpu/gpu_bench_collectives" --json "$OUT/gpu-collectives-nccl-np1.json" 2>&1 | tee -a "$LOG"

step "bench: collectives, staged over MPI, world 1 (to 256 MiB)"
timeout 120 "$BUILD/bench/gpu/gpu_bench_collectives" --staged --max-bytes 256M \
  --json "$OUT/gpu-collectives-staged-np1.json" 2>&1 | tee -a "$LOG"

if [ "${ZERO_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  step "ncu: speed of light of the AdamW kernel (2^26 params)"
  timeout 120 ncu --clock-control none --kernel-name-base demangled --kernel-name regex:OptimizerOp \
    --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    "$BUILD/bench/gpu/gpu_bench_optimizer" --log2-params 26 --no-sweep --iters 10 --warmup 1 \
    > "$OUT/ncu.log" 2>&1
  grep -E "DRAM Throughput|Memory Throughput|Duration|elementwise|Achieved Occupancy|Registers" "$OUT/ncu.log" | head -20 | tee -a "$LOG"
fi
if [ "${ZERO_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer > /dev/null; then
  step "compute-sanitizer memcheck: kernel and backend tests, small sizes"
  ZERO_GPU_TEST_QUICK=1 timeout 240 compute-sanitizer --tool memcheck --leak-check no \
    "$BUILD/tests/gpu/zero_gpu_tests" --test-case-exclude='comm*' > "$OUT/sanitizer.log" 2>&1
  echo "exit $?" >> "$OUT/sanitizer.log"
  tail -8 "$OUT/sanitizer.log" | tee -a "$LOG"
fi
step "done"
