#!/usr/bin/env python3
"""End-to-end checks of examples/sdxl/train on CPU ranks (stdlib only).

  check_train.py TRAIN UNET_FORWARD MPIEXEC CONFIG WORKDIR [mpiexec flags...]

Runs are 30 steps; where a check compares trajectories step by step (another
stage, offload, channels-last, partial checkpointing, N=1, hybrid) the second
run stops after step 10 (--stop_after, the same schedule) and steps 1-10 are
compared.

1. tiny.toml under mpirun -np 2 at stage 2: the loss falls clearly.
2. The same at stage 3: the same loss trajectory bit for bit (stages 0..3
   are bitwise identical at the same world size); and at stage 3 with the
   optimizer and parameters offloaded to host memory; offload_params below
   stage 3 is refused; bf16 optimizer state offloaded trains the on-device
   bf16-state trajectory bit for bit. The delayed update (DPU): warm-up steps equal, then
   departs and still trains; resuming continues it exactly; at stage 3 with
   offload_params it is the stage-2 delayed run bit for bit; with
   accumulation 2 it trains, the same bit for bit with the gradients
   accumulated on the host. Channels-last
   trains within 1e-3 of NCHW; cuda_graph/attention misuse is refused.
3. N=1 with the same global batch: the trajectory agrees with N=2 within a
   stated tolerance (only the order of gradient sums differs).
4. Stopped after 15 steps and resumed: steps 16..30 equal the uninterrupted run;
   resumed at N=1 and another stage from a 2-rank checkpoint, and with other
   ZeRO units (per block -> per layer): within 1e-4;
   a corrupted or truncated shard is refused, naming the file.
5. The exported UNet, loaded by unet_forward, reproduces the trained model's
   output (export_check.safetensors).
6. Parameter groups ([optimizer] no_weight_decay, [[optimizer.groups]]): the
   grouping is printed, stages 2 and 3 train the same trajectory bit for bit,
   it differs from the ungrouped run, the export still reproduces the model;
   a pattern that matches nothing and a parameter in two groups are refused,
   naming them.
7. Hybrid sharding (--shard_group_size 2 at N = 4): losses within 1e-5 of flat
   N = 4; its checkpoint has one file per shard rank and resumes flat.
8. Frozen parameters ([model] freeze), starting from the fixture's weights
   with the down blocks and conv_in frozen: the freeze is printed; at stage 3
   (fp32; stage 2 trains the same trajectory bit for bit) and stage 2
   (bf16) the exported UNet and EMA UNet hold the frozen
   tensors equal to the weights file bit for bit (bf16: not the engine's
   rounded values) and every trained tensor changed; the fp32 export
   reproduces the model; resuming from a mid-run checkpoint continues
   bitwise, and with another freeze set (or none) is refused naming
   [model] freeze; model_weights changed between a checkpoint and the
   export is refused; a pattern matching nothing, freezing everything and a
   group matching only frozen parameters are refused, naming them.
"""
import fnmatch
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time

TRAIN, UNET_FORWARD, MPIEXEC, CONFIG, WORK = sys.argv[1:6]
MPI_FLAGS = sys.argv[6:]
STEPS = 30
SHORT = 10
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, read_safetensors  # noqa: E402


def train(name, ranks, *overrides):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    return resume(name, ranks, *overrides, fresh=True)


def resume(name, ranks, *overrides, fresh=False):
    out = os.path.join(WORK, name)
    defaults = [] if "--checkpoint_every" in overrides else ["--checkpoint_every", "0"]
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           "--steps", str(STEPS), "--synthetic_samples", "128", "--log_every", "10", *defaults, *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    print(f"  ran {' '.join(cmd[3 + len(MPI_FLAGS):])} with {ranks} rank(s) in {time.time() - start:.1f} s")
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:])
        raise SystemExit(f"train failed ({result.returncode})")
    return losses(out)


def head(name, ranks, *overrides):
    """Steps 1-SHORT of a STEPS-step run (--stop_after keeps the full run's
    schedule): enough for the comparisons that hold step by step, at a third
    of the full run's time (CI's time)."""
    run = train(name, ranks, *overrides, "--stop_after", str(SHORT))
    check(sorted(run) == list(range(1, SHORT + 1)), f"{name}: steps 1-{SHORT} logged")
    return run


