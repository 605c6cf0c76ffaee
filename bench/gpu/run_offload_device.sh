#!/usr/bin/env bash
# Issue 6 on one GPU: the full SDXL trainer (sdxl-1024.toml: bf16, AdamW, EMA,
# checkpointing) with the optimizer (and at stage 3 the parameters) offloaded
# to host memory, under GPU memory caps; the un-offloaded runs that must fail
# fast under the same cap; offloaded against on-device throughput at batch 8;
# the GPU engine tests. While each run trains, nvidia-smi samples the GPU's
# memory in use every 5 ms (NVML: no CUDA context of its own), so the true
# in-step peak is recorded next to the planner's prediction and the trainer's
# between-steps metric.
#   PHASES="build tests cap24 cap12 b8" bash bench/gpu/run_offload_device.sh
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

run() {  # name, limit seconds, then trainer options
  local name=$1 limit=$2
  shift 2
  step "$name: $*"
  rm -rf "/tmp/$name"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 5 > "$OUT/offload/$name.smi" 2>/dev/null &
  local poller=$! start end
  sleep 0.5
  start=$(date +%s.%N)
  timeout "$limit" mpirun -np 1 --bind-to none "$BUILD/examples/sdxl/train" --config examples/sdxl/configs/sdxl-1024.toml \
    --steps "$STEPS" --warmup_steps 5 --log_every 5 --checkpoint_every 0 --save_final false --export_unet false \
    --output_dir "/tmp/$name" "$@" > "$OUT/offload/$name.log" 2>&1
  local code=$?
  end=$(date +%s.%N)
  kill "$poller" 2>/dev/null; wait "$poller" 2>/dev/null
  grep -E "memory plan|block cache|GPU memory cap|error|Error|step +[0-9]+|^ *[0-9]+/" "$OUT/offload/$name.log" | tail -8 | tee -a "$LOG"
  python3 - "$OUT/offload/$name.smi" <<'PY' | tee -a "$LOG"
import sys
v = [int(x) for x in open(sys.argv[1]).read().split() if x.strip().isdigit()]
if v:
    print(f"nvidia-smi: baseline {v[0]} MiB, peak {max(v)} MiB, in-step peak of the run {(max(v) - v[0]) / 1024:.2f} GiB ({len(v)} samples)")
PY
  echo "exit $code, wall $(python3 -c "print(round($end-$start,1))") s" | tee -a "$LOG"
  cp "/tmp/$name/metrics.jsonl" "$OUT/offload/$name.jsonl" 2>/dev/null
}

if has cap24; then
  # Must fail fast with the planner's message: no offload under 24 GiB.
  run sdxl-stage0-b1-cap24-nooffload 90 --stage 0 --batch_size 1 --max_gpu_memory 24GiB
  run sdxl-stage2-b1-cap24-offload 200 --stage 2 --batch_size 1 --offload_optimizer true --max_gpu_memory 24GiB
fi
if has cap12; then
  run sdxl-stage3-b1-cap12-offload-params 200 --stage 3 --batch_size 1 --offload_optimizer true --offload_params true \
    --max_gpu_memory 12GiB
fi
if has b8; then
  # Throughput at batch 8: offloaded against on-device, same stage, same session.
  run sdxl-stage2-b8-offload 170 --stage 2 --batch_size 8 --offload_optimizer true
  run sdxl-stage2-b8-device 120 --stage 2 --batch_size 8
fi

python3 - "$OUT/offload" <<'PY' | tee -a "$LOG"
import glob, json, os, sys
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "sdxl-*.jsonl"))):
    recs = [json.loads(l) for l in open(path) if l.strip()]
    recs = [r for r in recs if r.get("images_per_s")]
    if not recs:
        continue
    tail = [r for r in recs if r["step"] > 5] or recs
    ips = sum(r["images_per_s"] for r in tail) / len(tail)
    name = os.path.basename(path)[:-6]
    row = {"name": name, "steps": recs[-1]["step"], "images_per_s": round(ips, 3),
           "mfu": round(ips * 20.62e12 / 989e12, 4),
           "between_steps_peak_gib": round(max(r["mem_max_bytes"] for r in recs) / 2**30, 2),
           "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}
    smi = os.path.join(sys.argv[1], name + ".smi")
    if os.path.exists(smi):
        v = [int(x) for x in open(smi).read().split() if x.strip().isdigit()]
        if v:
            row["in_step_peak_gib_nvidia_smi"] = round((max(v) - v[0]) / 1024, 2)
    rows.append(row)
    print(json.dumps(row))
json.dump(rows, open(os.path.join(sys.argv[1], "summary.json"), "w"), indent=1)
PY
step "done"
cd "$OUT" && tar czf offload.tgz offload && rm -rf offload
