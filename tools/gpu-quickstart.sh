#!/usr/bin/env bash
# GPU quick start: on a machine with an NVIDIA GPU, CUDA, NCCL and a CUDA
# build of PyTorch (pip) or LibTorch, builds the `cuda` preset's trainer
# against that LibTorch and runs the full SDXL UNet (examples/sdxl/configs/
# sdxl-1024.toml: 2.57 B parameters, 1024x1024, bf16, AdamW, EMA, activation
# checkpointing) for a few steps on synthetic data on one GPU, then prints
# images/s and memory. Anything missing is named first, with how to get it.
#
#   bash tools/gpu-quickstart.sh                     # LibTorch from python3's PyTorch
#   LIBTORCH=/opt/libtorch bash tools/gpu-quickstart.sh
#   STEPS=30 BATCH=4 STAGE=3 bash tools/gpu-quickstart.sh [more trainer options]
#
# Run again, it only rebuilds what changed. Output: runs/gpu-quickstart/
# (metrics.jsonl, the log) and the summary on stdout. BATCH 8 at stage 2
# (the defaults) trains at about 17.6 images/s in 95 GiB on an H200, where
# checkpoint_units = "fit" recomputes nothing (bench/results/session22-h200.md);
# on smaller cards "fit" recomputes what they need; lower BATCH or raise STAGE
# where even recomputing every unit does not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-common.sh
STEPS=${STEPS:-12}
BATCH=${BATCH:-8}
STAGE=${STAGE:-2}
OUT_DIR=${OUT_DIR:-runs/gpu-quickstart}

gpu_check_prerequisites
gpu_build train
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUT_DIR"
gpu_say "train: full SDXL UNet, 1024x1024 synthetic data, stage $STAGE, batch $BATCH, $STEPS steps"
set -x
mpirun -np 1 --bind-to none "$BUILD_DIR/examples/sdxl/train" --config examples/sdxl/configs/sdxl-1024.toml \
  --synthetic true --stage "$STAGE" --batch_size "$BATCH" --steps "$STEPS" --warmup_steps 2 --log_every 1 \
  --checkpoint_every 0 --save_final false --export_unet false --output_dir "$OUT_DIR/run" --overwrite true "$@" \
  2>&1 | tee "$OUT_DIR/train.log"
{ set +x; } 2> /dev/null

# The first steps carry cuDNN's algorithm search and the allocator's growth:
# the rate is the mean over the steps after the first third.
python3 - "$OUT_DIR/run/metrics.jsonl" "$BATCH" "$STAGE" <<'PY'
import json, sys
path, batch, stage = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
recs = [json.loads(l) for l in open(path) if l.strip()]
recs = [r for r in recs if r.get("images_per_s")]
if not recs:
    sys.exit(f"gpu-quickstart: no steps in {path}")
tail = recs[len(recs) // 3:] or recs
ips = sum(r["images_per_s"] for r in tail) / len(tail)
peak = max(r["mem_max_bytes"] for r in recs) / 2**30
fwd_bwd = sum(r.get("imbalance/fwd_bwd_max_s", 0) for r in tail) / len(tail)
opt = sum(r.get("imbalance/optimizer_max_s", 0) for r in tail) / len(tail)
print(f"gpu-quickstart: SDXL UNet 1024x1024, stage {stage}, batch {batch}: {ips:.2f} images/s "
      f"(mean of steps {tail[0]['step']}-{tail[-1]['step']}; {ips * 20.62e12 / 1e12:.0f} TFLOP/s of model math), "
      f"GPU memory in use at step ends at most {peak:.1f} GiB (the driver's count); per step {fwd_bwd:.3f} s forward+backward, {opt:.3f} s optimizer; "
      f"loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}")
PY
