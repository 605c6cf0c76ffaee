#!/usr/bin/env python3
"""Epochs in examples/sdxl/train on CPU ranks (stdlib only; tiny.toml, fp32).

  check_epochs.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

ZERO_TEST_RANKS (default 2) is the world size N of the training runs;
ZERO_TEST_CASES=all (default) or "sweep" (the world-size dependent cases only,
for the other N of the sweep label).

The cached dataset (written with the stdlib writer cached_dataset_writer.py):
13 samples of 8x8 latents and 7 of 16x8, a global batch of 6 (batch_size
6 / N): 2 + 1 = 3 global batches per epoch, 1 + 1 = 2 samples of partly
filled batches left out of each epoch (drop-last per bucket), so an epoch is
3 steps at accumulation 1 at every N.

1. --epochs 3 (9 steps), checkpoint_every_epochs 1, export_every_epochs 2:
   9 steps logged; metrics.jsonl's "epoch" is step / 3; the progress line
   shows "epoch 1.00" at step 3; checkpoints at steps 3, 6 and 9 (the final
   one) and no other; the manifests record the schedule (3 batches per epoch,
   accumulation 1, length in epochs); exports/epoch-000002 holds the UNet and
   no other epoch folder exists (epoch 3's export is the final one).
2. Resumed from the epoch-1 checkpoint (step 3) into another folder, without
   epoch exports: steps 4-9 and the final export equal the uninterrupted run
   bit for bit (which also shows that the export after step 6 changed nothing).
3. accumulation 2 (1.5 steps per epoch): epochs end at steps 2, 3 (5, 6):
   --epochs 2 checkpoints at 2 and 3; the "epoch" column is step x 2 / 3.
4. Refusals naming the options: steps and epochs both set; a resume that
   counts steps from a run that counted epochs; a resume whose accumulation
   moves the epoch ends; warmup_steps beyond what the epochs come to.

The sweep (N = 1 and 3, label "sweep") runs 1 and 2 at that N: the same steps
end epochs and hold checkpoints as at N = 2, with the same epoch column.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
RANKS = int(os.environ.get("ZERO_TEST_RANKS", "2"))
CASES = os.environ.get("ZERO_TEST_CASES", "all")
GLOBAL_BATCH = 6
BATCHES_PER_EPOCH = 3
EPOCHS = 3
STEPS = EPOCHS * BATCHES_PER_EPOCH
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, load_dataset_writer, pattern_values  # noqa: E402


def half_values(count, seed):  # fp16 values in [-1, 1), a different pattern per sample
    return pattern_values(count, seed, "<e")


def write_dataset(directory):
    """20 samples of the tiny model's text dims in two buckets, interleaved."""
    prepare = load_dataset_writer()
    text = {"sequence_length": 7, "width": 64, "pooled_width": 32}
    writer = prepare.DatasetWriter(directory=prepare.Path(directory), text_dims=text, samples_per_shard=12,
                                   vae_scaling_factor=prepare.SDXL_VAE_SCALING_FACTOR)

    for i in range(20):
        h = 16 if i * 3 % 20 < 7 else 8  # 7 samples of 16x8, 13 of 8x8 (3i mod 20 permutes 0..19)
        writer.add(("F16", (4, h, 8), half_values(4 * h * 8, i)), ("F16", (7, 64), half_values(7 * 64, i + 100)),
                   ("F16", (32,), half_values(32, i + 200)), (8 * h, 64), (0, 0), (8 * h, 64), f"sample {i}")
    writer.finish()


DATASET = os.path.join(WORK, "dataset")


def run(name, *overrides, ranks=RANKS, fresh=True):
    out = os.path.join(WORK, name)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    # An option given in `overrides` replaces the default (the command line takes each once).
    options = {"--synthetic": "false", "--dataset": DATASET, "--batch_size": str(GLOBAL_BATCH // ranks),
               "--steps": "0", "--epochs": str(EPOCHS), "--checkpoint_every": "0", "--keep_checkpoints": "10",
               "--log_every": "1", "--ema_decay": "0"}
    for key, value in zip(overrides[::2], overrides[1::2]):
        options[key] = value
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           *[x for key, value in options.items() if value is not None for x in (key, value)]]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"  N={ranks} {name}: {' '.join(o for o in overrides if o is not None)} in {time.time() - start:.1f} s "
          f"(exit {result.returncode})", flush=True)
    output = result.stdout + result.stderr
    return result.returncode, output, out


def metrics(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    return {row["step"]: row for row in (json.loads(line) for line in open(path))}


def checkpoint_steps(out):
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(root)) if m)


def manifest(out, step):
    with open(os.path.join(out, "checkpoints", f"step-{step:08d}", "manifest.json")) as f:
        return json.load(f)


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def failed(code, output, what):
    if code != 0:
        print(output[-3000:])
    return not check(code == 0, what)


UNET_FILE = os.path.join("unet", "diffusion_pytorch_model.safetensors")


