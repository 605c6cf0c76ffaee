#!/usr/bin/env bash
# One call on the H200 (session 10, 2026-12-04): the whole `cuda` preset from an empty build folder,
# every CTest labelled `gpu` (tools/gpu-tests.sh without the speed suite), and a backtrace of the
# sdxl.vae_clip crash seen with LibTorch 2.11 (cuda-gdb: the machine has no gdb).
#   rm -rf build/cuda; bash bench/gpu/run_session10_tests.sh      (carry .deps)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
mkdir -p "$OUT/s10"
LOG=$OUT/s10/tests.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
say "build the whole cuda preset"
( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build ) 2>&1 | tail -30 | tee -a "$LOG"
cp build/cuda/zero-build.log "$OUT/s10/" 2>/dev/null
say "sdxl.vae_clip under cuda-gdb (backtrace of the crash, if any)"
bin=$(find build/cuda -name zero_sdxl_vae_clip_tests -type f | head -1)
(cd "$(dirname "$bin")" && timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PWD/$(basename "$bin")" \
   -tc="pipeline folder*" ) > "$OUT/s10/vae_clip_gdb.log" 2>&1
grep -n -E "SIGSEGV|^#[0-9]+|status|passed|failed" "$OUT/s10/vae_clip_gdb.log" | head -60 | tee -a "$LOG"
grep -rn "nlohmann" build/cuda/CMakeCache.txt | head -5 | tee -a "$LOG"
find / -path /proc -prune -o -name json.hpp -path "*nlohmann*" -print 2>/dev/null | head -10 | tee -a "$LOG"
say "every gpu test: SPEED=0 tools/gpu-tests.sh"
SPEED=0 OUT=$OUT/s10/gpu-tests timeout 360 bash tools/gpu-tests.sh 2>&1 | tail -40 | tee -a "$LOG"
say "done"
