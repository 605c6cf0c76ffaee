#!/usr/bin/env python3
"""Sums the GPU kernels of Kineto traces (unet_bench --profile, train --profile_step)
by kernel family, and says how busy the GPU was over the traced span.

    python3 kernel_summary.py trace.json [more.json ...] [--json out.json] [--top 25]

Families are decided from kernel names (first match wins, attention before
convolution because cuDNN's attention kernels are called *_sdpa_*fprop*).
GPU busy = union of kernel and memcpy/memset intervals; span = first CPU
operator start to last GPU activity end. busy/span well below 1 means the
step waits on the host (launch overhead or synchronization)."""
import argparse
import json
import re
import sys

FAMILIES = [
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("convolution", r"fprop|dgrad|wgrad|conv|implicit_gemm|cudnn|xmma"),
    ("matmul", r"gemm|cutlass|nvjet|cublas|sm90_|sm100_"),
    ("layout (NCHW<->NHWC, transpose)", r"nchwtonhwc|nhwctonchw|transpose|permute"),
    ("group_norm", r"groupnorm|group_norm|rowwisemoments|computefusedparams|internalgradients|backwardfusedparams"),
    ("copy / cast / cat", r"copy|memcpy|memset|cat_array|catarray|fill"),
    ("reduction", r"reduce"),
    ("softmax / norm", r"softmax|layer_norm|layernorm"),
    ("elementwise", r"elementwise|vectorized|unrolled|launch_"),
]


def family(name):
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def merged(intervals):
    """The union of (start, end) intervals as sorted, disjoint [start, end] lists."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def union_length(intervals):
    return sum(e - s for s, e in merged(intervals))


def summarize(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu, cpu_starts, launches = [], [], 0
    per_name = {}
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        ts, dur = float(ev.get("ts", 0)), float(ev.get("dur", 0))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append((ts, ts + dur))
            name = ev.get("name", "?")
            rec = per_name.setdefault(name, [0, 0.0])
            rec[0] += 1
            rec[1] += dur
        elif cat in ("cpu_op", "user_annotation"):
            cpu_starts.append(ts)
        elif cat == "cuda_runtime" and re.search(r"launch", str(ev.get("name", "")).lower()):
            launches += 1
    if not gpu:
        sys.exit(f"{path}: no GPU kernels in the trace (was it a CUDA run?)")
    start = min(cpu_starts + [s for s, _ in gpu])
    end = max(e for _, e in gpu)
    fams = {}
    for name, (count, dur) in per_name.items():
        f = fams.setdefault(family(name), [0, 0.0])
        f[0] += count
        f[1] += dur
    kernel_sum = sum(d for _, d in fams.values())
    return {
        "trace": path,
        "span_ms": (end - start) / 1e3,
        "gpu_busy_ms": union_length(gpu) / 1e3,
        "kernel_sum_ms": kernel_sum / 1e3,
        "kernels": sum(c for c, _ in fams.values()),
        "launch_calls": launches,
        "families": {k: {"count": c, "ms": d / 1e3, "share": d / kernel_sum} for k, (c, d) in
                     sorted(fams.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": n[:160], "count": c, "ms": d / 1e3} for n, (c, d) in
                sorted(per_name.items(), key=lambda kv: -kv[1][1])],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", help="write the summaries to this file")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by total time")
    args = ap.parse_args()
    out = []
    for path in args.traces:
        s = summarize(path)
        print(f"== {path}: span {s['span_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms "
              f"({100 * s['gpu_busy_ms'] / s['span_ms']:.0f}%), {s['kernels']} kernels, "
              f"{s['launch_calls']} launch calls")
        for fam, r in s["families"].items():
            print(f"  {fam:34s} {r['ms']:9.2f} ms {100 * r['share']:5.1f}%  ({r['count']} kernels)")
        print("  -- top kernels")
        for r in s["top"][: args.top]:
            print(f"  {r['ms']:9.2f} ms {r['count']:5d}x  {r['name'][:110]}")
        s["top"] = s["top"][: args.top]
        out.append(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
