#!/usr/bin/env python3
"""bench/gpu/stream_timeline.py on synthetic Kineto traces: the compute stream
is the one with the most kernel time, its gaps carry the copies that overlap
them (by the share of each copy's time inside), and input that is not a
trace, or has no kernels, stops it with a message naming the file."""
import json
import os
import subprocess
import sys
import tempfile

script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
import stream_timeline  # noqa: E402


def kernel(stream, start_ms, end_ms, name):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
            "args": {"stream": stream}}


def memcpy(stream, start_ms, end_ms, direction, nbytes):
    return {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy {direction} (Pinned -> Device)", "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": {"stream": stream, "bytes": nbytes}}


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


events = [
    kernel(7, 0, 10, "fwd_a"), kernel(7, 10, 20, "fwd_b"), kernel(7, 50, 60, "fwd_c"),
    kernel(7, 60.2, 70, "fwd_d"),  # a 0.2 ms gap: under --gap-ms
    kernel(20, 30, 31, "ema_round"),  # less kernel time: not the compute stream
    memcpy(20, 15, 45, "HtoD", 3e9),  # 25 of its 30 ms inside the gap [20, 50]
    memcpy(13, 5, 25, "DtoH", 1e9),   # 5 of its 20 ms inside the gap
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},  # not GPU activity
]
with tempfile.TemporaryDirectory() as work:
    path = os.path.join(work, "trace.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    r = stream_timeline.analyze(path, gap_ms=0.5)
    check(r["compute_stream"] == 7, f"compute stream {r['compute_stream']}, expected 7")
    check(abs(r["span_ms"] - 70) < 1e-6, f"span {r['span_ms']}, expected 70")
    check(abs(r["compute_busy_ms"] - 39.8) < 1e-6, f"busy {r['compute_busy_ms']}, expected 39.8")
    check(len(r["gaps"]) == 1, f"{len(r['gaps'])} gaps, expected 1 (the 0.2 ms one is under 0.5)")
    g = r["gaps"][0]
    check(abs(g["ms"] - 30) < 1e-6 and abs(g["at_ms"] - 20) < 1e-6, f"gap {g}, expected 30 ms at 20")
    check(abs(g["h2d_gb"] - 2.5) < 1e-9, f"up during the gap {g['h2d_gb']} GB, expected 2.5")
    check(abs(g["d2h_gb"] - 0.25) < 1e-9, f"down during the gap {g['d2h_gb']} GB, expected 0.25")
    check(g["before"] == "fwd_b" and g["after"] == "fwd_c", f"neighbours {g['before']}, {g['after']}")
    s20 = r["streams"]["20"]
    check(abs(s20["h2d_gb"] - 3) < 1e-9 and abs(s20["h2d_ms"] - 30) < 1e-6, f"stream 20 {s20}")
    r = stream_timeline.analyze(path, gap_ms=0.1)
    check(len(r["gaps"]) == 2, f"{len(r['gaps'])} gaps at --gap-ms 0.1, expected 2")
    # The command line, with --json.
    out = os.path.join(work, "out.json")
    p = subprocess.run([sys.executable, script, path, "--json", out], capture_output=True, text=True)
    check(p.returncode == 0 and "compute stream 7" in p.stdout, f"command line: rc {p.returncode}, {p.stdout}{p.stderr}")
    check(os.path.exists(out) and json.load(open(out))["compute_stream"] == 7, "--json output")
    # Bad input: named in the message, nonzero exit.
    bad = os.path.join(work, "bad.json")
    with open(bad, "w") as f:
        f.write("{not json")
    p = subprocess.run([sys.executable, script, bad], capture_output=True, text=True)
    check(p.returncode != 0 and "bad.json" in p.stderr, f"bad input: rc {p.returncode}, {p.stderr}")
    empty = os.path.join(work, "cpu_only.json")
    with open(empty, "w") as f:
        json.dump({"traceEvents": [events[-1]]}, f)
    p = subprocess.run([sys.executable, script, empty], capture_output=True, text=True)
    check(p.returncode != 0 and "cpu_only.json" in p.stderr and "no GPU kernels" in p.stderr,
          f"no kernels: rc {p.returncode}, {p.stderr}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("stream_timeline: all checks passed")
