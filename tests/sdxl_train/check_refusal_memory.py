#!/usr/bin/env python3
"""Refusing a hostile input costs memory in proportion to its size (issue #21, defect 10; stdlib only).

  check_refusal_memory.py TRAIN CONFIG WORKDIR

The trainer (one process, MPI's singleton mode: no mpirun in the measured
process tree) is given generated adversarial inputs, each refused:
a TOML configuration over the size limit and one within it holding a
250,000-element array; a UNet config.json (--model_config) over the size
limit, one nested 500,000 deep, one holding a 400,000-element array; a
safetensors file (--model_weights) whose 60 MB header lists a million
tensors and whose data section then has a hole, one whose single tensor has
a million dimensions, and one whose __metadata__ holds a million entries.

For each, the peak resident set of the process tree (wait4's ru_maxrss) is
compared with that of the same program refusing a tiny bad input of the same
kind, at the same point (LibTorch and the model make a fixed baseline):

    peak - baseline <= 4 x input size

and the refusal must name the limit (or the defect) and take under 60 s.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import time

TRAIN, CONFIG, WORK = sys.argv[1:4]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402
MiB = 1 << 20


def run_refused(*overrides):
    """Runs the trainer as one process; returns (exit code, stderr, its peak RSS in bytes, seconds)."""
    out = os.path.join(WORK, "run")
    cmd = [TRAIN, "--output_dir", out, "--steps", "1", *overrides]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # stderr is read before the wait: a long message must not block the child.
    # wait4 gives this child's own resource usage, unlike RUSAGE_CHILDREN,
    # which keeps the maximum of every child so far.
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, stderr.decode(errors="replace"), usage.ru_maxrss * 1024, time.time() - start


def write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


def safetensors_bytes(header_text, data=b""):
    header = header_text.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def measure(kind, baseline, path, refusal, overrides_of):
    code, err, peak, seconds = run_refused(*overrides_of(path))
    size = os.path.getsize(path)
    grown = peak - baseline
    message = next((line for line in err.splitlines() if refusal in line), None)
    check(code != 0 and message is not None,
          f"{kind}: refused ({refusal!r} in the message; exit {code})")
    if message is None:
        print("    | " + "\n    | ".join(err.splitlines()[-8:]))
    else:
        print("    > " + message[:300])
    check(grown <= 4 * size, f"{kind}: peak {peak / MiB:.1f} MiB - baseline {baseline / MiB:.1f} MiB = "
          f"{grown / MiB:.1f} MiB <= 4 x input {size / MiB:.2f} MiB")
    check(seconds < 60, f"{kind}: refused in {seconds:.1f} s")


def baseline_of(kind, *overrides):
    code, err, peak, seconds = run_refused(*overrides)
    check(code != 0, f"{kind} baseline: the tiny bad input is refused (exit {code}, {seconds:.1f} s)")
    print(f"  baseline {kind}: {peak / MiB:.1f} MiB")
    return peak


INPUTS = {
    "tiny_bad.toml": lambda: "[data]\nnot_a_key = 1\n",
    "huge_array.toml": lambda: "[model]\nfreeze = [" + '"a", ' * 6_000_000 + '"a"]\n',
    "many_values.toml": lambda: "[model]\nfreeze = [" + "'a'," * 250_000 + "'a']\n",
    "tiny_bad.json": lambda: '{"layers_per_block": -1}',
    "huge.json": lambda: "[" + "0," * 10_000_000 + "0]",
    "deep.json": lambda: "[" * 500_000 + "]" * 500_000,
    "wide.json": lambda: '{"layers_per_block": [' + "0," * 400_000 + "0]}",
    "tiny_bad.safetensors":
        lambda: safetensors_bytes('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0\0"),
    "many_tensors.safetensors": lambda: safetensors_bytes(
        "{" + ",".join(f'"t{i:07d}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
                       for i in range(1_000_000)) + "}", b"\0" * 1_000_001),
    "rank.safetensors": lambda: safetensors_bytes(
        '{"a":{"dtype":"U8","shape":[' + "1," * 1_000_000 + '1],"data_offsets":[0,1]}}', b"\0"),
    "metadata.safetensors": lambda: safetensors_bytes(
        '{"__metadata__":{' + ",".join(f'"k{i}":""' for i in range(1_000_000)) + "}}"),
}

if len(sys.argv) > 4 and sys.argv[4] == "--generate":
    # In a process of its own: Linux keeps a process's peak RSS across fork
    # and exec, so the measured trainer must not be forked from a parent
    # that held these texts.
    for name, make in INPUTS.items():
        write(os.path.join(WORK, name), make())
    sys.exit(0)

shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
subprocess.run([sys.executable, __file__, TRAIN, CONFIG, WORK, "--generate"], check=True)
at = lambda name: os.path.join(WORK, name)  # noqa: E731

# --- TOML configuration
toml_overrides = lambda path: ["--config", path]  # noqa: E731
base = baseline_of("TOML", *toml_overrides(at("tiny_bad.toml")))
measure("a 30 MB TOML array", base, at("huge_array.toml"), "kMaxConfigBytes", toml_overrides)
measure("a TOML array of 250,000 entries within 1 MiB", base, at("many_values.toml"), "kMaxConfigValues",
        toml_overrides)

# --- UNet config.json (JSON: size, nesting, values); the config's other options valid for one step
json_overrides = lambda path: ["--config", CONFIG, "--warmup_steps", "0", "--model_config", path]  # noqa: E731
base = baseline_of("UNet config", *json_overrides(at("tiny_bad.json")))
measure("a 20 MB UNet config", base, at("huge.json"), "kMaxConfigBytes", json_overrides)
measure("a UNet config nested 500,000 deep", base, at("deep.json"), "nested more than 8 deep", json_overrides)
measure("a UNet config of a 400,000-element array", base, at("wide.json"), "more than 10000 JSON values",
        json_overrides)

# --- safetensors weights (--model_weights)
weights_overrides = lambda path: ["--config", CONFIG, "--warmup_steps", "0", "--model_weights", path]  # noqa: E731
base = baseline_of("safetensors", *weights_overrides(at("tiny_bad.safetensors")))
measure("a 60 MB header of a million tensors, then a hole", base, at("many_tensors.safetensors"),
        "belong to no tensor", weights_overrides)
measure("a tensor of a million dimensions", base, at("rank.safetensors"), "JSON values", weights_overrides)
measure("__metadata__ of a million entries", base, at("metadata.safetensors"), "kMaxMetadataValues",
        weights_overrides)

shutil.rmtree(WORK, ignore_errors=True)
if failures:
    print(f"{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("every refusal stayed within 4x its input's size")