def run_expecting_failure(name, ranks, *overrides):
    out = os.path.join(WORK, name)
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           "--steps", str(STEPS), "--synthetic_samples", "128", "--log_every", "10", "--checkpoint_every", "0",
           *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {row["step"]: row["loss"] for row in rows}


def read_f32(path, name):
    dtype, _, values = read_safetensors(path)[0][name]
    assert dtype == "F32", (path, name, dtype)
    return values


os.makedirs(WORK, exist_ok=True)

# 1. The loss falls.
a = train("np2-stage2", 2, "--stage", "2")
first = sum(a[s] for s in (1, 2, 3)) / 3
last = sum(a[s] for s in range(STEPS - 4, STEPS + 1)) / 5
print(f"  stage 2, N=2: mean loss of steps 1-3 {first:.4f}, of steps {STEPS - 4}-{STEPS} {last:.4f}")
check(last < 0.5 * first, f"loss falls by more than half ({first:.4f} -> {last:.4f})")

# 2. Stage 3 gives the same trajectory.
b = head("np2-stage3", 2, "--stage", "3")
check(all(a[s] == b[s] for s in b), "stage 3 loss trajectory equals stage 2's bit for bit")

# 3. N=1 with the same global batch (8).
# The optimizer and the stage-3 parameter shards offloaded to host memory:
# the CPU optimizer computes what the engine's kernels compute.
f = head("np2-stage3-offload", 2, "--stage", "3", "--offload_optimizer", "true", "--offload_params", "true")
check(all(a[s] == f[s] for s in f), "stage 3 with optimizer and parameters offloaded: the same trajectory bit for bit")
# bf16 optimizer state (stochastic rounding keyed by each element's index and
# the step): offloaded, the host update draws the same bits as the engine's
# kernel on the device; near the fp32-state trajectory.
bd = head("np2-stage2-bf16-state", 2, "--stage", "2", "--state_dtype", "bf16")
bo = head("np2-stage2-bf16-state-offload", 2, "--stage", "2", "--state_dtype", "bf16", "--offload_optimizer", "true")
check(bo == bd, "state_dtype bf16: offloaded, the same trajectory bit for bit")
worst = max(abs(a[s] - bd[s]) / abs(a[s]) for s in bd)
check(0 < worst <= 1e-2, f"state_dtype bf16: within 1e-2 of fp32 state's losses, and not equal (got {worst:.2e})")
code, output = run_expecting_failure("offload-stage2", 1, "--stage", "2", "--offload_optimizer", "true",
                                     "--offload_params", "true")
check(code != 0 and "offload_params needs stage 3 with offload_optimizer" in output, "offload_params below stage 3 is refused, naming it")

# The delayed update (ZeRO-Offload's DPU): step 1 and, after one synchronous
# warm-up step, step 2 see the same parameters as the synchronous run, so
# their losses are equal bit for bit; from step 3 each forward sees the
# parameters one update old, so the trajectory departs, and still trains.
# A checkpoint completes the pending update: resumed from step 15, steps
# 16-30 equal the uninterrupted run that also saved at step 15.
delayed = ("--stage", "2", "--offload_optimizer", "true", "--offload_delayed_update", "true",
           "--delayed_update_warmup", "1")
g = train("np2-stage2-delayed", 2, *delayed, "--checkpoint_every", "15")
check(g[1] == a[1] and g[2] == a[2], "delayed update: steps 1-2 (warm-up) equal the synchronous run bit for bit")
check(g[3] != a[3], "delayed update: step 3 sees one-update-old parameters (its loss differs)")
g_first = sum(g[s] for s in (1, 2, 3)) / 3
g_last = sum(g[s] for s in range(STEPS - 4, STEPS + 1)) / 5
check(g_last < 0.5 * g_first, f"delayed update: the loss falls by more than half ({g_first:.4f} -> {g_last:.4f})")
# The EMA kept on the GPU (offload_ema_on_device): the fp32 master goes up,
# and the device updates the EMA from it and rounds the parameters with the
# same kernels, so the same trajectory and the same exported EMA UNet, byte for byte.
ge = train("np2-stage2-delayed-ema-on-device", 2, *delayed, "--checkpoint_every", "15", "--offload_ema_on_device", "true")
check(all(ge[s] == g[s] for s in g), "offload_ema_on_device: the delayed trajectory bit for bit")
ema_files = [os.path.join(WORK, name, "unet_ema", "diffusion_pytorch_model.safetensors")
             for name in ("np2-stage2-delayed", "np2-stage2-delayed-ema-on-device")]
