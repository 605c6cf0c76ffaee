#!/usr/bin/env bash
# The test command: installs what is needed, builds every CPU target, runs
# every test (unit, MPI at several world sizes, install, io, SDXL on CPU),
# runs the CPU tests again under ASan+UBSan,
# and compiles and links the CUDA build where nvcc is present (it cannot run
# without a GPU; GPU tests are labelled `gpu` and run on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's start, minutes into the run: where CI's time goes.
phase() { echo "== [$(( SECONDS / 60 )) min $(( SECONDS % 60 )) s] $*"; }
phase "install"
bash tools/install-deps.sh
export OMPI_MCA_rmaps_base_oversubscribe=1
jobs=$(nproc)

phase "build cpu-torch"
cmake --preset cpu-torch
cmake --build --preset cpu-torch -j "$jobs"
phase "test cpu-torch"
ctest --preset cpu-torch -j 1 --timeout 1200

echo "== The CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer =="
# Leak checking is off: Open MPI's own allocations at exit are reported as leaks.
# The fault test (kill -9 / hang) is left out: it is about signals, not memory.
# The preset compiles with -O1 -g1 (ASan's advice; line tables are enough for its
# stack traces): half the compile time of -O2 -g (64 -> 31 s for test_planner.cpp).
phase "build sanitize"
cmake --preset sanitize
cmake --build --preset sanitize -j "$jobs"
phase "test sanitize"
ctest --preset sanitize -j 1 --timeout 1200

if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA build (compile and link only: no GPU here) =="
  # Exactly as the README names it. Here LibTorch is Debian's CPU-only one:
  # ZERO_WITH_TORCH=AUTO leaves the torch parts out of the CUDA build (with a
  # CMake warning saying so); on a GPU machine with a CUDA LibTorch they build.
  phase "build cuda"
  cmake --preset cuda
  cmake --build --preset cuda -j "$jobs"
fi
phase "done"
