#!/usr/bin/env bash
# Issue 8 on one GPU: where the SDXL step's time goes. unet_bench (the UNet
# alone) eager and in a CUDA graph, with each attention kernel, Kineto traces
# summed by kernel family (kernel_summary.py), and the trainer's step traced
# (--profile_step) at batches 1 and 8.
#   PHASES="build bench graph trace train" bash bench/gpu/run_speed_probe_device.sh
# Logs and summaries in $OUT/probe, packed into probe.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-speed-build}
PHASES=${PHASES:-"build bench graph trace train"}
OUT_DIR=$OUT/probe
LOG=$OUT_DIR/probe.log
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
say() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
BENCH=$BUILD/examples/sdxl/unet_bench
bench() {  # bench NAME LIMIT [unet_bench options]
  local name=$1 limit=$2; shift 2
  say "unet_bench $name: $*"
  timeout "$limit" "$BENCH" --device cuda --dtype bf16 --backward --json "$OUT_DIR/unet-bench.jsonl" "$@" \
    > "$OUT_DIR/bench-$name.log" 2>&1
  echo "exit $?" >> "$OUT_DIR/bench-$name.log"
  grep -E "forward|captured|error|exit" "$OUT_DIR/bench-$name.log" | tail -3 | tee -a "$LOG"
}

if has build; then
  say "configure + build"
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=ON -DZERO_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT_DIR/configure.log" 2>&1 || { tail -30 "$OUT_DIR/configure.log" | tee -a "$LOG"; exit 1; }
  timeout "${BUILD_LIMIT:-400}" ninja -C "$BUILD" ${TARGETS:-train unet_bench} > "$OUT_DIR/build.log" 2>&1 || { grep -E "error" -A5 "$OUT_DIR/build.log" | head -60 | tee -a "$LOG"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
fi
if has tests; then
  for t in zero_sdxl_geglu_tests zero_sdxl_group_norm_nhwc_tests; do
    [ -x "$BUILD/tests/sdxl/$t" ] || continue
    say "$t --gpu"
    timeout 300 "$BUILD/tests/sdxl/$t" --gpu > "$OUT_DIR/$t.log" 2>&1
    echo "exit $?" >> "$OUT_DIR/$t.log"
    grep -E "test cases|assertions|ERROR|exit" "$OUT_DIR/$t.log" | head -20 | tee -a "$LOG"
  done
  if [ -x "$BUILD/tests/gpu_engine/zero_gpu_engine_tests" ]; then
    say "GPU engine tests np 1 (NCCL, one rank)"
    timeout 240 mpirun -np 1 --bind-to none "$BUILD/tests/gpu_engine/zero_gpu_engine_tests" > "$OUT_DIR/gpu-engine-np1.log" 2>&1
    echo "exit $?" | tee -a "$LOG"
    grep -E "test cases|assertions|ERROR" "$OUT_DIR/gpu-engine-np1.log" | head -12 | tee -a "$LOG"
  fi
fi
if has bench; then
  for attn in ${ATTENTION:-default}; do
    bench "b8-$attn" 120 --batch 8 --steps 4 --warmup 2 --attention "$attn"
  done
  bench b8-channels-last 120 --batch 8 --steps 4 --warmup 2 --channels_last
fi
if has graph; then
  bench b1-eager 120 --batch 1 --steps 10 --warmup 3
  bench b1-graph 120 --batch 1 --steps 10 --warmup 3 --cuda_graph
  bench b8-graph 150 --batch 8 --steps 4 --warmup 2 --cuda_graph
fi
if has trace; then
  bench b8-trace 150 --batch 8 --steps 1 --warmup 2 --profile "$OUT_DIR/unet-b8.trace.json"
  bench b1-trace 120 --batch 1 --steps 2 --warmup 3 --profile "$OUT_DIR/unet-b1.trace.json"
fi
if has train; then
  STEPS=${STEPS:-12}
  source bench/gpu/trainer_run.sh
  run_trainer sdxl-stage2-b1-nockpt 150 --stage 2 --batch_size 1 --activation_checkpointing false --profile_step 10 ${TRAIN_ARGS:-}
  cp /tmp/sdxl-stage2-b1-nockpt/profile-step-10.json "$OUT_DIR/train-b1.trace.json" 2>/dev/null
  run_trainer sdxl-stage2-b1-ckpt 150 --stage 2 --batch_size 1 --activation_checkpointing true ${TRAIN_ARGS:-}
  run_trainer sdxl-stage2-b8-nockpt 150 --stage 2 --batch_size 8 --activation_checkpointing false --profile_step 10 ${TRAIN_ARGS:-}
  cp /tmp/sdxl-stage2-b8-nockpt/profile-step-10.json "$OUT_DIR/train-b8.trace.json" 2>/dev/null
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
if has graph_train; then
  # [device] cuda_graph against eager at stage 0 (the graph needs the full
  # gradient buffer), without EMA as the reference step has none, then with.
  STEPS=${STEPS:-20}
  source bench/gpu/trainer_run.sh
  common="--stage 0 --activation_checkpointing false"
  run_trainer sdxl-stage0-b1-eager-noema 150 $common --batch_size 1 --ema_decay 0
  run_trainer sdxl-stage0-b1-graph-noema 150 $common --batch_size 1 --ema_decay 0 --cuda_graph true
  run_trainer sdxl-stage0-b1-graph 150 $common --batch_size 1 --cuda_graph true
  run_trainer sdxl-stage1-b1-graph-noema 150 --stage 1 --activation_checkpointing false --batch_size 1 --ema_decay 0 --cuda_graph true
  run_trainer sdxl-stage0-b8-eager-noema 150 $common --batch_size 8 --ema_decay 0
  run_trainer sdxl-stage0-b8-graph-noema 150 $common --batch_size 8 --ema_decay 0 --cuda_graph true
  python3 - "$OUT_DIR" <<'PY' | tee -a "$LOG"
import json, sys, os
d = sys.argv[1]
def losses(name):
    p = os.path.join(d, name + ".jsonl")
    return [json.loads(l)["loss"] for l in open(p)] if os.path.exists(p) else []
for a, b in [("sdxl-stage0-b1-eager-noema", "sdxl-stage0-b1-graph-noema"), ("sdxl-stage0-b8-eager-noema", "sdxl-stage0-b8-graph-noema")]:
    la, lb = losses(a), losses(b)
    n = min(len(la), len(lb))
    diff = max((abs(x - y) for x, y in zip(la, lb)), default=float("nan"))
    same = sum(x == y for x, y in zip(la, lb))
    print(f"losses {a} vs {b}: {n} steps, {same} bitwise equal, max |diff| {diff:.3g}")
PY
  summarize_runs "$OUT_DIR" | tee -a "$LOG"
fi
traces=$(ls "$OUT_DIR"/*.trace.json 2>/dev/null)
if [ -n "$traces" ]; then
  python3 bench/gpu/kernel_summary.py $traces --json "$OUT_DIR/kernel-summary.json" --top 30 > "$OUT_DIR/kernel-summary.txt" 2>&1
  cat "$OUT_DIR/kernel-summary.txt" >> "$LOG"
  mkdir -p "$OUT/traces" && for t in $traces; do gzip -c "$t" > "$OUT/traces/$(basename "$t").gz"; rm "$t"; done
fi
cd "$OUT" && tar czf probe.tgz probe && rm -rf probe
