#!/usr/bin/env python3
"""A failing rank never leaves the others hanging: under mpirun -np 3 one rank
is killed (SIGKILL), hangs, or throws mid-training; every rank must be gone,
with a non-zero exit, within the timeout (ZERO_COMM_TIMEOUT_S=5 here).

  check_faults.py MPIEXEC FAULT_PROBE [mpiexec flags...]
"""
import os
import subprocess
import sys
import time

MPIEXEC, PROBE = sys.argv[1:3]
FLAGS = sys.argv[3:]
TIMEOUT_S = 5
LIMIT_S = 60  # the bound: all ranks gone within 60 s of the failure
failures = []
for mode in ("kill", "hang", "throw"):
    env = dict(os.environ, ZERO_COMM_TIMEOUT_S=str(TIMEOUT_S))
    start = time.time()
    try:
        result = subprocess.run([MPIEXEC, "-np", "3", *FLAGS, PROBE, "--mode", mode, "--victim", "1", "--after", "5"],
                                capture_output=True, text=True, env=env, timeout=LIMIT_S + 30)
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:
        code, output = None, (e.stdout or b"").decode() + (e.stderr or b"").decode()
    elapsed = time.time() - start
    ok = code not in (None, 0) and elapsed < LIMIT_S and "fails now" in output  # it did run and fail
    if mode == "hang":
        ok = ok and "did not complete within" in output  # the watchdog, not luck, ended it
    print(f"{'ok  ' if ok else 'FAIL'} {mode}: exit {code} after {elapsed:.1f} s")
    if not ok:
        print(output[-3000:])
        failures.append(mode)
print("all passed" if not failures else "FAILED: " + ", ".join(failures))
sys.exit(1 if failures else 0)
