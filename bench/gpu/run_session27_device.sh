#!/usr/bin/env bash
# Session 27: the delayed update's parameters sent up during the next backward
# (offload.upload_during_backward, on the transfer stream) and the CPU
# update's chunks handed out dynamically (cpu_kernels.cpp), against
# BASE_TREE's build, on offloaded AdamW + EMA with the EMA on the GPU (stage 2,
# batch 8, delayed update, checkpointing).
#   PHASES="build buildbase ab" BASE_TREE=ab_base bash bench/gpu/run_session27_device.sh
#  build:     TARGETS of the cuda preset (default: train).
#  buildbase: the trainer from BASE_TREE (a `git archive` of the base commit,
#             unpacked in an untracked folder of the working tree).
#  ab:        on-device stage 2 at batch 8 once, then the offloaded run with
#             this build (new), this build with the uploads at the step
#             (atstep) and BASE_TREE's (base), alternated (ROUNDS, default 2;
#             VARIANTS, default "new atstep base"; also grad1, upd12: this
#             build with --offload_gradient_threads 1, --offload_update_threads
#             12; gstats: with --offload_gradient_stats_on_device true;
#             bf16state: with --state_dtype bf16;
#             EXTRA: more trainer options, for every variant).
#  trace:     the offloaded run (this build) with a Kineto trace of step 10,
#             where the compute stream waits and what the copies did meanwhile
#             (bench/gpu/stream_timeline.py) and its kernels (kernel_summary.py);
#             the trace itself gzipped into the output folder. First the
#             on-device step's trace (TRACE_DEVICE=0: not), for its kernels.
#  b1:        batch 1, stage 0, graph, no EMA, no checkpointing (B1_ROUNDS, default 1).
#  b1ab:      that run with the inputs through reused pinned buffers without
#             a host wait (this build's default: pinned) and blocking
#             (SDXL_BLOCKING_INPUT_COPIES=1: blocking), alternated B1_ROUNDS
#             times (default 2); B1_VARIANTS (default "pinned blocking") may add
#             threads1, threads4: the default with --host_threads 1, 4;
#             bf16state, bf16state2: --state_dtype bf16 at stage 0, at stage 2;
#             noprefetch: the next micro-step's host inputs made when needed, not
#             during the current one (SDXL_NO_INPUT_PREFETCH=1).
#  b1trace:   that run with a Kineto trace of step 15, its stream and host
#             timelines and kernel families in the log, the trace gzipped;
#             at each of B1_TRACE_STAGES (default 0).
#  fit:       the trainer's --fit 12GiB at global batch 8 (FIT_SIZES: other
#             sizes), the planner's choice run as it chose it.
#  tests:     TESTS (a ctest regex).
set -uo pipefail
NAME=session27 DEFAULT_PHASES="build buildbase ab"
TARGETS=${TARGETS:-train}
STEPS=${STEPS:-16}
source bench/gpu/device_env.sh
device_script_begin
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)" | tee -a "$LOG"
free -g | head -2 | tee -a "$LOG"
if has buildbase; then build_base_tree; fi
if has tests; then run_gpu_tests "${TESTS:-gpu.engine.np1|gpu.engine.np2}"; fi
offloaded() {  # offloaded NAME BUILD [options...]
  local name=$1 build=$2
  shift 2
  bash -c 'source bench/gpu/trainer_run.sh; BUILD='"$build"' OUT_DIR='"$OUT_DIR"' LOG='"$LOG"' STEPS='"$STEPS"' \
    CONFIG='"$gb8"' run_trainer "$@"' _ "$name" 300 --stage 2 --offload_optimizer true --offload_delayed_update true \
    --ema_every 1 --offload_ema_on_device true ${EXTRA:-} "$@"
}
if has ab || has trace || has fit; then gb8=$(batch8_config) || exit 1; fi
if has ab; then
  base=${BASE_TREE:-}  # needed by the base variant only
  CONFIG=$gb8 run_trainer "sdxl-device-stage2-8x1" 240 --stage 2
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for variant in ${VARIANTS:-new atstep base}; do
      case $variant in
        new) offloaded "sdxl-offload-emadevice-new-r$round" "$BUILD" ;;
        atstep) offloaded "sdxl-offload-emadevice-atstep-r$round" "$BUILD" --offload_upload_during_backward false ;;
        # Session 31's probes of the host-bound step: the gradient worker's
        # team at one thread, the update's below the cores less one.
        grad1) offloaded "sdxl-offload-emadevice-grad1-r$round" "$BUILD" --offload_gradient_threads 1 ;;
        upd12) offloaded "sdxl-offload-emadevice-upd12-r$round" "$BUILD" --offload_update_threads 12 ;;
        # Session 32: the gradient statistics summed on the GPU before the download.
        gstats) offloaded "sdxl-offload-emadevice-gstats-r$round" "$BUILD" --offload_gradient_stats_on_device true ;;
        # Session 35: the host update's moments in bf16 (18 bytes a parameter instead of 26).
        bf16state) offloaded "sdxl-offload-emadevice-bf16state-r$round" "$BUILD" --state_dtype bf16 ;;
        base) offloaded "sdxl-offload-emadevice-base-r$round" "${base:?set BASE_TREE for the base variant}/build/cuda" ;;
      esac
    done
  done