check(open(ema_files[0], "rb").read() == open(ema_files[1], "rb").read(),
      "offload_ema_on_device: the exported EMA UNet equals the host EMA's byte for byte")
code, output = run_expecting_failure("ema-on-device-no-offload", 1, "--stage", "2", "--offload_ema_on_device", "true")
check(code != 0 and "offload_ema_on_device needs offload_optimizer" in output,
      "offload_ema_on_device without offload is refused, naming it")
train("delayed-resumed", 2, *delayed, "--stop_after", "15")
h = resume("delayed-resumed", 2, *delayed, "--resume", "latest")
check(all(h[s] == g[s] for s in range(16, STEPS + 1)),
      "delayed update: steps 16-30 after resuming equal the uninterrupted run")
# Issue 20: the delayed update at stage 3 with the parameters offloaded (the
# CPU writes a second host shard, swapped in at the join) is the stage-2
# delayed run bit for bit; with two micro-steps per step it trains.
# The same checkpoint at step 15 as the stage-2 run: saving completes the
# pending update, so step 16 of both sees fresh parameters (compared to step 18).
gp = train("np2-stage3-offload-delayed", 2, "--stage", "3", "--offload_optimizer", "true", "--offload_params", "true",
           "--offload_delayed_update", "true", "--delayed_update_warmup", "1", "--checkpoint_every", "15",
           "--stop_after", "18")
check(sorted(gp) == list(range(1, 19)) and all(gp[s] == g[s] for s in gp), "delayed update at stage 3 with offload_params: the stage-2 delayed trajectory bit for bit")
ga = train("np2-stage3-delayed-accumulation", 2, "--stage", "3", "--offload_optimizer", "true",
           "--offload_delayed_update", "true", "--accumulation", "2", "--batch_size", "2")
ga_first = sum(ga[s] for s in (1, 2, 3)) / 3
ga_last = sum(ga[s] for s in range(STEPS - 4, STEPS + 1)) / 5
check(ga_last < 0.5 * ga_first,
      f"delayed update with accumulation 2: the loss falls by more than half ({ga_first:.4f} -> {ga_last:.4f})")
# The micro-steps' gradients added on the host instead of in a device shard:
# the same fp32 additions and roundings, so the same trajectory bit for bit.
gh = head("np2-stage3-delayed-host-accumulation", 2, "--stage", "3", "--offload_optimizer", "true",
           "--offload_delayed_update", "true", "--accumulation", "2", "--batch_size", "2",
           "--offload_accumulate_on_host", "true")
check(all(gh[s] == ga[s] for s in gh), "gradients accumulated on the host: the device-accumulated trajectory bit for bit")
waits = [json.loads(line).get("timing/host_add_wait_s")
         for line in open(os.path.join(WORK, "np2-stage3-delayed-host-accumulation", "metrics.jsonl"))]
check(waits and all(isinstance(w, (int, float)) and 0 <= w < 60 for w in waits),
      f"metrics.jsonl logs the wait for host additions at every logged step ({waits})")
# The bytes each step moved between host and device memory: the host-
# accumulated run sends the gradient shard down at both micro-steps, the
# device-accumulated one once at step(); both send the updated parameter
# shard up once (the delayed update's at the next step).
def transfers(name):
    rows = [json.loads(line) for line in open(os.path.join(WORK, name, "metrics.jsonl"))]
    return {r["step"]: r for r in rows}
th, ta = transfers("np2-stage3-delayed-host-accumulation"), transfers("np2-stage3-delayed-accumulation")
later = [s for s in th if s >= 2 and s in ta]
check(later and all(th[s]["transfer/to_host_bytes"] == 2 * ta[s]["transfer/to_host_bytes"] > 0 for s in later),
      "metrics.jsonl: host accumulation sends the gradient shard down twice a step, device accumulation once")
check(all(th[s]["transfer/to_device_bytes"] == ta[s]["transfer/to_device_bytes"] > 0 for s in later),
      "metrics.jsonl: both send the updated parameter shard up once a step")
check(all(th[s]["transfer/to_host_GBps"] > 0 and th[s]["transfer/to_device_GBps"] > 0 for s in later),
      "metrics.jsonl: the transfer rates over the step's time are logged")
code, output = run_expecting_failure("host-accumulation-no-offload", 1, "--stage", "2", "--accumulation", "2",
                                     "--offload_accumulate_on_host", "true")
