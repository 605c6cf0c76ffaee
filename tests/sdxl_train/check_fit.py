#!/usr/bin/env python3
"""[device] fit (--fit SIZE) in examples/sdxl/train: the planner chooses the
run's settings (issue 20, item 4). tiny.toml at latent_size 8, N=2, global
batch 8 given as batch_size 1 x accumulation 4 in a config file (stdlib only):

1. Under a cap (from zero-plan's own numbers) that only offloaded
   configurations fit, the trainer's choice is the top proposal of
   `zero-plan --fit CAP --global-batch 8 --json` for the same model and
   options, it differs from the config's settings, and the run trains.
2. Its losses and final checkpoint tensors equal, bit for bit, those of the
   same run with the chosen settings given explicitly (no --fit).
3. Stopped after step 1 and resumed with --fit of another size (under which
   a fresh search would choose otherwise): the run keeps the checkpoint's
   settings, and trains as the same checkpoint resumed with those settings
   given explicitly, bit for bit.
4. An option given on the command line is kept: --offload_optimizer false
   passes over every proposal that fits, so the run is refused before
   training, naming the fastest one and the option (the choice among the
   rest is unit-tested in sdxl.train_memory_cap).
5. A cap that nothing fits is refused before training, naming the size and
   the smallest predicted peak.

  check_fit.py TRAIN ZERO_PLAN MPIEXEC CONFIG TINY_UNET_JSON WORKDIR [mpiexec flags...]
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

TRAIN, ZERO_PLAN, MPIEXEC, CONFIG, TINY_UNET, WORK = sys.argv[1:7]
MPI_FLAGS = sys.argv[7:]
RANKS = 2
STEPS = 2
GLOBAL_BATCH = 8
KEYS = ["stage", "offload_optimizer", "offload_params", "offload_delayed_update", "activation_checkpointing",
        "checkpoint_units", "batch_size", "accumulation"]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, read_safetensors  # noqa: E402


def write_config():
    """tiny.toml with the global batch as 1 x 4 micro-steps x 2 ranks, set in
    the file (options on the command line would be kept by --fit)."""
    text = open(CONFIG).read()
    for key, value in [("batch_size", "1"), ("accumulation", "4"), ("steps", str(STEPS)), ("warmup_steps", "1"),
                       ("synthetic_samples", "64"), ("latent_size", "8"), ("stage", "2")]:
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    path = os.path.join(WORK, "fit.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(name, config, *overrides, expect_ok=True, fresh=True):
    out = os.path.join(WORK, name)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", str(RANKS), *MPI_FLAGS, TRAIN, "--config", config, "--output_dir", out, "--log_every", "1",
           "--checkpoint_every", "0", "--export_unet", "false", *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(f"  ran train {' '.join(overrides)} in {time.time() - start:.1f} s", flush=True)
    if expect_ok and result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:])
        raise SystemExit(f"train failed ({result.returncode})")
    return out, result.returncode, result.stdout + result.stderr


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def read_tensors(path):
    """name -> (dtype, shape, bytes) of every tensor in a safetensors file (metadata left out)."""
    return read_safetensors(path, raw=True)[0]


def final_state(out):
    folder = os.path.join(out, "checkpoints", f"step-{STEPS:08d}")
    return [read_tensors(os.path.join(folder, f"rank-{r:05d}.safetensors")) for r in range(RANKS)]


def chosen(output):
    """The trainer options of the block's 'chosen:' (or resumed) line, as a dict."""
    match = re.search(r"^  (?:chosen: )?(stage = .*)$", output, flags=re.M)
    return dict(item.split(" = ") for item in match.group(1).split(", ")) if match else None


