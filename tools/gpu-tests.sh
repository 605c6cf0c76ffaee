#!/usr/bin/env bash
# Every GPU test and the speed suite, on a machine with NVIDIA GPUs, CUDA,
# NCCL and a CUDA build of PyTorch (pip) or LibTorch (LIBTORCH=/path; see
# tools/gpu-common.sh for how it is found, tools/gpu-quickstart.sh for the
# first run). Builds the whole `cuda` preset, runs the CTest tests labelled
# `gpu` (ctest --preset gpu), then the speed suite: bench/gpu/run_speed_device.sh,
# the SDXL trainer at 1024x1024 at stages 0-3 and batches 8 and 1 next to the
# UNet's forward+backward alone (README, Benchmarks; bench/results/speed.md).
#
#   bash tools/gpu-tests.sh                  # tests, then the speed suite
#   SPEED=0 bash tools/gpu-tests.sh          # the tests only
#   STEPS=10 bash tools/gpu-tests.sh         # a shorter speed suite (default 20 steps a run)
#
# Output under OUT (default runs/gpu-tests): ctest.log, speed/ (logs, JSON
# lines, summary.json, packed into speed.tgz). Exit status: non-zero when a
# test failed or a speed run failed. Run again, it only rebuilds what changed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source tools/gpu-common.sh
OUT=${OUT:-runs/gpu-tests}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
status=0

gpu_check_prerequisites
gpu_build  # everything: the tests and benches of the preset

gpu_say "ctest -L gpu (ctest --preset gpu)"
# The preset reads build/cuda; another BUILD_DIR (no ninja) is named directly.
if [ "$BUILD_DIR" = build/cuda ]; then
  ctest --preset gpu --timeout 900 2>&1 | tee "$OUT/ctest.log"
else
  ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 900 2>&1 | tee "$OUT/ctest.log"
fi
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${SPEED:-1}" != 0 ]; then
  gpu_say "speed suite: bench/gpu/run_speed_device.sh (BUILD=$BUILD_DIR, OUT=$OUT)"
  rm -rf "$OUT/speed" "$OUT/speed.tgz"
  OUT=$OUT BUILD=$PWD/$BUILD_DIR STEPS=${STEPS:-20} bash bench/gpu/run_speed_device.sh || status=1
  tar xzf "$OUT/speed.tgz" -C "$OUT" 2> /dev/null
  if [ -s "$OUT/speed/summary.json" ]; then
    python3 - "$OUT/speed/summary.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'run':44} {'images/s':>9} {'MFU':>6} {'in-step peak GiB':>17}")
for r in rows:
    print(f"{r['name']:44} {r['images_per_s']:9.2f} {r['mfu']:6.1%} {r.get('in_step_peak_gib_nvidia_smi', float('nan')):17.2f}")
PY
  else
    echo "gpu-tests: the speed suite wrote no summary (see $OUT/speed.tgz)" >&2
    status=1
  fi
fi
if [ "$status" -eq 0 ]; then gpu_say "all GPU tests passed"; else gpu_say "FAILED: see $OUT"; fi
exit "$status"