check(code != 0 and "offload_accumulate_on_host needs offload_optimizer" in output,
      "offload_accumulate_on_host without offload is refused, naming it")
code, output = run_expecting_failure("delayed-no-offload", 1, "--stage", "2", "--offload_delayed_update", "true")
check(code != 0 and "offload_delayed_update needs offload_optimizer" in output,
      "offload_delayed_update without offload is refused, naming it")

# Channels-last (NHWC) activations: on the CPU the same model and math with
# other kernels and summation orders, so close to the NCHW run, not equal.
cl = head("np2-stage2-channels-last", 2, "--stage", "2", "--channels_last", "true")
worst = max(abs(a[s] - cl[s]) / abs(a[s]) for s in cl)
check(worst <= 1e-3, f"channels_last: the loss trajectory within 1e-3 of NCHW's (got {worst:.2e})")
# Partial activation checkpointing at stage 3: 5 units recomputed (each
# gathered again for its recompute), the others keep their activations. The
# same math in another order: within 1e-4 of the run without checkpointing.
pc = head("np2-stage3-partial-checkpointing", 2, "--stage", "3", "--activation_checkpointing", "true",
          "--checkpoint_units", "5")
worst = max(abs(a[s] - pc[s]) / abs(a[s]) for s in pc)
check(worst <= 1e-4,
      f"checkpoint_units = 5 at stage 3: the loss trajectory within 1e-4 of no checkpointing's (got {worst:.2e})")
# The CUDA graph needs a GPU and one micro-step per step; refused with the reason otherwise.
for name, args, reason in [("graph-cpu", ("--stage", "1", "--cuda_graph", "true"),
                             "cuda_graph applies to device = \"cuda\" only"),
                            ("graph-accumulation", ("--stage", "2", "--cuda_graph", "true", "--device", "cuda",
                                                    "--accumulation", "2"),
                             "cuda_graph needs accumulation = 1"),
                            ("attention-bad", ("--attention", "fastest"), "attention: 'fastest' is not one of")]:
    code, output = run_expecting_failure(name, 1, *args)
    check(code != 0 and reason in output, f"{name}: refused, naming the reason ({reason})")

c = head("np1-stage2", 1, "--stage", "2", "--batch_size", "8")
worst = max(abs(a[s] - c[s]) / abs(a[s]) for s in c)
print(f"  N=1 vs N=2: max relative loss difference over {SHORT} steps {worst:.3e}")
check(worst <= 1e-4, f"N=1 and N=2 loss trajectories agree within 1e-4 (got {worst:.2e})")

# 4. Stop after 15 steps, resume.
train("resumed", 2, "--stage", "2", "--stop_after", "15")
d = resume("resumed", 2, "--stage", "2", "--resume", "latest")
check(sorted(d) == list(range(1, STEPS + 1)), "resumed run logged every step once")
check(all(d[s] == a[s] for s in range(16, STEPS + 1)), "steps 16-30 after resuming equal the uninterrupted run")

# 4b. Stopped at N=2, resumed at N=1 (same global batch): the sharded files are
# resharded directly; only the order of gradient sums differs from N=2.
train("resharded", 2, "--stage", "3", "--stop_after", "15")
e = resume("resharded", 1, "--stage", "2", "--batch_size", "8", "--resume", "latest")
worst = max(abs(e[s] - a[s]) / abs(a[s]) for s in range(16, STEPS + 1))
print(f"  resumed at N=1 from N=2 (stage 3 -> 2): max relative loss difference, steps 16-30: {worst:.3e}")
check(worst <= 1e-4, f"resuming at another world size and stage continues the run (within 1e-4, got {worst:.2e})")

# 4b'. Stopped with one ZeRO unit per UNet block, resumed with one per layer
# (the default): the checkpoint's parameters are regrouped by name into the
# new units; only the order of the gradient-norm sums can differ.
train("regrouped", 2, "--stage", "3", "--units", "blocks", "--stop_after", "15")
r = resume("regrouped", 2, "--stage", "3", "--units", "layers", "--resume", "latest")
worst = max(abs(r[s] - a[s]) / abs(a[s]) for s in range(1, STEPS + 1))
print(f"  stopped per block, resumed per layer: max relative loss difference over {STEPS} steps {worst:.3e}")
check(sorted(r) == list(range(1, STEPS + 1)) and worst <= 1e-4,
      f"a checkpoint written with other units resumes and continues the run (within 1e-4, got {worst:.2e})")

