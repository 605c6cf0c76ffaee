#!/usr/bin/env bash
# Session 24: Linear's bias gradient in the weight gradient's GEMM
# (examples/sdxl/fused_linear.hpp, cuBLASLt's BGRADB epilogue). Session 23's
# batch-1 trace (H100, stage 0, graph) had 390 bias-gradient sums, 4.7 ms of a
# 111 ms step; ~330 of them are Linear biases.
#   PHASES="build tests trace" bash bench/gpu/run_session24_device.sh
#   PHASES="bench speed" bash bench/gpu/run_session24_device.sh   (same machine)
#  tests: the gpu tests of the UNet's fused kernels and the trainer's graph.
#  trace: batch 1, stage 0, graph, channels-last, Kineto trace of step 15,
#         summed by bench/gpu/kernel_summary.py.
#  ab: the trainer at batch 1 (stage 0, graph) against BASE_TREE's build, alternated.
#  (ROUNDS: rounds of speed, default 2; SPEED_BATCHES=1: batch 1 only;
#   BENCH_ROUNDS: rounds of bench, default 2.)
#  bench: unet_bench forward+backward (graph, channels-last) at batch 1 and
#         8, the fused backward and --unfused_linear_backward alternated.
#  speed: the trainer at batch 1 and 8, stage 0, graph, no EMA, fused and
#         SDXL_UNFUSED_LINEAR_BACKWARD=1 alternated (batch 8 recomputes 7
#         units on a card under 100 GB: 85 GiB without).
set -uo pipefail
NAME=session24 DEFAULT_PHASES="build tests trace"
TARGETS=${TARGETS:-train unet_bench zero_sdxl_fused_linear_tests zero_sdxl_geglu_tests zero_sdxl_group_norm_nhwc_tests}
STEPS=${STEPS:-16}
source bench/gpu/device_env.sh
device_script_begin
fast="--activation_checkpointing false --ema_decay 0 --channels_last true --cuda_graph true"
if has tests; then run_gpu_tests "gpu.sdxl"; fi
if has trace; then trace_batch1_stage0; fi
if has bench; then
  for round in $(seq 1 "${BENCH_ROUNDS:-2}"); do
    for batch in 1 8; do
      for variant in fused unfused; do
        flag=""; [ "$variant" = unfused ] && flag="--unfused_linear_backward"
        say "unet_bench b$batch $variant r$round"
        timeout 200 $BUILD/examples/sdxl/unet_bench --batch "$batch" --backward --cuda_graph --channels_last \
          --steps 10 --warmup 3 $flag --json "$OUT_DIR/unet-bench.jsonl" 2>&1 | tail -1 | tee -a "$LOG"
      done
    done
  done
fi
if has speed; then
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  b8="--activation_checkpointing false"; [ "$total" -lt 100000 ] && b8="--activation_checkpointing true --checkpoint_units 7"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for variant in fused unfused; do
      env=""; [ "$variant" = unfused ] && env="SDXL_UNFUSED_LINEAR_BACKWARD=1"
      env $env bash -c "source bench/gpu/trainer_run.sh; BUILD=$BUILD OUT_DIR=$OUT_DIR LOG=$LOG STEPS=$STEPS \
        run_trainer sdxl-$variant-stage0-b1-r$round 150 --stage 0 --batch_size 1 $fast"
      [ "${SPEED_BATCHES:-1 8}" = 1 ] && continue
      env $env bash -c "source bench/gpu/trainer_run.sh; BUILD=$BUILD OUT_DIR=$OUT_DIR LOG=$LOG STEPS=$STEPS \
        run_trainer sdxl-$variant-stage0-b8-r$round 200 --stage 0 --batch_size 8 --ema_decay 0 --channels_last true \
        --cuda_graph true $b8"
    done
  done
fi
if has ab; then
  # Gradients written, not added into a zeroed buffer (Engine::GradientWrites),
  # against the tree of BASE_TREE (a `git archive` of the commit before it,
  # copied into the working tree as an untracked folder), alternated.
  base=${BASE_TREE:?set BASE_TREE to the folder with the sources of the base commit}
  say "build base ($base)"
  ( cd "$base" && source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train ) 2>&1 | tail -2 | tee -a "$LOG"
  for round in $(seq 1 "${ROUNDS:-3}"); do
    for variant in written base; do
      build=$BUILD; [ "$variant" = base ] && build=$base/build/cuda
      bash -c "source bench/gpu/trainer_run.sh; BUILD=$build OUT_DIR=$OUT_DIR LOG=$LOG STEPS=$STEPS \
        run_trainer sdxl-$variant-stage0-b1-r$round 150 --stage 0 --batch_size 1 $fast"
    done
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
