"""What the end-to-end test scripts (tests/sdxl_train, tests/sdxl_prepare)
share, stdlib only: named checks that collect their failures, commands run
with a timeout and a one-line log, and the exit status at the end. A script
imports it with tests/ on sys.path:

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from e2e_harness import check, failures
"""
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time

failures = []


def check(condition, message):
    """Prints ok/FAIL with the message; a failure is remembered for finish()."""
    print(("ok   " if condition else "FAIL ") + message, flush=True)
    if not condition:
        failures.append(message)
    return condition


def run(cmd, expect_ok=True, env=None, timeout=300):
    """Runs cmd, logs its time, exit status and first arguments (file paths
    by their last part); a failure stops the script unless expect_ok is False."""
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    shown = " ".join(os.path.basename(c) if os.sep in c else c for c in cmd[1:18])
    print(f"  [{time.time() - start:.1f} s, rc {result.returncode}] {os.path.basename(cmd[0])} {shown}", flush=True)
    if expect_ok and result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-6000:])
        raise SystemExit(f"command failed ({result.returncode})")
    return result


def read_safetensors(path, raw=False):
    """name -> (dtype, shape, values: a tuple of floats for F32, else the raw
    bytes; raw=True: the raw bytes for every dtype), and the metadata."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        data = body[info["data_offsets"][0]:info["data_offsets"][1]]
        values = struct.unpack(f"<{len(data) // 4}f", data) if info["dtype"] == "F32" and not raw else data
        out[name] = (info["dtype"], info["shape"], values)
    return out, header.get("__metadata__", {})


def finish():
    """Exits 1 when a check failed, else says all passed."""
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


def load_dataset_writer():
    """tests/sdxl_train/cached_dataset_writer.py as a module (its dataclasses
    look their module up in sys.modules, so it is registered there)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdxl_train", "cached_dataset_writer.py")
    spec = importlib.util.spec_from_file_location("cached_dataset_writer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def pattern_values(count, seed, code="<f"):
    """count values in [-1, 1), packed with struct code `code` ("<f": float32,
    "<e": float16): a different, reproducible pattern per seed."""
    return b"".join(struct.pack(code, ((seed * 7919 + k * 104729) % 2000) / 1000.0 - 1.0) for k in range(count))
