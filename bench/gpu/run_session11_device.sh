#!/usr/bin/env bash
# The session-11 H200 call (2026-12-04): the trainer's [validation] images on full SDXL.
#  A. build the cuda preset (everything) and run every CTest labelled gpu (the engine's
#     gathers now go bucket by bucket; reads no longer upload a pending delayed update);
#  B. a full-size random-weight pipeline (make_full_pipeline.py) for the VAE and text encoders;
#  C. the trainer at 1024^2 (sdxl-1024.toml: bf16, AdamW + EMA, checkpointing, batch 8, stage 2)
#     for 50 steps with [validation] every = 25, four prompts, 30 Euler steps, guidance 5:
#     the validation's seconds per image, training images/s before and after;
#  D. TensorBoard's own reader (EventAccumulator) reads the images back, when the tensorboard
#     package is there; tools/check_tfevents.py --expect-images in any case.
#   bash bench/gpu/run_session11_device.sh     (carry .deps; PYTHONPATH for diffusers is set here)
set -uo pipefail
OUT=${OUT:-/tmp/zero-device-out}
D=$OUT/s11
mkdir -p "$D"
LOG=$D/run.log
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD/.deps/diffusers/src
say() { echo "==== $(date -u +%H:%M:%S) [$((SECONDS))s] $*" | tee -a "$LOG"; }
B=build/cuda
say "A. build, gpu tests"
( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build ${TARGETS:-} ) 2>&1 | tail -3 | tee -a "$LOG"
if [ "${GPU_TESTS:-1}" != 0 ]; then
  ctest --test-dir $B -L gpu --output-on-failure --timeout 300 > "$D/ctest-gpu.log" 2>&1
  grep -E "Test +#|tests passed|FAIL" "$D/ctest-gpu.log" | tee -a "$LOG"
fi
say "B. full-size pipeline"
python3 bench/gpu/make_full_pipeline.py /tmp/pipe 2>&1 | tail -1 | tee -a "$LOG"
say "C. trainer, 50 steps, validation every 25"
start=$SECONDS
timeout 400 mpirun -np 1 --bind-to none $B/examples/sdxl/train --config examples/sdxl/configs/sdxl-1024.toml \
  --steps 50 --warmup_steps 5 --log_every 5 --checkpoint_every 0 --save_final false --export_unet ${EXPORT:-false} \
  --export_dtype bf16 \
  --output_dir /tmp/val --validation_every 25 --validation_pipeline /tmp/pipe --validation_steps 30 \
  --validation_guidance 5 --validation_prompt "a red fox in snow" --validation_prompt "a lighthouse at dusk" \
  --validation_prompt "a bowl of ramen, studio light" --validation_prompt "an astronaut riding a horse" \
  > "$D/train-validation.log" 2>&1
echo "train exit $? wall $((SECONDS - start)) s" | tee -a "$LOG"
grep -E "validation|step +(5|20|25|30|45|50) " "$D/train-validation.log" | tail -14 | tee -a "$LOG"
ls -la /tmp/val/samples/* 2>&1 | tee -a "$LOG"
cp /tmp/val/samples/step-00000050/index.json "$D/index-step50.json" 2>/dev/null
cp /tmp/val/metrics.jsonl "$D/metrics.jsonl" 2>/dev/null
if [ "${EXPORT:-false}" = true ]; then
  say "C2. the last validation image against sample's from the exported EMA UNet (bf16, GPU)"
  $B/examples/sdxl/sample --pipeline /tmp/pipe --unet /tmp/val/unet_ema --prompt "a red fox in snow" --steps 30 \
    --guidance 5 --seed 0 --device cuda --dtype bf16 --output /tmp/sampled.png > "$D/sample.log" 2>&1
  echo "sample exit $?" | tee -a "$LOG"
  python3 - /tmp/val/samples/step-00000050/00-a-red-fox-in-snow.png /tmp/sampled.png <<'PY' 2>&1 | tee -a "$LOG"
import sys
import numpy as np
from PIL import Image
a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in sys.argv[1:3])
d = np.abs(a - b)
print(f"validation vs sample: identical {bool((d == 0).all())}, max |diff| {d.max()} levels, mean {d.mean():.4f}, "
      f"pixels differing {(d.max(axis=2) > 0).mean():.4%}")
PY
fi
say "D. TensorBoard reader"
python3 tools/check_tfevents.py --pure --expect-images validation/00,validation/01,validation/02,validation/03 \
  /tmp/val/tensorboard > "$D/check_tfevents.log" 2>&1
echo "check_tfevents exit $?" | tee -a "$LOG"
python3 - /tmp/val/tensorboard > "$D/tensorboard_reader.log" 2>&1 <<'PY'
import sys
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    print("tensorboard is not installed here:", e)
    sys.exit(0)
acc = EventAccumulator(sys.argv[1], size_guidance={"images": 0, "scalars": 0})
acc.Reload()
tags = sorted(acc.Tags()["images"])
print("image tags:", tags)
for tag in tags:
    for event in acc.Images(tag):
        png = event.encoded_image_string
        signature = png[:8] == bytes([0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A])
        print(f"{tag} step {event.step}: {event.width}x{event.height}, {len(png)} bytes, PNG signature {signature}")
print("validation/seconds:", [(s.step, round(s.value, 2)) for s in acc.Scalars("validation/seconds")])
PY
cat "$D/tensorboard_reader.log" | tee -a "$LOG"
tar czf "$D/samples.tgz" -C /tmp/val samples 2>/dev/null
say "done"
