"""[device] cuda_graph at every stage, on the GPU (CTest label gpu): the tiny
UNet trains 12 steps eagerly and with the micro-step captured after the
first step and replayed, at stages 0-1 (forward and backward in the graph,
gradients bound to the engine's buffer) and 2-3 (the whole micro-step: the
hooks' gradient writes, the reduce-scatters and, at stage 3, the unit
gathers), then with activation checkpointing at stages 2 and 3 (the
reentrant recompute, a backward inside backward, captured with the rest; at
stage 3 the units' gathers for the recompute too).

Both runs use [device] deterministic = true: LibTorch's default kernels
include some that accumulate with atomics (cuDNN weight gradients,
attention's dQ), which made eager and graph runs differ by up to 1.06e-6 in
the loss after 12 steps (H200, 2026-12-05) and failed the 1e-6 bound the
test had then. With deterministic kernels a replay must do exactly what the
eager step does, so the bound is none: every step's loss and every exported
weight equal bit for bit, at every stage. (When they are not, the largest
differences are printed to tell a capture bug from a kernel choice.)
The graph run's images/s is printed beside the eager one's.

Exits 77 (skipped) without a visible GPU or with a CPU-only LibTorch.
Usage: check_train_graph.py TRAIN MPIEXEC CONFIG WORK [MPI flags...]
"""
import json
import math
import os
import shutil
import subprocess
import sys

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
STEPS = 12
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, finish, read_safetensors, run  # noqa: E402

if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
    print("skipped: no visible GPU (nvidia-smi -L)")
    sys.exit(77)
os.makedirs(WORK, exist_ok=True)


def train(name, *overrides):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", "1", *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out, "--device", "cuda",
           "--steps", str(STEPS), "--synthetic_samples", "64", "--log_every", "1", "--checkpoint_every", "0",
           "--deterministic", "true", "--export_dtype", "fp32", *overrides]
    result = run(cmd, expect_ok=False, timeout=600)
    if result.returncode != 0 and "no GPU" in result.stdout + result.stderr:
        print("skipped: the trainer sees no GPU")
        sys.exit(77)
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-6000:])
        raise SystemExit(f"train {name} failed ({result.returncode})")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return out, {r["step"]: r for r in rows}


def tensors(path):
    found, _ = read_safetensors(path)
    for name, (dtype, _, _) in found.items():
        assert dtype == "F32", (name, dtype)
    return {name: values for name, (_, _, values) in found.items()}


def relative(a, b):
    return abs(a - b) / max(abs(a), 1e-30)


CASES = [(stage, ()) for stage in ("0", "1", "2", "3")] + \
        [(stage, ("--activation_checkpointing", "true")) for stage in ("2", "3")]
for stage, extra in CASES:
    name = f"stage{stage}" + ("-ckpt" if extra else "")
    eager_dir, eager = train(f"{name}-eager", "--stage", stage, *extra)
    graph_dir, graph = train(f"{name}-graph", "--stage", stage, "--cuda_graph", "true", *extra)
    stage = f"{stage}{' with checkpointing' if extra else ''}"
    check(sorted(graph) == list(range(1, STEPS + 1)), f"stage {stage}: the graph run logged every step")
    same_losses = all(eager[s]["loss"] == graph[s]["loss"] for s in eager)
    worst = max(relative(eager[s]["loss"], graph[s]["loss"]) for s in eager)
    check(same_losses, f"stage {stage}: the graph's losses equal eager's bit for bit at every step "
          f"(largest relative difference {worst:.2e})")
    a = tensors(os.path.join(eager_dir, "unet", "diffusion_pytorch_model.safetensors"))
    b = tensors(os.path.join(graph_dir, "unet", "diffusion_pytorch_model.safetensors"))
    check(sorted(a) == sorted(b), f"stage {stage}: the exports hold the same tensors")
    differing = [k for k in a if k in b and a[k] != b[k]]
    if differing:
        # Per tensor, the norm of the difference over the tensor's norm: AdamW
        # turns a last-bit gradient difference of a near-zero element into a
        # full lr-sized step, so element-wise ratios say little.
        worst_w = max(math.sqrt(sum((x - y) ** 2 for x, y in zip(a[k], b[k])) / max(sum(x * x for x in a[k]), 1e-30))
                      for k in differing)
        print(f"  stage {stage}: {len(differing)} of {len(a)} tensors differ, worst relative L2 {worst_w:.3e}")
    check(not differing, f"stage {stage}: the exported weights equal eager's bit for bit ({len(differing)} differ)")
    print(f"  stage {stage}: losses {'equal' if same_losses else 'differ'}, exported weights "
          f"{'equal' if not differing else 'differ'} (deterministic kernels, graph vs eager)")
    speed = lambda rows: sum(rows[s]["images_per_s"] for s in range(3, STEPS + 1)) / (STEPS - 2)  # noqa: E731
    print(f"  stage {stage}: {speed(eager):.1f} images/s eager, {speed(graph):.1f} with the graph")
finish()
