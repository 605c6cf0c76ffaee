#!/usr/bin/env bash
# The main job on a fresh machine: installs what is needed, builds, and runs
# the engine demo under mpirun (2 ranks): sharded training at ZeRO stages
# 0-3 with per-rank memory by category against the ZeRO formula.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake --preset cpu
cmake --build --preset cpu -j "$(nproc)" --target engine_demo
mpirun --allow-run-as-root --oversubscribe -np "${RANKS:-2}" build/cpu/examples/engine_demo "$@"
