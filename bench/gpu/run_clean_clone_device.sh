#!/usr/bin/env bash
# Issue 20's "from a clean clone" checks on the GPU machine: the README's two
# GPU commands (tools/gpu-quickstart.sh, tools/gpu-tests.sh) run in a git clone
# of main, not in the working tree the device tool copies. Here (before the
# device call):
#   mkdir -p runs && git bundle create runs/main.bundle main
# then on the device (carry .deps and runs/main.bundle):
#   PHASES="quickstart partial" bash bench/gpu/run_clean_clone_device.sh
#  quickstart: clone runs/main.bundle into runs/clean (kept while the machine
#              stays warm), copy .deps beside it (toml++ is not on the
#              machine), run tools/gpu-quickstart.sh: sdxl-1024.toml, stage 2,
#              batch 8, so checkpoint_units = "fit" decides on this GPU
#              (predicted on an H200: nothing recomputed, 17.8 images/s);
#  partial:    the same clone's bench/gpu/run_session20_device.sh, RUNS
#              (default "all fit-cap80": every unit recomputed, and "fit"
#              under an 80 GB card's memory);
#  tests:      tools/gpu-tests.sh in the clone: the whole cuda preset and
#              every CTest test labelled gpu, and with SPEED=1 the speed suite
#              after them (the README's command as it is; default SPEED=0);
#  offload:    the clone's bench/gpu/run_session27_device.sh, phase ab, with
#              its trainer (built by quickstart): on-device AdamW + EMA at
#              batch 8, stage 2, then offloaded (offload_optimizer, delayed
#              update, EMA on the GPU) ROUNDS times (default 1) for each of
#              VARIANTS (default new; see that script);
#  fit:        its phase fit: --fit under each of FIT_SIZES (default 12GiB) at
#              global batch 8.
# Output under $OUT/clean (quickstart.log, its metrics.jsonl, s20.tgz,
# gpu-tests/ctest.log and speed.tgz, s27-*.tgz): few files, since the device
# brings back only a handful.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
OUT_DIR=$OUT/clean
PHASES=${PHASES:-quickstart partial}
mkdir -p "$OUT_DIR"
has() { [[ " $PHASES " == *" $1 "* ]]; }
if [ ! -d runs/clean/.git ]; then
  [ -f runs/main.bundle ] || { echo "no runs/main.bundle: git bundle create runs/main.bundle main, and carry it" >&2; exit 1; }
  git clone -q -b main runs/main.bundle runs/clean || exit 1
fi
[ -d .deps ] && cp -r .deps runs/clean/
cd runs/clean || exit 1
git log --oneline -1 | tee "$OUT_DIR/commit.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT_DIR/commit.txt"
if has quickstart; then
  STEPS=${STEPS:-12} bash tools/gpu-quickstart.sh > "$OUT_DIR/quickstart.log" 2>&1
  echo "quickstart exit $?" | tee -a "$OUT_DIR/quickstart.log"
  grep -E "checkpoint_units|memory plan|images/s|GiB" "$OUT_DIR/quickstart.log" | tail -12
  cp runs/gpu-quickstart/run/metrics.jsonl "$OUT_DIR/quickstart-metrics.jsonl" 2>/dev/null
fi
if has partial; then
  OUT=$OUT_DIR PHASES="build partial" TARGETS="train zero-plan" RUNS=${RUNS:-all fit-cap80} STEPS=${STEPS:-12} \
    bash bench/gpu/run_session20_device.sh > /dev/null 2>&1
  tail -30 "$OUT_DIR/s20/run.log"
  (cd "$OUT_DIR" && tar czf s20.tgz s20 && rm -rf s20)
fi
if has offload || has fit; then
  s27_phases="$(has offload && echo ab) $(has fit && echo fit)"
  OUT=$OUT_DIR PHASES="$s27_phases" VARIANTS=${VARIANTS:-new} ROUNDS=${ROUNDS:-1} FIT_SIZES=${FIT_SIZES:-12GiB} \
    STEPS=${STEPS:-16} bash bench/gpu/run_session27_device.sh > /dev/null 2>&1
  tail -25 "$OUT_DIR/session27/run.log"
  (cd "$OUT_DIR" && rm -f session27/*.smi && tar czf "s27-${s27_phases// /}.tgz" session27 && rm -rf session27)
fi
if has tests; then
  SPEED=${SPEED:-0} OUT="$OUT_DIR/gpu-tests" bash tools/gpu-tests.sh > "$OUT_DIR/gpu-tests.log" 2>&1
  echo "gpu-tests exit $?" | tee -a "$OUT_DIR/gpu-tests.log"
  grep -E "Test +#|tests passed|FAIL|images/s|sdxl-" "$OUT_DIR/gpu-tests.log" | tail -40
  rm -rf "$OUT_DIR/gpu-tests/speed"  # unpacked by gpu-tests.sh; speed.tgz stays (few files come back)
fi