# 4c. A corrupted or truncated shard is refused with the file named.
train("damaged", 2, "--stage", "2", "--stop_after", "3")
shard = os.path.join(WORK, "damaged", "checkpoints", "step-00000003", "rank-00001.safetensors")
with open(shard, "r+b") as f:
    f.seek(os.path.getsize(shard) // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0xFF]))
code, output = run_expecting_failure("damaged", 2, "--stage", "2", "--resume", "latest")
check(code != 0 and "rank-00001.safetensors is corrupted" in output,
      "a flipped byte in a shard stops the resume with the file named")
with open(shard, "r+b") as f:
    f.truncate(os.path.getsize(shard) - 100)
code, output = run_expecting_failure("damaged", 2, "--stage", "2", "--resume", "latest")
check(code != 0 and "rank-00001.safetensors has" in output and "the manifest says" in output,
      "a truncated shard stops the resume with the file named")

# 5. The export reproduces the trained model.
out = os.path.join(WORK, "np2-stage2")
check_file = os.path.join(out, "export_check.safetensors")
result = subprocess.run([UNET_FORWARD, "--model", os.path.join(out, "unet"), "--inputs", check_file, "--output",
                         os.path.join(WORK, "export_output.safetensors")], capture_output=True, text=True)
if result.returncode != 0:
    print(result.stdout, result.stderr)
check(result.returncode == 0, "unet_forward loads the exported UNet folder")
if result.returncode == 0:
    got = read_f32(os.path.join(WORK, "export_output.safetensors"), "sample")
    want = read_f32(check_file, "expected")
    error = math.sqrt(sum((g - w) ** 2 for g, w in zip(got, want)) / sum(w * w for w in want))
    print(f"  exported UNet vs trained model: relative L2 {error:.2e}")
    check(error <= 1e-5, f"exported UNet reproduces the trained model's output (rel. L2 {error:.2e} <= 1e-5)")
check(os.path.exists(os.path.join(out, "unet_ema", "diffusion_pytorch_model.safetensors")), "EMA UNet exported")
check(os.path.exists(os.path.join(out, "loss.svg")), "loss curve written")
check(any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out, "tensorboard"))),
      "TensorBoard event file written")

