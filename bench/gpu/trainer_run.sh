# Sourced by the device scripts: run_trainer NAME LIMIT [trainer options...]
# runs examples/sdxl/train with sdxl-1024.toml on one GPU while nvidia-smi
# samples the GPU's memory in use every 5 ms (NVML: no CUDA context of its
# own), then prints the log's progress lines, the in-step peak and the exit
# status. Expects BUILD, OUT_DIR, LOG and STEPS (CONFIG: another config file
# than sdxl-1024.toml); mpirun --bind-to none lets
# the CPU optimizer's OpenMP threads use every core.
run_trainer() {
  local name=$1 limit=$2
  shift 2
  echo "==== $(date -u +%H:%M:%S) $name: $*" | tee -a "$LOG"
  rm -rf "/tmp/$name"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 5 > "$OUT_DIR/$name.smi" 2>/dev/null &
  local poller=$! start end
  sleep 0.5
  start=$(date +%s.%N)
  timeout "$limit" mpirun -np 1 --bind-to none "$BUILD/examples/sdxl/train" --config "${CONFIG:-examples/sdxl/configs/sdxl-1024.toml}" \
    --steps "$STEPS" --warmup_steps 5 --log_every 5 --checkpoint_every 0 --save_final false --export_unet false \
    --output_dir "/tmp/$name" "$@" > "$OUT_DIR/$name.log" 2>&1
  local code=$?
  end=$(date +%s.%N)
  kill "$poller" 2>/dev/null; wait "$poller" 2>/dev/null
  grep -E "memory plan|block cache|GPU memory cap|error|Error|step +[0-9]+" "$OUT_DIR/$name.log" | tail -8 | tee -a "$LOG"
  python3 - "$OUT_DIR/$name.smi" <<'PY' | tee -a "$LOG"
import sys
v = [int(x) for x in open(sys.argv[1]).read().split() if x.strip().isdigit()]
if v:
    print(f"nvidia-smi: baseline {v[0]} MiB, peak {max(v)} MiB, in-step peak of the run {(max(v) - v[0]) / 1024:.2f} GiB ({len(v)} samples)")
PY
  echo "exit $code, wall $(python3 -c "print(round($end-$start,1))") s" | tee -a "$LOG"
  cp "/tmp/$name/metrics.jsonl" "$OUT_DIR/$name.jsonl" 2>/dev/null
}

# trace_batch1_stage0 [trainer options...]: the batch-1 step at stage 0
# (CUDA graph, channels-last, no EMA, no checkpointing): a Kineto trace of
# step 15, summed by kernel_summary.py into $OUT_DIR/trace-stage0-b1.json.
trace_batch1_stage0() {
  run_trainer "sdxl-trace-stage0-b1" 150 --stage 0 --batch_size 1 --activation_checkpointing false --ema_decay 0 \
    --channels_last true --cuda_graph true --profile_step 15 "$@"
  python3 bench/gpu/kernel_summary.py "/tmp/sdxl-trace-stage0-b1/profile-step-15.json" --top 40 \
    --json "$OUT_DIR/trace-stage0-b1.json" 2>&1 | tee -a "$LOG"
}

# batch8_config: sdxl-1024.toml (EMA, checkpointing) at batch_size = 8, its
# other settings kept, written to /tmp; prints the path. Fails loudly when
# the config no longer has the line it rewrites.
batch8_config() {
  local out=/tmp/sdxl-1024-gb8.toml
  if ! grep -q '^batch_size = 4$' examples/sdxl/configs/sdxl-1024.toml; then
    echo "batch8_config: examples/sdxl/configs/sdxl-1024.toml has no 'batch_size = 4' line to rewrite" >&2
    return 1
  fi
  sed 's/^batch_size = 4$/batch_size = 8/' examples/sdxl/configs/sdxl-1024.toml > "$out"
  echo "$out"
}

# run_gathers_phase: stage 3 without the host wait per unit (2026-12-05):
# stage 3 eager at batch 1 and 8 against stage 2 (measured +41% and +2.5%
# with the wait), and stage 3 with offload_params under 12 GiB at 2 x 4 (2.81
# images/s with the wait; prediction in docs/perf-notes.md).
run_gathers_phase() {
  local batch stage
  for batch in 1 8; do
    for stage in 2 3; do
      run_trainer "sdxl-gathers-stage$stage-b$batch" 240 --stage "$stage" --batch_size "$batch"
    done
  done
  run_trainer "sdxl-gathers-cap-12GiB-stage3-2x4" 300 --max_gpu_memory 12GiB --stage 3 --offload_optimizer true \
    --offload_params true --offload_delayed_update true --batch_size 2 --accumulation 4
}

# plan_peak NAME [zero-plan options...]: zero-plan's prediction for the full
# SDXL UNet with EMA (options: stage, batch, checkpointing...) as one log line,
# "zero-plan, NAME: LABEL - peak X GiB", beside the run it predicts.
plan_peak() {
  local name=$1
  shift
  "$BUILD/examples/sdxl/zero-plan" --unet-config sdxl-base --ema "$@" --json | python3 -c "import json, sys
p = json.load(sys.stdin)
print('zero-plan, $name:', p['label'], '- peak', round(p['gpu_bytes']['total_peak'] / 2**30, 2), 'GiB')" | tee -a "$LOG"
}

# summarize_runs DIR: one JSON line per run (mean images/s after step 5, MFU,
# peaks, loss, mean timings) and DIR/summary.json.
summarize_runs() {
  python3 - "$1" <<'PY'
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
    for key in sorted({k for r in tail for k in r if k.startswith(("timing/", "engine/"))}):
        row[key] = round(sum(r.get(key, 0) for r in tail) / len(tail), 4)
    smi = os.path.join(sys.argv[1], name + ".smi")
    if os.path.exists(smi):
        v = [int(x) for x in open(smi).read().split() if x.strip().isdigit()]
        if v:
            row["in_step_peak_gib_nvidia_smi"] = round((max(v) - v[0]) / 1024, 2)
    rows.append(row)
    print(json.dumps(row))
json.dump(rows, open(os.path.join(sys.argv[1], "summary.json"), "w"), indent=1)
PY
}
