#!/usr/bin/env bash
# Issue 6 on one GPU: the CPU optimizer against LibTorch's CPU AdamW paths,
# then the full SDXL trainer (sdxl-1024.toml) with the optimizer offloaded to
# host memory, under GPU memory caps, and the un-offloaded runs that must
# fail fast under the same cap. Logs and JSON lines go to $OUT (packed into
# offload.tgz at the end: the device tool returns at most 8 files).
#   bash bench/gpu/run_offload_device.sh
# Needs .deps/ (toml++, CLI11 headers) carried along; SKIP_BUILD=1 reuses the build.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-/root/zero-offload-build}
STEPS=${STEPS:-30}
mkdir -p "$OUT/offload"
LOG=$OUT/offload/offload.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
step() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if [ -z "${SKIP_BUILD:-}" ]; then
  step "configure"
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=OFF -DZERO_BUILD_BENCH=ON \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT/offload/configure.log" 2>&1 || { tail -30 "$OUT/offload/configure.log" | tee -a "$LOG"; exit 1; }
  step "build"
  timeout 300 ninja -C "$BUILD" train bench_cpu_adamw_vs_torch > "$OUT/offload/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/offload/build.log" | head -40 | tee -a "$LOG"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" | tee -a "$LOG"

step "CPU AdamW: zero vs LibTorch fused / foreach, same data"
timeout 150 "$BUILD/bench/cpu/bench_cpu_adamw_vs_torch" --benchmark_min_time=0.5s \
  --benchmark_out="$OUT/cpu-adamw-vs-torch.json" --benchmark_out_format=json 2>&1 | grep -E "^BM_" | tee -a "$LOG"

run() {  # name, limit seconds, then trainer options
  local name=$1 limit=$2
  shift 2
  step "$name: $*"
  rm -rf "/tmp/$name"
  local start end
  start=$(date +%s.%N)
  timeout "$limit" mpirun -np 1 --bind-to none "$BUILD/examples/sdxl/train" --config examples/sdxl/configs/sdxl-1024.toml \
    --steps "$STEPS" --warmup_steps 5 --log_every 10 --checkpoint_every 0 --save_final false --export_unet false \
    --output_dir "/tmp/$name" "$@" > "$OUT/offload/$name.log" 2>&1
  local code=$?
  end=$(date +%s.%N)
  grep -vE "^[a-z_0-9]+ = |^\[|^---" "$OUT/offload/$name.log" | grep -v "^$" | tail -7 | tee -a "$LOG"
  echo "exit $code, wall $(python3 -c "print(round($end-$start,1))") s" | tee -a "$LOG"
  cp "/tmp/$name/metrics.jsonl" "$OUT/offload/$name.jsonl" 2>/dev/null
}

# Must fail fast: the whole model state does not fit 24 GiB without offload.
run sdxl-stage0-b1-cap24-nooffload 60 --stage 0 --batch_size 1 --max_gpu_memory 24GiB
run sdxl-stage2-b1-cap24-nooffload 60 --stage 2 --batch_size 1 --max_gpu_memory 24GiB
# Offloaded under the caps.
run sdxl-stage2-b1-cap24-offload 150 --stage 2 --batch_size 1 --offload_optimizer true --max_gpu_memory 24GiB
run sdxl-stage3-b1-cap12-offload 150 --stage 3 --batch_size 1 --offload_optimizer true --max_gpu_memory 12GiB
# Throughput at batch 8: offloaded against on-device, same stage, same session.
run sdxl-stage2-b8-offload 150 --stage 2 --batch_size 8 --offload_optimizer true
run sdxl-stage2-b8-device 150 --stage 2 --batch_size 8

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
    row = {"name": os.path.basename(path)[:-6], "steps": recs[-1]["step"], "images_per_s": round(ips, 3),
           "mfu": round(ips * 20.62e12 / 989e12, 4),
           "peak_gpu_memory_gib": round(max(r["mem_max_bytes"] for r in recs) / 2**30, 2),
           "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}
    rows.append(row)
    print(json.dumps(row))
json.dump(rows, open(os.path.join(sys.argv[1], "summary.json"), "w"), indent=1)
PY
step "done"
cd "$OUT" && tar czf offload.tgz offload && rm -rf offload
