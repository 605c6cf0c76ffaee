#!/usr/bin/env bash
# The benchmark suite in one command. On a GPU machine it runs the device scripts
# in turn; each configures and builds its own build folder and calls mpirun itself.
# It also runs the CPU benches of the engine step and of the CPU AdamW against
# LibTorch, built in run_device.sh's folder. The JSON goes into bench/results
# under the names the report reads, with command, GPU and date in
# bench/results/provenance.json. Then it writes the report:
# bench/results/report/report.md and figures/*.svg.
# Without nvidia-smi it runs nothing and only regenerates the report from the
# recorded results.
#   bash bench/report/run_suite.sh                 # from anywhere in the repository
#   SCRIPTS="run_device" bash bench/report/run_suite.sh   # a subset
# Like the device scripts, it needs .deps/ (toml++, CLI11 headers).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
RESULTS=${RESULTS:-bench/results}
# The scripts' $OUT folders, fresh for every run (so no earlier run's file passes for a new one).
RUN=${RUN:-/tmp/zero-bench-suite/$(date -u +%Y%m%d-%H%M%S)}
RUN=$(mkdir -p "$RUN" && cd "$RUN" && pwd)
SCRIPTS=${SCRIPTS:-"run_device run_sdxl_train_device run_offload_device run_speed_device"}
DEV_BUILD=build/dev  # run_device.sh's build folder (benchmark + LibTorch found there)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
status=0

# keep SRC DEST COMMAND START [GPU]: copy a result into $RESULTS; record where it came from.
keep() {
  if [ ! -s "$1" ]; then echo "run_suite: $1 was not written (see the logs in $RUN)"; status=1; return; fi
  mkdir -p "$(dirname "$RESULTS/$2")" && cp "$1" "$RESULTS/$2"
  python3 - "$RESULTS/provenance.json" "$2" "$3" "${5:-$GPU}" "$4" <<'PY'
import json, os, sys
path, name, command, gpu, date = sys.argv[1:]
doc = json.load(open(path)) if os.path.exists(path) else {}
doc[name] = {"command": command, "gpu": gpu, "date": date}
json.dump(doc, open(path, "w"), indent=1, sort_keys=True)
PY
}
has() { [[ " $SCRIPTS " == *" $1 "* ]]; }
now() { date -u +%Y-%m-%dT%H:%M:%SZ; }

if ! command -v nvidia-smi > /dev/null; then
  echo "run_suite: nvidia-smi not found: no GPU runs; regenerating the report from the recorded results in $RESULTS"
else
  GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
  CPU_ONLY="none: CPU bench on the host of the $GPU machine ($(nproc) cores)"
  if has run_device; then
    start=$(now)
    OUT=$RUN/device bash bench/gpu/run_device.sh || status=1
    for f in gpu-optimizer.json gpu-collectives-nccl-np1.json gpu-collectives-staged-np1.json; do
      keep "$RUN/device/$f" "$f" "bash bench/gpu/run_device.sh (writes $f)" "$start"
    done
    # The CPU benches, in the build run_device.sh configured (ZERO_BUILD_BENCH is on there;
    # the AdamW-against-LibTorch bench exists only when LibTorch was found).
    start=$(now)
    mkdir -p "$RUN/cpu"
    for target in bench_engine_step bench_cpu_adamw_vs_torch; do
      timeout 600 ninja -C "$DEV_BUILD" "$target" >> "$RUN/cpu/build.log" 2>&1 ||
        { echo "run_suite: building $target failed (see $RUN/cpu/build.log)"; status=1; }
    done
    if [ -x "$DEV_BUILD/bench/mpi/bench_engine_step" ]; then
      for np in 1 2 4; do
        cmd="mpirun -np $np $DEV_BUILD/bench/mpi/bench_engine_step --params 32 --iterations 3"
        timeout 300 mpirun -np $np --oversubscribe --bind-to none "$DEV_BUILD/bench/mpi/bench_engine_step" --params 32 \
          --iterations 3 --json "$RUN/cpu/cpu-engine-step-np$np.json" || status=1
        keep "$RUN/cpu/cpu-engine-step-np$np.json" "cpu-engine-step-np$np.json" "$cmd" "$start" "$CPU_ONLY"
      done
    fi
    if [ -x "$DEV_BUILD/bench/cpu/bench_cpu_adamw_vs_torch" ]; then
      timeout 600 "$DEV_BUILD/bench/cpu/bench_cpu_adamw_vs_torch" --benchmark_out="$RUN/cpu/cpu-adamw-vs-torch.json" \
        --benchmark_out_format=json || status=1
      keep "$RUN/cpu/cpu-adamw-vs-torch.json" cpu-adamw-vs-torch.json \
        "$DEV_BUILD/bench/cpu/bench_cpu_adamw_vs_torch --benchmark_out=cpu-adamw-vs-torch.json --benchmark_out_format=json" \
        "$start" "$CPU_ONLY"
    fi
  fi
  if has run_sdxl_train_device; then
    start=$(now)
    # expandable segments as in the recorded runs (sdxl-gpu.md)
    OUT=$RUN/sdxl-train PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bash bench/gpu/run_sdxl_train_device.sh || status=1
    keep "$RUN/sdxl-train/sdxl-train-summary.json" sdxl-train-summary.json \
      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bash bench/gpu/run_sdxl_train_device.sh" "$start"
    mkdir -p "$RESULTS/sdxl-train" && cp "$RUN"/sdxl-train/sdxl-1024-stage*-b*.{jsonl,log} "$RESULTS/sdxl-train/" 2> /dev/null
  fi
  # These two pack their folder into a .tgz; unpacked, it is $RESULTS/offload and $RESULTS/speed.
  for part in offload speed; do
    has "run_${part}_device" || continue
    start=$(now)
    OUT=$RUN/$part bash "bench/gpu/run_${part}_device.sh" || status=1
    tar xzf "$RUN/$part/$part.tgz" -C "$RUN/$part" 2> /dev/null
    keep "$RUN/$part/$part/summary.json" "$part/summary.json" "bash bench/gpu/run_${part}_device.sh" "$start"
    cp "$RUN/$part/$part"/*.{jsonl,log} "$RESULTS/$part/" 2> /dev/null
  done
fi

python3 bench/report/bench_report.py --results "$RESULTS" --out "${REPORT:-$RESULTS/report}" || exit $?
exit $status
