#!/usr/bin/env python3
"""Caption dropout ([data] caption_dropout, --caption_dropout) in
examples/sdxl/train (tiny.toml, 4 steps, global batch 8; stdlib only):

1. p = 0 (given explicitly) trains the run without the option bit for bit and
   logs no data/captions_dropped (no extra draw, nothing else moves).
2. p = 0.5 at N=2: metrics.jsonl counts the dropped samples of each step
   (summed over ranks); over the run the count is near p x samples, and the
   losses differ from p = 0.
3. The same at N=1 with the same global batch: the same count every step (the
   same samples dropped) and losses within 1e-4.
4. Stopped after step 2 and resumed: losses and counts bit for bit.
5. p = 1 drops all 8 samples of every step; on a cached dataset it trains
   bit for bit what p = 0 trains on a copy whose every sample carries the
   empty prompt's conditioning (prompt embeds and pooled; time ids kept).
6. A cached dataset without empty_prompt.safetensors (format version 1) is
   refused with p > 0, naming the option, the file and how to make it.
7. The next micro-step's host inputs (batch, dropout, noise, timesteps, min-SNR
   weights) made during the current one, as the trainer does, train bit for
   bit what making them when needed does (SDXL_NO_INPUT_PREFETCH=1): p = 0.5,
   noise offset and min-SNR, two micro-steps a step (a prefetch within a step
   and across steps).

  check_caption_dropout.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]
"""
import json
import os
import shutil
import subprocess
import sys
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
STEPS = 4
GLOBAL_BATCH = 8
KEY = "data/captions_dropped"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, load_dataset_writer, pattern_values  # noqa: E402


def command(name, ranks, overrides):
    out = os.path.join(WORK, name)
    defaults = [] if "--checkpoint_every" in overrides else ["--checkpoint_every", "0"]
    return out, [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
                 "--steps", str(STEPS), "--synthetic_samples", "64", "--log_every", "1", "--save_final", "false",
                 "--export_unet", "false", "--warmup_steps", "1", "--batch_size", str(GLOBAL_BATCH // ranks), *defaults, *overrides]


def train(name, ranks, *overrides, fresh=True, env=None):
    out, cmd = command(name, ranks, overrides)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env=None if env is None else {**os.environ, **env})
    print(f"  ran {' '.join(cmd[3 + len(MPI_FLAGS):])} with {ranks} rank(s) in {time.time() - start:.1f} s")
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:])
        raise SystemExit(f"train failed ({result.returncode})")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def losses(rows):
    return [row["loss"] for row in rows]


def counts(rows):
    return [row.get(KEY) for row in rows]