fi
if has trace; then
  # The on-device step's trace too (TRACE_DEVICE=0 leaves it out): backward's
  # kernels slower offloaded, with no gaps on the compute stream, would be the
  # transfer stream's kernels beside them.
  device_trace=
  if [ "${TRACE_DEVICE:-1}" = 1 ]; then
    CONFIG=$gb8 run_trainer "sdxl-device-stage2-trace" 240 --stage 2 --profile_step 10
    device_trace=/tmp/sdxl-device-stage2-trace/profile-step-10.json
    python3 bench/gpu/stream_timeline.py "$device_trace" --top 10 --json "$OUT_DIR/stream-timeline-device.json" 2>&1 | tee -a "$LOG"
  fi
  offloaded "sdxl-offload-emadevice-trace" "$BUILD" --profile_step 10
  trace=/tmp/sdxl-offload-emadevice-trace/profile-step-10.json
  python3 bench/gpu/stream_timeline.py "$trace" --top 25 --json "$OUT_DIR/stream-timeline.json" 2>&1 | tee -a "$LOG"
  # On-device first, offloaded second: their kernel families side by side.
  python3 bench/gpu/kernel_summary.py $device_trace "$trace" --top 30 --json "$OUT_DIR/kernels.json" 2>&1 | tee -a "$LOG"
  # The whole trace, compressed, for a look beyond the two summaries; its size
  # goes into the log, since the device leaves out files over its limit.
  gzip -c "$trace" > "$OUT_DIR/trace-offload-step10.json.gz" && ls -l "$OUT_DIR/trace-offload-step10.json.gz" | tee -a "$LOG"
fi
if has fit; then
  for size in ${FIT_SIZES:-12GiB}; do
    CONFIG=$gb8 run_trainer "sdxl-fit-$size-gb8" 300 --fit "$size"
  done
fi
if has b1trace; then
  # Session 32: where batch 1's graphed step (stage 0) leaves the GPU idle
  # (session 23-24's traces: 82-93% busy), with the host threads' waits beside
  # the streams; two steps profiled would be better, one is what the trainer
  # takes (its span starts and ends with an idle GPU).
  # B1_TRACE_STAGES (default 0): stage 2 at one rank ran ~10 ms a step
  # slower than stage 0 at both batch sizes (graphs-stage23-h200.json).
  for stage in ${B1_TRACE_STAGES:-0}; do
    run_trainer "sdxl-stage$stage-b1-trace" 150 --stage "$stage" --batch_size 1 --activation_checkpointing false \
      --ema_decay 0 --channels_last true --cuda_graph true --profile_step 15
    trace=/tmp/sdxl-stage$stage-b1-trace/profile-step-15.json
    python3 bench/gpu/stream_timeline.py "$trace" --top 25 2>&1 | tee -a "$LOG"
    python3 bench/gpu/host_timeline.py "$trace" --min-ms 0.3 2>&1 | tee -a "$LOG"
    python3 bench/gpu/kernel_summary.py "$trace" --top 25 2>&1 | tee -a "$LOG"
    gzip -c "$trace" > "$OUT_DIR/trace-stage$stage-b1.json.gz" && ls -l "$OUT_DIR/trace-stage$stage-b1.json.gz" | tee -a "$LOG"
  done
fi
if has b1ab; then
  # Session 33: the inputs through pinned buffers allocated once (default)
  # against the blocking copies (SDXL_BLOCKING_INPUT_COPIES=1), alternated.
  for round in $(seq 1 "${B1_ROUNDS:-2}"); do
    for variant in ${B1_VARIANTS:-pinned blocking}; do
      extra=() stage=0
      case $variant in
        blocking) export SDXL_BLOCKING_INPUT_COPIES=1 ;;
        noprefetch) export SDXL_NO_INPUT_PREFETCH=1 ;;  # session 34: the inputs made when needed
        threads*) extra=(--host_threads "${variant#threads}") ;;
        bf16state) extra=(--state_dtype bf16) ;;  # session 34: AdamW's m and v in bf16
        bf16state2) extra=(--state_dtype bf16) stage=2 ;;  # the same at stage 2
      esac
      run_trainer "sdxl-stage$stage-b1-$variant-r$round" 150 --stage "$stage" --batch_size 1 --activation_checkpointing false \
        --ema_decay 0 --channels_last true --cuda_graph true "${extra[@]}"
      unset SDXL_BLOCKING_INPUT_COPIES SDXL_NO_INPUT_PREFETCH
    done
  done
fi
if has b1; then
  for round in $(seq 1 "${B1_ROUNDS:-1}"); do
    run_trainer "sdxl-stage0-b1-r$round" 150 --stage 0 --batch_size 1 --activation_checkpointing false \
      --ema_decay 0 --channels_last true --cuda_graph true
  done
fi
summarize_runs "$OUT_DIR" | tee -a "$LOG"
rm -f "$OUT_DIR"/*.smi
say "done"
