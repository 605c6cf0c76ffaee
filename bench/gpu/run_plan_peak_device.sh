#!/usr/bin/env bash
# The planner's "peak" against the true in-step peak: the SDXL trainer on one
# GPU (sdxl-1024.toml: bf16, AdamW, EMA, checkpointing) at the stages and
# batches given, while a second process samples cudaMemGetInfo every ~1 ms
# (device-wide, its own context subtracted). The trainer's own metric samples
# only between steps; docs/planner.md compares both with zero-plan.
#   STAGES="0 2 3" BATCHES="1 8" bash bench/gpu/run_plan_peak_device.sh
# Builds like run_sdxl_train_device.sh (SKIP_BUILD=1 reuses the build).
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-build/sdxl-dev}
STAGES=${STAGES:-"0 2 3"}
BATCHES=${BATCHES:-"1 8"}
STEPS=${STEPS:-12}
mkdir -p "$OUT"
LOG=$OUT/plan-peak.log
if [ -z "${SKIP_BUILD:-}" ]; then
  # (Not through run_sdxl_train_device.sh: its STAGES="" means its default, all runs.)
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=OFF -DZERO_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  timeout "${BUILD_LIMIT:-420}" ninja -C "$BUILD" train > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
fi
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
cat > /tmp/poll_gpu_memory.py <<'PY'
import json, signal, sys, time
import torch
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
base = total - free  # this process's own context
peak, samples, stop = 0, 0, False
def on_term(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".ready", "w").close()
while not stop:
    free, total = torch.cuda.mem_get_info()
    peak = max(peak, total - free - base)
    samples += 1
    time.sleep(0.0005)
json.dump({"peak_bytes": peak, "poller_context_bytes": base, "samples": samples}, open(sys.argv[1], "w"))
PY
for batch in $BATCHES; do
  for stage in $STAGES; do
    name="plan-peak-stage$stage-b$batch"
    rm -rf "/tmp/$name" "$OUT/$name.poll.json" "$OUT/$name.poll.json.ready"
    python3 /tmp/poll_gpu_memory.py "$OUT/$name.poll.json" &
    poller=$!
    for _ in $(seq 100); do [ -f "$OUT/$name.poll.json.ready" ] && break; sleep 0.1; done
    timeout 240 mpirun -np 1 "$BUILD/examples/sdxl/train" --config examples/sdxl/configs/sdxl-1024.toml \
      --stage "$stage" --batch_size "$batch" --steps "$STEPS" --warmup_steps 10 --log_every 1 --checkpoint_every 0 \
      --save_final false --export_unet false --output_dir "/tmp/$name" > "/tmp/$name.log" 2>&1
    code=$?
    kill -TERM "$poller"; wait "$poller"
    rm -f "$OUT/$name.poll.json.ready"
    python3 - "$OUT/$name.poll.json" "/tmp/$name/metrics.jsonl" "$stage" "$batch" "$code" <<'PY' | tee -a "$LOG"
import json, sys
poll = json.load(open(sys.argv[1]))
try:
    recs = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
except OSError:
    recs = []
G = 2**30
between = max((r["mem_max_bytes"] for r in recs), default=0) - poll["poller_context_bytes"]
print(json.dumps({"stage": int(sys.argv[3]), "batch": int(sys.argv[4]), "exit": int(sys.argv[5]), "steps": len(recs),
                  "between_steps_gib": round(between / G, 2), "in_step_peak_gib": round(poll["peak_bytes"] / G, 2),
                  "poller_context_gib": round(poll["poller_context_bytes"] / G, 2), "samples": poll["samples"]}))
PY
    [ $code -ne 0 ] && tail -5 "/tmp/$name.log" | tee -a "$LOG"
  done
done
