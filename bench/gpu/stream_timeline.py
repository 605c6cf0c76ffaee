#!/usr/bin/env python3
"""Where the compute stream waits in a Kineto trace (train --profile_step), and
what the copy engines were doing meanwhile.

    python3 stream_timeline.py trace.json [--gap-ms 0.5] [--top 15] [--json out.json]

Per CUDA stream: busy time (union of its kernels, copies and fills), kernels,
and bytes and time copied host-to-device and device-to-host. The compute
stream is the one with the most kernel time. Its idle gaps of at least
--gap-ms are listed longest first, each with where it starts in the traced
span, the kernels on either side, and the host-to-device and device-to-host
bytes copied during it (a copy that overlaps the gap counted by the share of
its time inside it). With the offloaded update, gaps that fill with
host-to-device bytes are the forward waiting for parameters still going up."""
import argparse
import json
import sys

from kernel_summary import merged, union_length  # the same interval union as the kernel summary


def read_events(path):
    """The trace's events (a JSON list, or an object's 'traceEvents'); exits naming the file if unreadable."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"{path}: not a readable Kineto trace ({e})")
    events = trace["traceEvents"] if isinstance(trace, dict) and "traceEvents" in trace else trace
    if not isinstance(events, list):
        sys.exit(f"{path}: expected a JSON list of events or an object with 'traceEvents'")
    return events


def device_activities(path, events):
    """The GPU's kernels, copies (h2d, d2h, copy) and fills among `events`; exits if there is no kernel."""
    acts = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = ev.get("args", {}) or {}
        name = str(ev.get("name", "?"))
        if cat == "kernel":
            kind = "kernel"
        elif cat == "gpu_memset":
            kind = "fill"
        elif "HtoD" in name:
            kind = "h2d"
        elif "DtoH" in name:
            kind = "d2h"
        else:
            kind = "copy"
        ts, dur = float(ev.get("ts", 0)), float(ev.get("dur", 0))
        acts.append({"stream": args.get("stream", -1), "kind": kind, "name": name, "start": ts, "end": ts + dur,
                     "bytes": float(args.get("bytes", 0) or 0)})
    if not any(a["kind"] == "kernel" for a in acts):
        sys.exit(f"{path}: no GPU kernels in the trace (was it a CUDA run with --profile_step?)")
    return acts


def load_activities(path):
    return device_activities(path, read_events(path))


def overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def analyze(path, gap_ms=0.5):
    acts = load_activities(path)
    span0 = min(a["start"] for a in acts)
    span1 = max(a["end"] for a in acts)
    streams = {}
    for a in acts:
        s = streams.setdefault(a["stream"], {"intervals": [], "kernels": 0, "kernel_us": 0.0,
                                             "h2d_bytes": 0.0, "h2d_us": 0.0, "d2h_bytes": 0.0, "d2h_us": 0.0})
        s["intervals"].append((a["start"], a["end"]))
        if a["kind"] == "kernel":
            s["kernels"] += 1
            s["kernel_us"] += a["end"] - a["start"]
        elif a["kind"] in ("h2d", "d2h"):
            s[a["kind"] + "_bytes"] += a["bytes"]
            s[a["kind"] + "_us"] += a["end"] - a["start"]
    compute = max(streams, key=lambda k: streams[k]["kernel_us"])
    busy = merged(streams[compute]["intervals"])
    on_compute = [a for a in acts if a["stream"] == compute]  # kernels, and any copy or fill queued there
    copies = [a for a in acts if a["kind"] in ("h2d", "d2h")]
    gaps = []
    for (_, end), (start, _) in zip(busy, busy[1:]):
        if (start - end) / 1e3 < gap_ms:
            continue
        moved = {"h2d": 0.0, "d2h": 0.0}
        for c in copies:
            inside = overlap(end, start, c["start"], c["end"])
            if inside > 0 and c["end"] > c["start"]:
                moved[c["kind"]] += c["bytes"] * inside / (c["end"] - c["start"])
        before = max((k for k in on_compute if k["end"] <= end), key=lambda k: k["end"], default=None)
        after = min((k for k in on_compute if k["start"] >= start), key=lambda k: k["start"], default=None)
        gaps.append({"at_ms": (end - span0) / 1e3, "ms": (start - end) / 1e3,
                     "h2d_gb": moved["h2d"] / 1e9, "d2h_gb": moved["d2h"] / 1e9,
                     "before": before["name"][:80] if before else "", "after": after["name"][:80] if after else ""})
    gaps.sort(key=lambda g: -g["ms"])
    busy_us = sum(end - start for start, end in busy)  # already disjoint
    return {
        "trace": path,
        "span_ms": (span1 - span0) / 1e3,
        "compute_stream": compute,
        "compute_busy_ms": busy_us / 1e3,
        "compute_idle_in_gaps_ms": sum(g["ms"] for g in gaps),
        "streams": {str(k): {"busy_ms": union_length(v["intervals"]) / 1e3,
                             "kernels": v["kernels"], "kernel_ms": v["kernel_us"] / 1e3,
                             "h2d_gb": v["h2d_bytes"] / 1e9, "h2d_ms": v["h2d_us"] / 1e3,
                             "d2h_gb": v["d2h_bytes"] / 1e9, "d2h_ms": v["d2h_us"] / 1e3}
                    for k, v in sorted(streams.items(), key=lambda kv: str(kv[0]))},
        "gaps": gaps,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=0.5, help="shortest idle gap of the compute stream listed")
    ap.add_argument("--top", type=int, default=15, help="gaps listed, longest first")
    ap.add_argument("--json", help="write the analysis (every gap) to this file")
    args = ap.parse_args()
    r = analyze(args.trace, args.gap_ms)
    print(f"== {r['trace']}: span {r['span_ms']:.1f} ms; compute stream {r['compute_stream']} busy "
          f"{r['compute_busy_ms']:.1f} ms, idle {r['compute_idle_in_gaps_ms']:.1f} ms in "
          f"{len(r['gaps'])} gaps of at least {args.gap_ms} ms")
    for k, s in r["streams"].items():
        print(f"  stream {k:>4}: busy {s['busy_ms']:8.1f} ms, {s['kernels']:5d} kernels {s['kernel_ms']:8.1f} ms, "
              f"up {s['h2d_gb']:6.2f} GB in {s['h2d_ms']:7.1f} ms, down {s['d2h_gb']:6.2f} GB in {s['d2h_ms']:7.1f} ms")
    print("  -- the compute stream's longest gaps (at: ms into the span)")
    for g in r["gaps"][: args.top]:
        print(f"  {g['ms']:7.2f} ms at {g['at_ms']:7.1f}: up {g['h2d_gb']:5.2f} GB, down {g['d2h_gb']:5.2f} GB meanwhile; "
              f"after {g['before'][:40]!r}, before {g['after'][:40]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