# 6. Parameter groups, from a copy of the config with groups added.
def grouped_config(name, no_weight_decay, groups):
    text = open(CONFIG).read()
    patterns = ", ".join(f'"{p}"' for p in no_weight_decay)
    text = text.replace("[optimizer]\n", f"[optimizer]\nno_weight_decay = [{patterns}]\n", 1)
    for group in groups:
        text += "\n[[optimizer.groups]]\n" + "".join(f"{k} = {v}\n" for k, v in group.items())
    path = os.path.join(WORK, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run_grouped(name, config_path, *overrides):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", "2", *MPI_FLAGS, TRAIN, "--config", config_path, "--output_dir", out, "--steps", str(STEPS),
           "--synthetic_samples", "128", "--log_every", "10", "--checkpoint_every", "0", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr, out


down = {"name": '"down"', "params": '["down_blocks.*"]', "lr_scale": 0.5}
grouped = grouped_config("grouped", ["*.bias", "*norm*"], [down])
code, output, out = run_grouped("grouped-stage2", grouped, "--stage", "2")
check(code == 0 and "parameter groups: 4" in output and "down (no weight decay)" in output,
      "parameter groups: four groups (default and down, each with and without weight decay) printed")
if code == 0:
    k2 = losses(out)
    code3, _, out3 = run_grouped("grouped-stage3", grouped, "--stage", "3")
    check(code3 == 0 and losses(out3) == k2, "parameter groups: stage 3 trains the same trajectory as stage 2, bit for bit")
    check(k2 != a, "parameter groups change the trajectory (they are applied)")
    check(k2[STEPS] < 0.5 * k2[1], f"parameter groups: the loss falls by more than half ({k2[1]:.4f} -> {k2[STEPS]:.4f})")
    check_file = os.path.join(out, "export_check.safetensors")
    result = subprocess.run([UNET_FORWARD, "--model", os.path.join(out, "unet"), "--inputs", check_file, "--output",
                             os.path.join(WORK, "grouped_output.safetensors")], capture_output=True, text=True)
    if result.returncode == 0:
        got = read_f32(os.path.join(WORK, "grouped_output.safetensors"), "sample")
        want = read_f32(check_file, "expected")
        error = math.sqrt(sum((g - w) ** 2 for g, w in zip(got, want)) / sum(w * w for w in want))
        check(error <= 1e-5, f"parameter groups: the export (engine order by group) reproduces the model ({error:.2e})")
    else:
        check(False, "parameter groups: unet_forward loads the exported UNet: " + result.stderr[-300:])
else:
    print(output[-3000:])
code, output, _ = run_grouped("grouped-typo", grouped_config("typo", ["*.bais"], []), "--stage", "2")
check(code != 0 and "pattern '*.bais'" in output and "matches no parameter" in output,
      "a no_weight_decay pattern that matches nothing is refused, naming it")
both = {"name": '"all"', "params": '["*"]'}
code, output, _ = run_grouped("grouped-twice", grouped_config("twice", [], [down, both]), "--stage", "2")
check(code != 0 and "is in two groups, 'down' and 'all'" in output, "a parameter in two groups is refused, naming both")

# 7. Hybrid sharding: N = 4 as 2 replicas x shard groups of 2 against flat 4
# (the same global batch): the same trajectory up to the order in which the
# gradient average is summed; its checkpoint (written by the first replica,
# 2 files) resumes flat.
def relative_gap(x, y):
    return max(abs(x[s] - y[s]) / abs(y[s]) for s in y)


flat4 = head("np4-flat", 4, "--stage", "2")
hybrid = head("np4-hybrid", 4, "--stage", "2", "--shard_group_size", "2")
gap = relative_gap(hybrid, flat4)
check(gap <= 1e-5, f"hybrid sharding 2 x 2: losses within 1e-5 relative of flat N = 4 ({gap:.2e})")
h_first, h_last = sum(hybrid[s] for s in (1, 2, 3)) / 3, sum(hybrid[s] for s in range(SHORT - 2, SHORT + 1)) / 3
check(h_last < 0.8 * h_first, f"hybrid sharding: the loss falls ({h_first:.4f} -> {h_last:.4f}, steps 1-3 -> {SHORT - 2}-{SHORT})")
train("np4-hybrid-resume", 4, "--stage", "3", "--shard_group_size", "2", "--stop_after", "5")
ckpt = os.path.join(WORK, "np4-hybrid-resume", "checkpoints")
step_dirs = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
files = sorted(f for f in os.listdir(os.path.join(ckpt, step_dirs[-1])) if f.startswith("rank")) if step_dirs else []
check(len(files) == 2, f"a hybrid 2 x 2 checkpoint holds one file per shard rank ({files})")
resumed = resume("np4-hybrid-resume", 4, "--stage", "2", "--resume", "latest", "--stop_after", str(SHORT))
gap = max(abs(resumed[s] - hybrid[s]) / abs(hybrid[s]) for s in range(6, SHORT + 1))
check(sorted(resumed) == list(range(1, SHORT + 1)) and gap <= 1e-5,
      f"a hybrid checkpoint resumes flat at N = 4: steps 6-{SHORT} within 1e-5 of the hybrid run ({gap:.2e})")

# 8. Frozen parameters, from the fixture's weights (the trainer's tiny UNet).
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "sdxl",
                       "tiny_a_weights.safetensors")
FREEZE = ["down_blocks.*", "conv_in.*"]
FROZEN_STEPS = 10


def read_raw(path):
    """name -> (dtype, shape, bytes) of every tensor in a safetensors file."""
    return read_safetensors(path, raw=True)[0]


def frozen_run(name, config_path, *overrides, steps=FROZEN_STEPS, ranks=2):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    defaults = [] if "--checkpoint_every" in overrides else ["--checkpoint_every", "0"]
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", config_path, "--output_dir", out,
           "--steps", str(steps), "--synthetic_samples", "128", "--log_every", "5", *defaults, *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"  ran {' '.join(cmd[3 + len(MPI_FLAGS):])} in {time.time() - start:.1f} s (exit {result.returncode})")
    return result.returncode, result.stdout + result.stderr, out


text = open(CONFIG).read()
text = text.replace("[model]\n", f'[model]\nmodel_weights = "{WEIGHTS}"\nfreeze = {json.dumps(FREEZE)}\n', 1)
frozen_config = os.path.join(WORK, "frozen.toml")
with open(frozen_config, "w") as f:
    f.write(text)
