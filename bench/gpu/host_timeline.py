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

from stream_timeline import device_activities, read_events  # the same reading of the trace's GPU side

WAITS = {"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree"}
FEW_CALLS = 200  # below this a thread is listed by its calls' times, not its waits


def analyze(path, min_ms=1.5, every=6):
    events = [e for e in read_events(path) if isinstance(e, dict)]
    device = device_activities(path, events)  # exits naming the file when there is no kernel
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    t0 = min(float(e["ts"]) for e in events if e.get("ph") == "X" and "ts" in e)
    ms = lambda ts: (ts - t0) / 1000.0
    result = {"streams": {}, "threads": [], "uploads": None}
    for stream in sorted({a["stream"] for a in device}, key=str):
        on = [a for a in device if a["stream"] == stream]
        result["streams"][str(stream)] = {"first_ms": ms(min(a["start"] for a in on)),
                                          "last_end_ms": ms(max(a["end"] for a in on)), "activities": len(on)}
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
    uploads = [a for a in device if a["kind"] == "h2d"]
    if uploads:
        by_stream = collections.Counter()
        for a in uploads:
            by_stream[a["stream"]] += a["bytes"]
        stream = by_stream.most_common(1)[0][0]
        done, marks = 0.0, []
        for a in sorted((a for a in uploads if a["stream"] == stream), key=lambda a: a["start"]):
            done += a["bytes"]
            marks.append([ms(a["end"]), done / 1e9])
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
