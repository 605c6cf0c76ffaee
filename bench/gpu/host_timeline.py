#!/usr/bin/env python3
"""Where the host threads of a profiled step wait, beside the device streams.

Reads a Kineto trace (the trainer's --profile_step) and prints, in ms from the
trace's first event: each device stream's first and last activity; each host
thread's CUDA runtime calls (count, first, last) with its long waits
(cudaEventSynchronize, cudaStreamSynchronize, cudaDeviceSynchronize,
cudaMalloc, cudaFree of at least --min-ms); for the threads with few calls
(the engine's background threads, one wait per bucket) every --every-th
call's time, which shows their progress through the buckets; and the bytes
copied host-to-device on the stream that copied the most, cumulated over time.

  python3 bench/gpu/host_timeline.py profile-step-10.json [--min-ms 1.5] [--every 6] [--json out.json]
"""
import argparse
import collections
import json
import sys

WAITS = {"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree"}
FEW_CALLS = 200  # below this a thread is listed by its calls' times, not its waits


def stream_of(event):
    return event.get("args", {}).get("stream", event.get("tid"))


def analyze(path, min_ms=1.5, every=6):
    try:
        with open(path) as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"{path}: not a Kineto trace ({error})")
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    if not device and not runtime:
        raise SystemExit(f"{path}: no GPU activity and no CUDA runtime calls in the trace")
    t0 = min(e["ts"] for e in events)
    ms = lambda ts: (ts - t0) / 1000.0
    result = {"streams": {}, "threads": [], "uploads": None}
    for stream in sorted({stream_of(e) for e in device}, key=str):
        on = [e for e in device if stream_of(e) == stream]
        result["streams"][str(stream)] = {"first_ms": ms(min(e["ts"] for e in on)),
                                          "last_end_ms": ms(max(e["ts"] + e["dur"] for e in on)),
                                          "activities": len(on)}
    for tid, count in collections.Counter(e["tid"] for e in runtime).most_common():
        calls = sorted((e for e in runtime if e["tid"] == tid), key=lambda e: e["ts"])
        thread = {"tid": tid, "calls": count, "first_ms": ms(calls[0]["ts"]),
                  "last_ms": ms(calls[-1]["ts"] + calls[-1]["dur"])}
        if count < FEW_CALLS:
            thread["sampled_ms"] = [ms(e["ts"]) for e in calls[::every]]
        else:
            thread["waits"] = [{"name": e["name"], "at_ms": ms(e["ts"]), "ms": e["dur"] / 1000.0}
                               for e in calls if e["name"] in WAITS and e["dur"] >= min_ms * 1000]
        result["threads"].append(thread)
    uploads = [e for e in device if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    if uploads:
        by_stream = collections.Counter()
        for e in uploads:
            by_stream[stream_of(e)] += e.get("args", {}).get("bytes", 0)
        stream = by_stream.most_common(1)[0][0]
        done, marks = 0, []
        for e in sorted((e for e in uploads if stream_of(e) == stream), key=lambda e: e["ts"]):
            done += e.get("args", {}).get("bytes", 0)
            marks.append([ms(e["ts"] + e["dur"]), done / 1e9])
        result["uploads"] = {"stream": str(stream), "done_gb": marks}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=1.5, help="the shortest wait listed")
    ap.add_argument("--every", type=int, default=6, help="the sampling of background threads' calls")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    r = analyze(args.trace, args.min_ms, args.every)
    print(f"{args.trace}: times in ms from the trace's first event")
    for stream, s in r["streams"].items():
        print(f"  stream {stream}: first {s['first_ms']:.1f}, last end {s['last_end_ms']:.1f}, "
              f"{s['activities']} activities")
    for t in r["threads"]:
        print(f"  host thread {t['tid']}: {t['calls']} runtime calls, {t['first_ms']:.1f} .. {t['last_ms']:.1f}")
        if "sampled_ms" in t:
            print(f"    every {args.every}-th call at: " + " ".join(f"{x:.0f}" for x in t["sampled_ms"]))
        for w in t.get("waits", []):
            print(f"    {w['name']} at {w['at_ms']:.1f} for {w['ms']:.1f}")
    if r["uploads"]:
        marks = r["uploads"]["done_gb"]
        shown = marks[::12] + ([marks[-1]] if (len(marks) - 1) % 12 else [])
        print(f"  uploads on stream {r['uploads']['stream']} (ms:GB done): " +
              " ".join(f"{t:.0f}:{gb:.1f}" for t, gb in shown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