start_weights = read_raw(WEIGHTS)
frozen_names = {n for n in start_weights if any(fnmatch.fnmatchcase(n, p) for p in FREEZE)}
frozen_elements = sum(math.prod(start_weights[n][1]) for n in frozen_names)
print(f"  freezing {len(frozen_names)} of {len(start_weights)} tensors, {frozen_elements} elements")


def check_frozen_export(out, label):
    """Frozen tensors equal the weights file bit for bit, trained ones changed (UNet and EMA UNet)."""
    for folder in ("unet", "unet_ema"):
        path = os.path.join(out, folder, "diffusion_pytorch_model.safetensors")
        if not os.path.exists(path):
            check(False, f"{label}: {folder} exported")
            continue
        got = read_raw(path)
        check(set(got) == set(start_weights), f"{label}: {folder} has the weights file's tensors")
        same = [n for n in frozen_names if got.get(n) == start_weights[n]]
        check(len(same) == len(frozen_names),
              f"{label}: {folder}: the {len(frozen_names)} frozen tensors equal --model_weights bit for bit "
              f"({len(frozen_names) - len(same)} differ)")
        unchanged = [n for n in set(start_weights) - frozen_names if got.get(n) == start_weights[n]]
        check(not unchanged, f"{label}: {folder}: every trained tensor changed (unchanged: {unchanged[:3]})")


# Stage 3, fp32, with a checkpoint halfway to resume from below.
code, output, out3 = frozen_run("frozen-stage3", frozen_config, "--stage", "3", "--checkpoint_every", "5")
if code != 0:
    print(output[-3000:])
check(code == 0 and f"{len(frozen_names)} of {len(start_weights)} tensors, {frozen_elements} of" in output,
      "frozen: the freeze (tensors and elements) is printed at start")
if code == 0:
    fz = losses(out3)
    check(sorted(fz) == list(range(1, FROZEN_STEPS + 1)) and all(math.isfinite(v) for v in fz.values()),
          "frozen, stage 3: every step logged with a finite loss")
    first, last = (fz[1] + fz[2]) / 2, (fz[FROZEN_STEPS - 1] + fz[FROZEN_STEPS]) / 2
    check(last < first, f"frozen, stage 3: the loss falls ({first:.4f} -> {last:.4f})")
    check_frozen_export(out3, "frozen, stage 3")
    check_file = os.path.join(out3, "export_check.safetensors")
    result = subprocess.run([UNET_FORWARD, "--model", os.path.join(out3, "unet"), "--inputs", check_file, "--output",
                             os.path.join(WORK, "frozen_output.safetensors")], capture_output=True, text=True)
    if result.returncode == 0:
        got = read_f32(os.path.join(WORK, "frozen_output.safetensors"), "sample")
        want = read_f32(check_file, "expected")
        error = math.sqrt(sum((g - w) ** 2 for g, w in zip(got, want)) / sum(w * w for w in want))
        check(error <= 1e-5, f"frozen, stage 3: the export reproduces the trained model (rel. L2 {error:.2e})")
    else:
        check(False, "frozen: unet_forward loads the exported UNet: " + result.stderr[-300:])

    # Stage 2 keeps the frozen values whole on every rank, stage 3 shards them
    # and gathers them with their unit: the same bits (the adapter puts the
    # same autograd nodes around a unit with nothing to train at every stage,
    # so the gradients of its inputs are summed in one order).
    code, output, out2 = frozen_run("frozen-stage2", frozen_config, "--stage", "2", "--export_unet", "false")
    if code == 0:
        f2 = losses(out2)
        worst = max(abs(f2[s] - fz[s]) / abs(fz[s]) for s in fz)
        check(f2 == fz, f"frozen: stage 2 trains the stage-3 trajectory bit for bit (largest gap {worst:.2e})")
    else:
        check(False, "frozen: stage 2 trains: " + output[-1000:])

    # Resumed from step 5 with the same freeze: steps 6-10 as uninterrupted.
    halfway = os.path.join(out3, "checkpoints", "step-00000005")
    code, output, out_r = frozen_run("frozen-resumed", frozen_config, "--stage", "3", "--resume", halfway)
    if code != 0:
        print(output[-3000:])
    check(code == 0 and all(losses(out_r).get(s) == fz[s] for s in range(6, FROZEN_STEPS + 1)),
          "frozen: resumed from step 5 with the same freeze, steps 6-10 equal the uninterrupted run bit for bit")
    # Another freeze set ("--freeze" replaces the file's list): refused, naming the key and a parameter.
    code, output, _ = frozen_run("frozen-resume-other", frozen_config, "--stage", "3", "--resume", halfway,
                                 "--freeze", "down_blocks.*")
    check(code != 0 and "[model] freeze" in output and "'conv_in.bias' was frozen there and is trained here" in output
          and f"froze {len(frozen_names)} parameters" in output,
          "frozen: resuming with another freeze set is refused, naming [model] freeze and a parameter")
    code, output, _ = frozen_run("frozen-resume-none", frozen_config, "--stage", "3", "--resume", halfway,
                                 "--freeze", "")
    check(code != 0 and "this run freezes 0 ([model] freeze = [])" in output,
          "frozen: resuming without the freeze is refused, naming [model] freeze")
