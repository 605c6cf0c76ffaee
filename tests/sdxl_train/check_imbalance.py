#!/usr/bin/env python3
"""Load imbalance in the trainer's metrics (tiny.toml, mpirun -np 2; stdlib only).

  check_imbalance.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

1. Stage 2, no fault: every metrics.jsonl record carries forward+backward,
   communication-wait and optimizer times as min/max over ranks and the
   slowest rank; min <= max, times >= 0, the slowest rank in [0, 2); the
   progress line shows them.
2. Stage 3 with ZERO_FAULT_SLOW_RANK=<ms>@1 (rank 1 sleeps before every
   forward pass): rank 1 is named the slowest at every step, the
   forward+backward spread covers the sleep, and the other rank's wait for
   it shows as communication wait (it is not counted as its compute).
3. A malformed ZERO_FAULT_SLOW_RANK is refused, naming the variable.
"""
import json
import os
import re
import shutil
import subprocess
import sys

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
STEPS = 4
# Long against the noise of 2 ranks on 2 shared cores (a tiny step takes 1-3 s there);
# the checks below ask for half of it.
SLEEP_S = 1.0
PHASES = ("fwd_bwd", "comm_wait", "optimizer")
KEYS = [f"imbalance/{p}_{end}_s" for p in PHASES for end in ("min", "max")] + ["imbalance/slowest_rank"]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402


def train(name, *overrides, env=None):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", "2", *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out, "--steps", str(STEPS),
           "--synthetic_samples", "32", "--warmup_steps", "1", "--log_every", "1", "--checkpoint_every", "0", "--save_final", "false",
           "--export_unet", "false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, **(env or {})))
    records = []
    path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(path):
        records = [json.loads(line) for line in open(path) if line.strip()]
    return proc, records


def progress_lines(proc):
    return [line for line in proc.stdout.splitlines() if re.match(r"step \d+/", line)]


os.makedirs(WORK, exist_ok=True)

# 1. The fields, consistent.
proc, records = train("balanced", "--stage", "2")
if not check(proc.returncode == 0 and len(records) == STEPS, f"1: stage 2 trains {STEPS} steps (exit {proc.returncode})"):
    print(proc.stdout[-3000:], proc.stderr[-3000:])
else:
    if check(all(all(k in r for k in KEYS) for r in records), "1: every record has " + ", ".join(KEYS)):
        check(all(r[f"imbalance/{p}_min_s"] <= r[f"imbalance/{p}_max_s"] for r in records for p in PHASES),
              "1: min <= max for every phase")
        check(all(r[k] >= 0 for r in records for k in KEYS), "1: times and rank >= 0")
        check(all(r["imbalance/slowest_rank"] in (0, 1) for r in records), "1: the slowest rank is 0 or 1")
        check(all(r["imbalance/fwd_bwd_max_s"] > 0 and r["imbalance/optimizer_max_s"] > 0 for r in records),
              "1: forward+backward and the optimizer took some time")
    lines = progress_lines(proc)
    check(len(lines) == STEPS and all(re.search(r"fwd\+bwd [0-9.]+-[0-9.]+ s, wait [0-9.]+-[0-9.]+ s, "
                                                r"opt [0-9.]+-[0-9.]+ s, slowest rank [01]", l) for l in lines),
          "1: the progress line shows the phases' min-max and the slowest rank: " + (lines[-1] if lines else "none"))

# 2. One slow rank is named, and the other one's wait is counted as waiting.
proc, records = train("slow_rank1", "--stage", "3", env={"ZERO_FAULT_SLOW_RANK": f"{int(SLEEP_S * 1000)}@1"})
if not check(proc.returncode == 0 and len(records) == STEPS, f"2: stage 3 with rank 1 slowed trains (exit {proc.returncode})"):
    print(proc.stdout[-3000:], proc.stderr[-3000:])
elif check(all(all(k in r for k in KEYS) for r in records), "2: every record has the imbalance fields"):
    check(f"fault injection: rank 1 sleeps {int(SLEEP_S * 1000)} ms in every micro-step" in proc.stdout, "2: rank 0 announces the test hook")
    slowest = [r["imbalance/slowest_rank"] for r in records]
    check(all(s == 1 for s in slowest), f"2: rank 1 is the slowest at every step: {slowest}")
    spread = [r["imbalance/fwd_bwd_max_s"] - r["imbalance/fwd_bwd_min_s"] for r in records]
    check(all(s >= 0.5 * SLEEP_S for s in spread),
          f"2: forward+backward max - min >= 0.5 x the {SLEEP_S} s sleep: {[round(s, 3) for s in spread]}")
    waits = [r["imbalance/comm_wait_max_s"] for r in records]
    check(all(w >= 0.5 * SLEEP_S for w in waits),
          f"2: the fast rank's wait for the slow one is communication wait: max {[round(w, 3) for w in waits]}")
    lines = progress_lines(proc)
    check(bool(lines) and all("slowest rank 1" in l for l in lines), "2: the progress line names rank 1")

# 3. A malformed hook value.
proc, _ = train("bad_hook", "--stage", "2", env={"ZERO_FAULT_SLOW_RANK": "400@7"})
check(proc.returncode != 0 and "ZERO_FAULT_SLOW_RANK='400@7'" in proc.stdout + proc.stderr,
      f"3: ZERO_FAULT_SLOW_RANK=400@7 at 2 ranks is refused, naming the variable (exit {proc.returncode})")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
