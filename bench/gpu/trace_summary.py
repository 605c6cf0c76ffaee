#!/usr/bin/env python3
"""Where one profiled step's GPU time goes, from a Kineto/Chrome trace
(the trainer's profile_step, unet_bench --profile).

  python3 bench/gpu/trace_summary.py TRACE.json [--top 30] [--json OUT]

Prints the GPU span (first kernel start to last end), the busy time (the
union of kernel, memcpy and memset intervals on all streams), the idle gaps
over 0.1 ms, the time by kind (matmul, attention, normalization, elementwise,
optimizer, reduction, copy, collective) and the top kernels by total time."""
import argparse
import json
import re
import sys

KINDS = [
    ("collective", r"nccl"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|sm90_|cublas|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("convolution", r"conv|implicit|winograd|dgrad|wgrad|fprop"),
    ("normalization", r"norm|layer_norm|group_norm"),
    ("optimizer", r"adam|multi_tensor|optimizer|ema|lion|sgd"),
    ("reduction", r"reduce|sum|norm_kernel|amax"),
    ("copy", r"copy|cast|convert|transpose|cat_|fill|memcpy|memset"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|gelu|geglu|add|mul"),
]


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    with open(a.trace) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        sys.exit(f"{a.trace}: no kernel, gpu_memcpy or gpu_memset events")
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu)
    span = intervals[-1][1] - intervals[0][0]
    busy, gaps = 0.0, []
    cur_start, cur_end = intervals[0]
    for s, t in intervals[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            if s - cur_end > 100:
                gaps.append((cur_end - intervals[0][0], s - cur_end))
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    busy += cur_end - cur_start
    by_kind, by_name, counts = {}, {}, {}
    for e in gpu:
        name = e.get("name", "?")
        d = float(e.get("dur", 0))
        k = "copy" if e["cat"] != "kernel" else kind_of(name)
        by_kind[k] = by_kind.get(k, 0.0) + d
        by_name[name] = by_name.get(name, 0.0) + d
        counts[name] = counts.get(name, 0) + 1
    total = sum(by_kind.values())
    print(f"{a.trace}: {len(gpu)} GPU events, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
          f"({100 * busy / span:.1f}%), summed durations {total / 1e3:.2f} ms (streams overlap)")
    print(f"idle gaps over 0.1 ms: {len(gaps)}, {sum(g for _, g in gaps) / 1e3:.2f} ms in all; largest: " +
          ", ".join(f"{g / 1e3:.2f} ms at +{at / 1e3:.1f}" for at, g in sorted(gaps, key=lambda x: -x[1])[:8]))
    print("by kind (ms, share of summed durations):")
    for k, d in sorted(by_kind.items(), key=lambda x: -x[1]):
        print(f"  {k:14s} {d / 1e3:9.2f}  {100 * d / total:5.1f}%")
    print(f"top {a.top} kernels (ms, calls):")
    for name, d in sorted(by_name.items(), key=lambda x: -x[1])[:a.top]:
        print(f"  {d / 1e3:8.2f} {counts[name]:6d}  {name[:150]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "events": len(gpu), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
                       "gaps_ms": [g / 1e3 for _, g in gaps], "by_kind_ms": {k: d / 1e3 for k, d in by_kind.items()},
                       "top": [{"name": n, "ms": d / 1e3, "calls": counts[n]}
                               for n, d in sorted(by_name.items(), key=lambda x: -x[1])[:a.top]]}, f, indent=1)


if __name__ == "__main__":
    main()
