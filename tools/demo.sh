#!/usr/bin/env bash
# The main job on a fresh machine: installs what is needed, builds, and runs
# the SDXL trainer on CPU ranks (mpirun -np 2) with examples/sdxl/configs/tiny.toml:
# a small UNet of the SDXL family, synthetic data, ZeRO stage 2, 60 steps.
# Extra arguments override the config (e.g. --stage 3 --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake --preset cpu-torch
cmake --build --preset cpu-torch -j "$(nproc)" --target train unet_forward engine_demo
mpirun --allow-run-as-root --oversubscribe -np "${RANKS:-2}" build/cpu-torch/examples/sdxl/train \
  --config examples/sdxl/configs/tiny.toml "$@"
