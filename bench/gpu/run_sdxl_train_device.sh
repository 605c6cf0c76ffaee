#!/usr/bin/env bash
# The SDXL trainer on the full UNet (sdxl-1024.toml: 1024x1024, bf16, AdamW,
# EMA, activation checkpointing, synthetic data) on one GPU, at the ZeRO
# stages and batch sizes given, STEPS steps each; then a summary per run
# (images/s over the steps after the warm-up, MFU, peak GPU memory in use).
#   STAGES="0 1 2 3" BATCHES="8" bash bench/gpu/run_sdxl_train_device.sh
# Needs .deps/ (toml++, CLI11 headers) carried along; SKIP_BUILD=1 reuses the build.
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
BUILD=${BUILD:-build/sdxl-dev}
STAGES=${STAGES:-"0 1 2 3"}
BATCHES=${BATCHES:-"1 8"}
STEPS=${STEPS:-50}
RUN_LIMIT=${RUN_LIMIT:-240}
mkdir -p "$OUT"
LOG=$OUT/sdxl-train.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
step() { echo "==== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if [ -z "${SKIP_BUILD:-}" ]; then
  step "configure"
  TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DZERO_BUILD_TESTS=OFF -DZERO_BUILD_BENCH="${WITH_BENCH:-OFF}" \
    "-DCMAKE_PREFIX_PATH=$TP;$PWD/.deps/cli11/usr" > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log" | tee -a "$LOG"; exit 1; }
  step "build"
  timeout "${BUILD_LIMIT:-300}" ninja -C "$BUILD" train ${EXTRA_TARGETS:-} > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -40 | tee -a "$LOG"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

for batch in $BATCHES; do
  for stage in $STAGES; do
    name="sdxl-1024-stage$stage-b$batch"
    step "$name: train --stage $stage --batch_size $batch --steps $STEPS"
    rm -rf "/tmp/$name"
    start=$(date +%s.%N)
    timeout "$RUN_LIMIT" mpirun -np 1 "$BUILD/examples/sdxl/train" --config examples/sdxl/configs/sdxl-1024.toml \
      --stage "$stage" --batch_size "$batch" --steps "$STEPS" --warmup_steps 10 --log_every 10 --checkpoint_every 0 \
      --save_final false --export_unet false --output_dir "/tmp/$name" > "$OUT/$name.log" 2>&1
    code=$?
    end=$(date +%s.%N)
    grep -vE "^[a-z_0-9]+ = " "$OUT/$name.log" | tail -8 | tee -a "$LOG"
    echo "exit $code, wall $(python3 -c "print(round($end-$start,1))") s" | tee -a "$LOG"
    cp "/tmp/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  done
done

# Summary: steps 11.. (after the LR warm-up and the allocator's first growth).
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, json, os, sys, subprocess
out = sys.argv[1]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
rows = []
for path in sorted(glob.glob(os.path.join(out, "sdxl-1024-stage*-b*.jsonl"))):
    name = os.path.basename(path)[:-6]
    recs = [json.loads(l) for l in open(path) if l.strip()]
    recs = [r for r in recs if r.get("images_per_s")]
    if not recs:
        continue
    stage = int(name.split("stage")[1].split("-")[0]); batch = int(name.split("-b")[-1])
    tail = [r for r in recs if r["step"] > 10] or recs
    ips = sum(r["images_per_s"] for r in tail) / len(tail)
    row = {"name": name, "gpu": gpu, "stage": stage, "batch": batch, "steps": recs[-1]["step"],
           "images_per_s": round(ips, 3), "mfu": round(ips * 20.62e12 / 989e12, 4),
           "peak_gpu_memory_gib": round(max(r["mem_max_bytes"] for r in recs) / 2**30, 2),
           "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
           "seconds_to_first_step": recs[0].get("elapsed_s")}
    rows.append(row)
    print(json.dumps(row))
json.dump(rows, open(os.path.join(out, "sdxl-train-summary.json"), "w"), indent=1)
PY
step "done"
