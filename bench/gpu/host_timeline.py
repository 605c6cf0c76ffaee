#!/usr/bin/env python3
"""Where the host threads of a profiled step wait, beside the device streams.

Reads a Kineto trace (the trainer's --profile_step) and prints, relative to the
trace's first event: each device stream's first and last activity; each host
thread's CUDA runtime calls (count, first, last) with its long waits
(cudaEventSynchronize, cudaStreamSynchronize, cudaMalloc, cudaFree over
--min-ms), and for the threads with few calls (the engine's background
threads: one wait per bucket) every --every-th call's time, which shows their
progress through the buckets; and the bytes copied host-to-device on the
busiest upload stream, cumulated over time.

  python3 bench/gpu/host_timeline.py profile-step-10.json [--min-ms 1.5]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=1.5, help="the shortest wait listed")
    ap.add_argument("--every", type=int, default=6, help="the sampling of background threads' calls")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    t0 = min(e["ts"] for e in events)
    ms = lambda ts: (ts - t0) / 1000.0
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    print(f"{args.trace}: times in ms from the trace's first event")
    for stream in sorted({e["tid"] for e in device}, key=str):
        on = [e for e in device if e["tid"] == stream]
        print(f"  stream {stream}: first {ms(min(e['ts'] for e in on)):.1f}, last end "
              f"{ms(max(e['ts'] + e['dur'] for e in on)):.1f}, {len(on)} activities")
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    waits = {"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree"}
    for tid, count in collections.Counter(e["tid"] for e in runtime).most_common():
        calls = sorted((e for e in runtime if e["tid"] == tid), key=lambda e: e["ts"])
        print(f"  host thread {tid}: {count} runtime calls, {ms(calls[0]['ts']):.1f} .. "
              f"{ms(calls[-1]['ts'] + calls[-1]['dur']):.1f}")
        if count < 200:
            print("    every %d-th call at: %s" % (args.every, " ".join(f"{ms(e['ts']):.0f}" for e in calls[::args.every])))
            continue
        for e in calls:
            if e["name"] in waits and e["dur"] >= args.min_ms * 1000:
                print(f"    {e['name']} at {ms(e['ts']):.1f} for {e['dur'] / 1000:.1f}")
    uploads = [e for e in device if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    if uploads:
        by_stream = collections.Counter()
        for e in uploads:
            by_stream[e["tid"]] += e.get("args", {}).get("bytes", 0)
        stream = by_stream.most_common(1)[0][0]
        done, marks = 0, []
        for e in sorted((e for e in uploads if e["tid"] == stream), key=lambda e: e["ts"]):
            done += e.get("args", {}).get("bytes", 0)
            marks.append(f"{ms(e['ts'] + e['dur']):.0f}:{done / 1e9:.1f}")
        print(f"  uploads on stream {stream} (ms:GB done): " + " ".join(marks[::12] + marks[-1:]))


if __name__ == "__main__":
    main()