def epoch_runs():
    """Sections 1 and 2 at N = RANKS; returns the reference run's folder."""
    # 1. The reference run.
    code, output, ref = run("epochs", "--checkpoint_every_epochs", "1", "--export_every_epochs", "2")
    if failed(code, output, f"N={RANKS}: --epochs {EPOCHS} trains"):
        return None
    check(f"{BATCHES_PER_EPOCH} global batches per epoch, accumulation 1: {BATCHES_PER_EPOCH} steps per epoch" in output
          and f"global batch {GLOBAL_BATCH} = batch_size {GLOBAL_BATCH // RANKS} x {RANKS} ranks; 2 samples" in output
          and f"the run: {STEPS} steps = {EPOCHS} epochs" in output,
          "the data line gives the batches per epoch, the samples left out and the run's length")
    rows = metrics(ref)
    check(sorted(rows) == list(range(1, STEPS + 1)), f"--epochs {EPOCHS}: steps 1-{STEPS} logged, no more")
    check(all(abs(rows[s].get("epoch", -1) - s / BATCHES_PER_EPOCH) < 1e-12 for s in rows),
          "metrics.jsonl: 'epoch' is step / steps per epoch")
    check(re.search(r"step 3/9 .*\| epoch 1\.00 \|", output) is not None and
          re.search(r"step 4/9 .*\| epoch 1\.33 \|", output) is not None,
          "the progress line shows the epoch (1.00 at step 3, 1.33 at step 4)")
    check(checkpoint_steps(ref) == [3, 6, 9], f"checkpoint_every_epochs 1: checkpoints at steps 3, 6, 9 "
                                              f"(got {checkpoint_steps(ref)})")
    m = manifest(ref, 3)
    position = m.get("data_position", {})
    check(position.get("schedule.length") == "epochs" and position.get("schedule.batches_per_epoch") == "3" and
          position.get("schedule.accumulation") == "1" and position.get("schedule.steps_per_epoch") == "3" and
          position.get("sampler.epoch") == "0" and position.get("sampler.batch_in_epoch") == "3",
          f"the manifest records the schedule and the data position at the end of epoch 1: {position}")
    exports = sorted(os.listdir(os.path.join(ref, "exports"))) if os.path.isdir(os.path.join(ref, "exports")) else []
    check(exports == ["epoch-000002"] and os.path.isfile(os.path.join(ref, "exports", "epoch-000002", UNET_FILE)) and
          os.path.isfile(os.path.join(ref, "exports", "epoch-000002", "export_check.safetensors")),
          f"export_every_epochs 2: exports/epoch-000002 holds the UNet and its check, no other epoch ({exports})")
    check("epoch 2: exported" in output, "the epoch export is announced")

    # 2. Resume from the epoch-1 checkpoint into another folder, without epoch exports: bit for bit.
    code, output, resumed = run("epochs-from-epoch1", "--resume", os.path.join(ref, "checkpoints", "step-00000003"),
                                "--checkpoint_every_epochs", "1")
    if not failed(code, output, "resumed from the epoch-1 checkpoint"):
        got = metrics(resumed)
        check(sorted(got) == list(range(4, STEPS + 1)) and
              all(got[s]["loss"] == rows[s]["loss"] and got[s]["epoch"] == rows[s]["epoch"] for s in got),
              "resumed from the epoch-1 checkpoint without epoch exports: steps 4-9 equal the uninterrupted run (which "
              "exported after step 6) bit for bit")
        check(checkpoint_steps(resumed) == [6, 9], f"the resumed run checkpoints epochs 2 and 3 "
                                                   f"(got {checkpoint_steps(resumed)})")
        check(file_bytes(os.path.join(resumed, UNET_FILE)) == file_bytes(os.path.join(ref, UNET_FILE)),
              "the resumed run's final export equals the uninterrupted run's byte for byte")
    return ref


def accumulation_run():
    # 3. Epochs that do not hold whole steps.
    code, output, out = run("epochs-accumulation", "--accumulation", "2", "--batch_size", str(GLOBAL_BATCH // RANKS),
                            "--epochs", "2", "--checkpoint_every_epochs", "1", "--warmup_steps", "0")
    if failed(code, output, "accumulation 2 trains"):
        return
    check("3 global batches per epoch, accumulation 2: 1.5 steps per epoch" in output,
          "accumulation 2: 1.5 steps per epoch, said")
    rows = metrics(out)
    check(sorted(rows) == [1, 2, 3], "accumulation 2, --epochs 2: 3 steps (epoch 2 ends at step ceil(6 / 2))")
    check(all(abs(rows[s]["epoch"] - s * 2 / 3) < 1e-12 for s in rows), "the epoch column is step x 2 / 3")
    check(checkpoint_steps(out) == [2, 3], f"epoch ends at steps 2 and 3 (got {checkpoint_steps(out)})")


def refusals(ref):
    # 4. Refusals.
    code, output, _ = run("epochs-both", "--steps", None, "--epochs", "2", ranks=1)
    check(code != 0 and "[train] steps = 60 and [train] epochs = 2 are both set" in output,
          "tiny.toml's steps with --epochs: refused, naming both")
    code, output, _ = run("epochs-warmup", "--warmup_steps", "20", ranks=1)
    check(code != 0 and "warmup_steps must be in [0, 9] (epochs = 3 is 9 steps), got 20" in output,
          "warmup_steps beyond what the epochs come to: refused, naming both")
    if ref is None:
        return
    step3 = os.path.join(ref, "checkpoints", "step-00000003")
    code, output, _ = run("epochs-as-steps", "--resume", step3, "--steps", "9", "--epochs", "0")
    check(code != 0 and "was saved by a run whose length is counted in [train] epochs, this run sets [train] steps = 9"
          in output and "resumed from" not in output, "resuming an epoch run with --steps: refused, naming both")
    code, output, _ = run("epochs-other-accumulation", "--resume", step3, "--accumulation", "3",
                          "--warmup_steps", "0")
    check(code != 0 and "was saved with 3 global batches per epoch, accumulation 1: 3 steps per epoch; this run has 3 "
          "global batches per epoch, accumulation 3: 1 step per epoch" in output and "would end on other steps" in output,
          "resuming with another accumulation under epochs: refused, naming the schedules")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    write_dataset(DATASET)
    ref = epoch_runs()
    if CASES == "all":
        accumulation_run()
        refusals(ref)
    print(f"{len(failures) == 0 and 'all passed' or 'FAILED: ' + '; '.join(failures)}")
    sys.exit(1 if failures else 0)


main()