# A checkpoint saved without freeze (section 4) does not resume with one.
code, output, _ = frozen_run("unfrozen-resume-frozen", CONFIG, "--stage", "2", "--freeze", "conv_in.*", "--resume",
                             os.path.join(WORK, "resumed", "checkpoints", "step-00000015"), steps=STEPS)
check(code != 0 and "that froze 0 parameters" in output and "'conv_in.bias' was trained there and is frozen here" in output,
      "frozen: a checkpoint without frozen parameters does not resume with some, naming the parameter")

# Stage 2 in bf16: the engine holds the frozen tensors rounded to bf16; the
# export still writes the weights file's fp32 values.
code, output, out2 = frozen_run("frozen-stage2-bf16", frozen_config, "--stage", "2", "--precision", "bf16")
if code != 0:
    print(output[-3000:])
check(code == 0, "frozen, stage 2, bf16: trains")
if code == 0:
    check_frozen_export(out2, "frozen, stage 2, bf16")

# The export's exact values come from model_weights read again: weights
# changed under a run (between a checkpoint and its resume) are an error
# naming the parameter, not a silent mix of old training and new values.
changed = os.path.join(WORK, "changed_weights.safetensors")
shutil.copyfile(WEIGHTS, changed)
changing = ("--stage", "2", "--precision", "bf16", "--model_weights", changed)
code, output, _ = frozen_run("frozen-changed", frozen_config, *changing, "--stop_after", "5", "--export_unet", "false")
check(code == 0, "frozen, bf16: stopped after step 5")
with open(changed, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    begin = json.loads(f.read(n))["conv_in.bias"]["data_offsets"][0]
    f.seek(8 + n + begin)
    f.write(struct.pack("<f", 1234.5))
out = os.path.join(WORK, "frozen-changed")
cmd = [MPIEXEC, "-np", "2", *MPI_FLAGS, TRAIN, "--config", frozen_config, "--output_dir", out, "--steps",
       str(FROZEN_STEPS), "--synthetic_samples", "128", "--checkpoint_every", "0", *changing, "--resume", "latest"]
result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
output = result.stdout + result.stderr
check(result.returncode != 0 and "export: frozen parameter 'conv_in.bias' element 0" in output
      and "the weights the run started from changed" in output,
      "frozen: model_weights changed before the export is refused, naming the parameter")

# Refusals, before anything trains.
for name, args, reason in [
        ("freeze-typo", ("--freeze", "down_blocks.*", "--freeze", "downblocks.*"),
         "[model] freeze: pattern 'downblocks.*' matches no parameter"),
        ("freeze-all", ("--freeze", "*"), f"freezes all {len(start_weights)} parameters: nothing to train")]:
    code, output, _ = frozen_run(name, frozen_config, *args, steps=5, ranks=1)
    if code == 0 or reason not in output:
        print(output[-2000:])
    check(code != 0 and reason in output, f"{name}: refused, naming it ({reason})")
down_only = grouped_config("frozen-group", [], [down])
code, output, _ = frozen_run("freeze-group", down_only, "--freeze", "down_blocks.*", steps=5, ranks=1)
check(code != 0 and "[[optimizer.groups]] 'down': pattern 'down_blocks.*' matches only frozen parameters" in output,
      "a group whose pattern matches only frozen parameters is refused, naming it")

print(f"{len(failures) == 0 and 'all passed' or 'FAILED: ' + '; '.join(failures)}")
sys.exit(1 if failures else 0)
