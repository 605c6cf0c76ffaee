#!/usr/bin/env python3
"""bench/gpu/host_timeline.py on a synthetic Kineto trace: each stream's first
and last activity, the long waits of a busy host thread (and not its short
ones or its launches), a background thread listed by its calls' times, the
uploads cumulated on the stream that copied the most; input that is not a
trace stops it with a message naming the file."""
import json
import os
import subprocess
import sys
import tempfile

script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
import host_timeline  # noqa: E402


def device(cat, stream, start_ms, end_ms, name, nbytes=None):
    args = {"stream": stream}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "tid": stream, "ts": 1e6 + start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def call(tid, at_ms, ms, name):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": 1e6 + at_ms * 1e3, "dur": ms * 1e3}


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


main_thread = [call(1, 0.5 + 0.01 * i, 0.005, "cudaLaunchKernel") for i in range(300)]
main_thread += [call(1, 40, 12, "cudaStreamSynchronize"), call(1, 60, 1.0, "cudaEventSynchronize"),
                call(1, 70, 3, "cudaFree")]
background = [call(2, 10 * i, 2, "cudaEventSynchronize") for i in range(7)]
events = [
    device("kernel", 7, 0, 30, "fwd"), device("kernel", 7, 35, 80, "bwd"),
    device("gpu_memcpy", 18, 20, 30, "Memcpy HtoD (Pinned -> Device)", 2e9),
    device("gpu_memcpy", 18, 50, 60, "Memcpy HtoD (Pinned -> Device)", 1e9),
    device("gpu_memcpy", 17, 40, 45, "Memcpy HtoD (Pageable -> Device)", 5e8),  # less: not the upload stream
    device("gpu_memcpy", 17, 46, 90, "Memcpy DtoH (Device -> Pinned)", 4e9),  # down: not counted
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 1e6, "dur": 5},
] + main_thread + background
with tempfile.TemporaryDirectory() as work:
    path = os.path.join(work, "trace.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    r = host_timeline.analyze(path, min_ms=2.0, every=3)
    s7, s17 = r["streams"].get("7"), r["streams"].get("17")
    check(s7 and abs(s7["first_ms"]) < 1e-9 and abs(s7["last_end_ms"] - 80) < 1e-9, f"stream 7 {s7}")
    check(s17 and abs(s17["first_ms"] - 40) < 1e-9 and abs(s17["last_end_ms"] - 90) < 1e-9, f"stream 17 {s17}")
    threads = {t["tid"]: t for t in r["threads"]}
    busy, quiet = threads.get(1), threads.get(2)
    check(busy and busy["calls"] == 303 and "sampled_ms" not in busy, f"main thread {busy and busy['calls']}")
    waits = [(w["name"], round(w["at_ms"], 6), round(w["ms"], 6)) for w in (busy or {}).get("waits", [])]
    check(waits == [("cudaStreamSynchronize", 40, 12), ("cudaFree", 70, 3)],
          f"waits {waits}: expected the 12 ms sync and the 3 ms free, not the 1 ms event wait")
    check(quiet and [round(x, 6) for x in quiet.get("sampled_ms", [])] == [0, 30, 60],
          f"background thread sampled {quiet and quiet.get('sampled_ms')}")
    up = r["uploads"]
    check(up and up["stream"] == "18" and [[round(t, 6), round(g, 6)] for t, g in up["done_gb"]] == [[30, 2], [60, 3]],
          f"uploads {up}")
    # The command line, with --json.
    out = os.path.join(work, "out.json")
    p = subprocess.run([sys.executable, script, path, "--json", out], capture_output=True, text=True)
    check(p.returncode == 0 and "cudaStreamSynchronize at 40.0 for 12.0" in p.stdout,
          f"command line: rc {p.returncode}, {p.stdout}{p.stderr}")
    check(os.path.exists(out) and "18" == json.load(open(out))["uploads"]["stream"], "--json output")
    # Bad input: named in the message, nonzero exit.
    bad = os.path.join(work, "bad.json")
    with open(bad, "w") as f:
        f.write("{not json")
    p = subprocess.run([sys.executable, script, bad], capture_output=True, text=True)
    check(p.returncode != 0 and "bad.json" in p.stderr, f"bad input: rc {p.returncode}, {p.stderr}")
    empty = os.path.join(work, "cpu_only.json")
    with open(empty, "w") as f:
        json.dump({"traceEvents": [events[6]]}, f)
    p = subprocess.run([sys.executable, script, empty], capture_output=True, text=True)
    check(p.returncode != 0 and "cpu_only.json" in p.stderr, f"no GPU activity: rc {p.returncode}, {p.stderr}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("host_timeline: all checks passed")