def zero_plan(cap, *extra):
    cmd = [ZERO_PLAN, "--unet-config", TINY_UNET, "--precision", "fp32", "--optimizer", "adamw", "--ema",
           "--latent-size", "8", "--world-size", str(RANKS), "--batch", "1", "--accumulation", "4", "--stage", "2",
           "--fit", str(cap), "--global-batch", str(GLOBAL_BATCH), "--json", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    check(result.returncode in (0, 3), f"zero-plan --fit {cap} ran (exit {result.returncode}) {result.stderr[-500:]}")
    return json.loads(result.stdout)


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    config = write_config()

    # A cap that only offloaded configurations fit, from the planner's own numbers.
    every = zero_plan(64 << 30)["candidates"]
    least = min(c["gpu_peak_bytes"] for c in every)
    least_on_gpu = min(c["gpu_peak_bytes"] for c in every if not c["offload_optimizer"])
    cap = int((least + least_on_gpu) / 2 / 0.95)
    plan = zero_plan(cap)
    top = next((c for c in plan["candidates"] if c["fits"]), None)
    check(top is not None and top["offload_optimizer"], f"zero-plan --fit {cap}: an offloaded proposal fits "
          f"({top and top['trainer_options']})")
    # The trainer applies fit()'s best: the top proposal, prefetching at stage 3
    # as deep as still fits (zero-plan's "best").
    check(plan["best"] is not None and plan["best"]["label"] == top["label"], "zero-plan's best is its top proposal")
    expected = dict(item.split(" = ") for item in plan["best"]["trainer_options"].split(", "))
    as_given = {"stage": "2", "offload_optimizer": "false", "offload_params": "false",
                "offload_delayed_update": "false", "activation_checkpointing": "false", "batch_size": "1",
                "accumulation": "4"}
    check(expected != as_given, f"the proposal differs from the config's settings: {expected}")

    # 1. The trainer chooses zero-plan's top proposal, and trains.
    fit_out, _, output = run("fit", config, "--fit", str(cap))
    check(chosen(output) == expected, f"1. the trainer chose zero-plan's top proposal: {chosen(output)}")
    check(f"--- fit = {cap}:" in output and "predicted peak" in output and "images/s" in output and
          "changed from the configuration: " in output, "1. the block says what was chosen, its peak and speed, "
          "what changed")
    check("batch_size 1 -> " in output or expected["batch_size"] == "1", "1. the change of batch_size is listed")
    fit_losses = losses(fit_out)
    check(len(fit_losses) == STEPS, f"1. trained {STEPS} steps: {fit_losses}")

    # 2. The same run with the chosen settings given explicitly.
    explicit = [x for key in KEYS if key in expected for x in (f"--{key}", expected[key])]
    explicit_out, _, _ = run("explicit", config, *explicit)
    check(losses(explicit_out) == fit_losses, "2. losses equal the explicit run's bit for bit")
    check(final_state(explicit_out) == final_state(fit_out),
          "2. the final checkpoint's tensors (every rank) equal the explicit run's bit for bit")

    # 3. Stopped and resumed with another size: the checkpoint's settings are
    # kept. The same checkpoint resumed with those settings given explicitly
    # trains the same bit for bit (the delayed update itself does not resume
    # bit for bit against an uninterrupted run: the first step after a resume
    # sees the completed update).
    resumed_out, _, _ = run("resumed", config, "--fit", str(cap), "--stop_after", "1")
    explicit_resumed_out = os.path.join(WORK, "explicit_resumed")
    shutil.copytree(resumed_out, explicit_resumed_out)
    bigger = 64 << 30
    fresh_choice = zero_plan(bigger)["candidates"][0]["trainer_options"]
    check(fresh_choice != top["trainer_options"], f"3. a fresh search under {bigger} chooses otherwise: {fresh_choice}")
    _, _, output = run("resumed", config, "--fit", str(bigger), "--resume", "latest", fresh=False)
    check("resuming, so nothing is searched" in output and chosen(output) == expected,
          f"3. the resumed run keeps the checkpoint's settings: {chosen(output)}")
    run("explicit_resumed", config, *explicit, "--resume", "latest", fresh=False)
    check(losses(resumed_out)[0] == fit_losses[0] and len(losses(resumed_out)) == STEPS,
          "3. resumed: step 1 as the uninterrupted run, every step trained")
    check(losses(resumed_out) == losses(explicit_resumed_out) and
          final_state(resumed_out) == final_state(explicit_resumed_out),
          "3. resumed: losses and final tensors equal the same checkpoint resumed with the settings given explicitly")

    # 4. A setting given on the command line is kept: with --offload_optimizer
    # false every fitting proposal is passed over, refused before training,
    # naming the fastest one and the option.
    _, code, output = run("pinned", config, "--fit", str(cap), "--offload_optimizer", "false", expect_ok=False)
    check(code != 0 and "but each changes an option given on the command line or is refused by the configuration; "
          f"the fastest: {top['trainer_options']}: --offload_optimizer false was given on the command line" in output
          and "step 1/" not in output, "4. --offload_optimizer false kept: the offloaded proposals are passed over, "
          "and with nothing else fitting the run is refused naming the fastest and the option")

    # 5. Nothing fits: refused before training, with the size and the least peak.
    small = int(least * 0.9)
    out, code, output = run("refused", config, "--fit", str(small), expect_ok=False)
    check(code != 0 and f"fit = {small}: no configuration fits" in output and
          f"the smallest predicted peak is {gib(least)}" in output and "step 1/" not in output,
          f"5. refused before training, naming the size and the smallest peak {gib(least)}: "
          f"{[l for l in output.splitlines() if 'no configuration fits' in l][:1]}")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