def write_dataset(directory, empty_everywhere):
    """64 samples of the tiny model's dims (text 7x64, pooled 32). With
    empty_everywhere every sample's text conditioning is the empty prompt's
    and no empty prompt is recorded (a version-1 dataset); else the empty
    prompt is recorded."""
    prepare = load_dataset_writer()
    text = {"sequence_length": 7, "width": 64, "pooled_width": 32}
    writer = prepare.DatasetWriter(directory=prepare.Path(directory), text_dims=text, samples_per_shard=16,
                                   vae_scaling_factor=prepare.SDXL_VAE_SCALING_FACTOR)
    empty = (("F32", (7, 64), pattern_values(7 * 64, 999)), ("F32", (32,), pattern_values(32, 998)))
    for i in range(64):
        embeds = empty if empty_everywhere else (("F32", (7, 64), pattern_values(7 * 64, i + 100)), ("F32", (32,), pattern_values(32, i + 200)))
        # Time ids differ per sample: dropout must keep them.
        writer.add(("F32", (4, 16, 16), pattern_values(4 * 16 * 16, i)), *embeds, (100 + i, 140 - i), (i % 3, i % 5), (128, 128),
                   f"sample {i}")
    if not empty_everywhere:
        writer.set_empty_prompt(*empty)
    writer.finish()


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)

    # 1. p = 0 is today's run.
    base = train("base", 2)
    zero = train("p0", 2, "--caption_dropout", "0")
    check(losses(zero) == losses(base), "caption_dropout = 0 trains the run without the option bit for bit")
    check(all(c is None for c in counts(zero)), f"p = 0 logs no {KEY}")

    # 2. p = 0.5 at N=2.
    half = train("half-np2", 2, "--caption_dropout", "0.5")
    c = counts(half)
    print(f"  dropped per step (N=2): {c}")
    check(all(isinstance(x, (int, float)) and 0 <= x <= GLOBAL_BATCH for x in c), f"{KEY} logged every step in [0, 8]")
    total = sum(x or 0 for x in c)
    # Binomial(32, 0.5): sd ~2.8; 4 sd either side.
    check(5 <= total <= 27, f"{total} of {STEPS * GLOBAL_BATCH} samples dropped, near p x samples = 16")
    check(len(set(c)) > 1, "the count varies between steps (draws per sample, not per step)")
    check(losses(half) != losses(base), "p = 0.5 trains another trajectory than p = 0")

    # 3. N=1, same global batch: the same samples dropped.
    one = train("half-np1", 1, "--caption_dropout", "0.5")
    check(counts(one) == c, f"N=1 drops as many samples as N=2 every step ({counts(one)})")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses(one), losses(half)))
    check(worst <= 1e-4, f"N=1 and N=2 losses agree within 1e-4 (got {worst:.2e})")

    # 4. Stop after step 2, resume: bitwise.
    train("half-resumed", 2, "--caption_dropout", "0.5", "--checkpoint_every", "2", "--stop_after", "2")
    resumed = train("half-resumed", 2, "--caption_dropout", "0.5", "--checkpoint_every", "2", "--resume", "latest",
                    fresh=False)
    check(losses(resumed) == losses(half) and counts(resumed) == c,
          "a run stopped after step 2 and resumed drops the same samples and trains the same losses bit for bit")

    # 5. p = 1: every sample, on the empty prompt only.
    with_empty = os.path.join(WORK, "dataset-with-empty")
    all_empty = os.path.join(WORK, "dataset-all-empty")
    write_dataset(with_empty, empty_everywhere=False)
    write_dataset(all_empty, empty_everywhere=True)
    cached = ["--synthetic", "false"]
    p1 = train("p1-cached", 2, *cached, "--dataset", with_empty, "--caption_dropout", "1")
    p0 = train("p0-all-empty", 2, *cached, "--dataset", all_empty, "--caption_dropout", "0")
    check(counts(p1) == [GLOBAL_BATCH] * STEPS, f"p = 1 drops all {GLOBAL_BATCH} samples of every step")
    check(losses(p1) == losses(p0),
          "p = 1 trains bit for bit what p = 0 trains on the dataset whose every caption is the empty prompt")

    # 6. Refused without the empty prompt.
    out, cmd = command("refused", 2, [*cached, "--dataset", all_empty, "--caption_dropout", "0.1"])
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    text = result.stdout + result.stderr
    said = [line for line in text.splitlines() if "caption_dropout" in line]
    print(f"  refused in {time.time() - start:.1f} s: {said[0] if said else text[-2000:]}")
    check(result.returncode != 0, "p > 0 on a dataset without an empty prompt exits non-zero")
    for fragment in ("caption_dropout", "empty_prompt.safetensors", "examples/sdxl/prepare", all_empty):
        check(fragment in text, f"the refusal names {fragment!r}")
    check("frame #" not in text, "the refusal carries no C++ frames")

    # 7. Inputs prefetched during the previous micro-step or made when needed: the same bits.
    varied = ["--caption_dropout", "0.5", "--noise_offset", "0.05", "--min_snr_gamma", "5", "--accumulation", "2"]
    prefetched = train("prefetched", 2, *varied)
    when_needed = train("when-needed", 2, *varied, env={"SDXL_NO_INPUT_PREFETCH": "1"})
    check(losses(prefetched) == losses(when_needed) and counts(prefetched) == counts(when_needed),
          "inputs prefetched during the previous micro-step train bit for bit what inputs made when needed do")

    if failures:
        print(f"{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
        return 1
    print("all caption dropout checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
