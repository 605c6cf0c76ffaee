#!/usr/bin/env python3
"""LoRA in the SDXL trainer on CPU ranks (stdlib only).

  check_lora.py TRAIN UNET_FORWARD ZERO_CKPT MPIEXEC CONFIG WORKDIR [mpiexec flags...]

From the fixture's weights (the trainer's tiny UNet), [lora] rank 4, alpha 8
(a scale of 2, so the files' rescaling is exercised), fp32, at N = ZERO_TEST_RANKS
ranks (default 2; the CTest label "sweep" adds N = 1 and 3, sections 1-4):
1. Stage 2: the LoRA line is printed; the model state per rank follows the
   formula over the adapter parameters only (optimizer state 8 bytes and
   gradients 4 bytes per adapter element / N, no master weights in fp32;
   parameters 4 bytes per element of adapters and frozen base); the checkpoint's frozen base equals
   --model_weights bit for bit and its adapters equal the export.
2. Stages 0 and 3 (and offloaded stage 3) train the stage-2 trajectory bit
   for bit; stopped after step 5 and resumed, steps 6-10 equal the
   uninterrupted run bit for bit; the same with dropout (masks drawn from
   (seed, step, micro-step, rank)).
3. Exports: diffusers/PEFT and kohya files hold the same adapters (PEFT's B
   with alpha / rank multiplied in, kohya's with its alpha); unet_forward
   applying either file to the base reproduces the trained model's output
   (export_check.safetensors) within 1e-5; the merge_lora UNet holds
   W + (alpha / rank) B A for adapted layers (1e-6) and the base bit for bit
   elsewhere, and reproduces the model within 1e-5.
4. [lora] init_from the PEFT file and the kohya file: both start from the
   trained adapters: the first step's loss (same batch, noise and timesteps)
   is equal, and lower than from scratch: the adapters learned.
5. Refusals naming the option: freeze with LoRA, dropout with activation
   checkpointing, a target that matches nothing or a convolution, merge_lora
   without LoRA, init_from with another rank (at N = 1 whatever
   ZERO_TEST_RANKS is, so only in the default N = 2 run).
"""
import json
import math
import os
import shutil
import subprocess
import sys
import time

TRAIN, UNET_FORWARD, ZERO_CKPT, MPIEXEC, CONFIG, WORK = sys.argv[1:7]
MPI_FLAGS = sys.argv[7:]
RANKS = int(os.environ.get("ZERO_TEST_RANKS", "2"))
STEPS = 10
RANK, ALPHA = 4, 8.0
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "sdxl",
                       "tiny_a_weights.safetensors")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, read_safetensors  # noqa: E402


def run(name, *overrides, ranks=RANKS, fresh=True):
    out = os.path.join(WORK, name)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    # An option given in `overrides` replaces the default (the command line takes each once).
    options = {"--steps": str(STEPS), "--synthetic_samples": "64", "--log_every": "5", "--model_weights": WEIGHTS,
               "--lora_rank": str(RANK), "--lora_alpha": str(ALPHA), "--lr": "1e-2", "--ema_decay": "0",
               "--warmup_steps": "2", "--checkpoint_every": "0"}
    for key, value in zip(overrides[::2], overrides[1::2]):
        options[key] = value
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           *[x for kv in options.items() for x in kv]]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"  ran {' '.join(cmd[3 + len(MPI_FLAGS) + 4:])} in {time.time() - start:.1f} s (exit {result.returncode})")
    return result.returncode, result.stdout + result.stderr, out


def losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {row["step"]: row["loss"] for row in rows}


read_st = read_safetensors


def rel_l2(got, want):
    return math.sqrt(sum((g - w) ** 2 for g, w in zip(got, want)) / sum(w * w for w in want))


def forward(model, inputs, output, *extra):
    result = subprocess.run([UNET_FORWARD, "--model", model, "--inputs", inputs, "--output", output, *extra],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout[-2000:], result.stderr[-2000:])
        return None
    return read_st(output)[0]["sample"][2]


os.makedirs(WORK, exist_ok=True)
base, _ = read_st(WEIGHTS)

# 1. Stage 2.
code, output, out2 = run("lora-stage2", "--stage", "2", "--merge_lora", "true", "--checkpoint_every", "5")
if code != 0:
    print(output[-4000:])
    raise SystemExit("LoRA at stage 2 failed")
check(f"LoRA: rank {RANK}, alpha 8 (scale 2)" in output, "the LoRA line is printed")
a = losses(out2)
check(sorted(a) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in a.values()),
      "LoRA: every step logged with a finite loss (that it learns: section 4)")

peft, peft_meta = read_st(os.path.join(out2, "lora", "pytorch_lora_weights.safetensors"))
kohya, kohya_meta = read_st(os.path.join(out2, "lora", "lora_kohya.safetensors"))
adapters = {n[len("unet."):-len(".lora_A.weight")] for n in peft if n.endswith(".lora_A.weight")}
adapter_elements = sum(math.prod(peft[n][1]) for n in peft)
print(f"  {len(adapters)} adapted layers, {adapter_elements} adapter elements")
check(len(adapters) > 0 and all(m.endswith(("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"))
                                for m in adapters),
      "the default targets adapt the attention projections and feed-forward layers")
# Model state per rank: "model state per rank: params X, grads Y, master Z, optimizer W, ..."
line = next((l for l in output.splitlines() if "model state per rank:" in l), "")
print("  " + line.strip())


def field(name):
    import re
    m = re.search(name + r" ([0-9.]+) (B|KiB|MiB|GiB)", line)
    if not m:
        return None
    return float(m.group(1)) * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]


base_elements = sum(math.prod(v[1]) for v in base.values())
# fp32: the parameters are their own master weights (master 0 B).
check(field("master") == 0, "fp32: no separate master weights")
for what, expected in [("optimizer", 8 * adapter_elements / RANKS), ("grads", 4 * adapter_elements / RANKS),
                       ("params", 4 * (adapter_elements + base_elements))]:
    got = field(what)
    # the engine pads each shard to its alignment: within 5% + 4 KiB
    check(got is not None and abs(got - expected) <= 0.05 * expected + 4096,
          f"stage 2 {what} bytes per rank follow the adapters only: {got} vs {expected:.0f} "
          f"at N = {RANKS} (the base's {base_elements} elements would need {4 * base_elements / RANKS:.0f})")

# The checkpoint: frozen base bit for bit, adapters as exported.
ckpt = os.path.join(out2, "checkpoints", f"step-{STEPS:08d}")
consolidated = os.path.join(WORK, "lora-consolidated.safetensors")
result = subprocess.run([ZERO_CKPT, "consolidate", ckpt, "--out", consolidated], capture_output=True, text=True)
check(result.returncode == 0, "zero-ckpt consolidates the LoRA checkpoint " + result.stderr[-300:])
if result.returncode == 0:
    held, _ = read_st(consolidated)
    same = [n for n in base if held.get(n, (None, None, None))[2] == base[n][2]]
    check(len(same) == len(base), f"the checkpoint's base equals --model_weights bit for bit "
                                  f"({len(base) - len(same)} of {len(base)} differ)")
    a_same = all(held[f"{m}.lora_A.weight"][2] == peft[f"unet.{m}.lora_A.weight"][2] for m in adapters)
    check(a_same, "the checkpoint's lora_A equal the exported ones")
    b_gap = max(abs(2 * h - p) for m in adapters
                for h, p in zip(held[f"{m}.lora_B.weight"][2], peft[f"unet.{m}.lora_B.weight"][2]))
    check(b_gap == 0, f"the PEFT file's lora_B are the trained ones times alpha / rank = 2 (gap {b_gap})")

# 3. The two namings, applied by unet_forward, reproduce the trained model.
meta = json.loads(peft_meta.get("lora_adapter_metadata", "{}"))
check(meta.get("unet.r") == RANK and meta.get("unet.lora_alpha") == RANK and
      sorted(meta.get("unet.target_modules", [])) == sorted(adapters),
      "the PEFT file's lora_adapter_metadata: r, lora_alpha = r (scale multiplied in), target_modules")
kohya_alphas = {n: v for n, v in kohya.items() if n.endswith(".alpha")}
check(len(kohya_alphas) == len(adapters) and all(v[2] == (ALPHA,) for v in kohya_alphas.values()),
      "the kohya file has one alpha per layer, equal to [lora] alpha")
check(any("input_blocks" in n for n in kohya) and all(n.startswith("lora_unet_") for n in kohya),
      "the kohya file names layers as the original SDXL checkpoint (lora_unet_input_blocks_…)")
check_file = os.path.join(out2, "export_check.safetensors")
want = read_st(check_file)[0]["expected"][2]
for label, path in [("PEFT", os.path.join(out2, "lora", "pytorch_lora_weights.safetensors")),
                    ("kohya", os.path.join(out2, "lora", "lora_kohya.safetensors"))]:
    got = forward(WEIGHTS, check_file, os.path.join(WORK, f"lora-{label}.safetensors"), "--lora", path)
    err = rel_l2(got, want) if got else float("inf")
    check(err <= 1e-5, f"the base + the {label} file reproduces the trained model (rel. L2 {err:.2e})")
merged, _ = read_st(os.path.join(out2, "unet", "diffusion_pytorch_model.safetensors"))
untouched = [n for n in base if not any(n.startswith(m + ".") for m in adapters)]
check(all(merged[n][2] == base[n][2] for n in untouched),
      f"merge_lora: the {len(untouched)} tensors of layers without adapters equal the base bit for bit")
worst = 0.0
for m in adapters:
    w = base[m + ".weight"]
    out_f, in_f = w[1]
    A = peft[f"unet.{m}.lora_A.weight"][2]
    B = peft[f"unet.{m}.lora_B.weight"][2]  # already times alpha / rank
    got = merged[m + ".weight"][2]
    for o in range(out_f):
        for i in range(in_f):
            exact = w[2][o * in_f + i] + sum(B[o * RANK + r] * A[r * in_f + i] for r in range(RANK))
            worst = max(worst, abs(got[o * in_f + i] - exact) / max(1.0, abs(exact)))
check(worst <= 1e-6, f"merge_lora: adapted weights equal W + (alpha / rank) B A (worst {worst:.2e})")
got = forward(os.path.join(out2, "unet"), check_file, os.path.join(WORK, "lora-merged.safetensors"))
err = rel_l2(got, want) if got else float("inf")
check(err <= 1e-5, f"merge_lora: the merged UNet reproduces the trained model (rel. L2 {err:.2e})")

# 2. Stages and resume, bit for bit.
for stage, extra in [("0", ()), ("3", ()),
                     ("3", ("--offload_optimizer", "true", "--offload_params", "true"))]:
    code, output, out = run(f"lora-stage{stage}{'-offload' if extra else ''}", "--stage", stage, *extra,
                            "--export_unet", "false", "--save_final", "false")
    label = f"stage {stage}{' offloaded' if extra else ''}"
    if code != 0:
        print(output[-3000:])
    check(code == 0 and losses(out) == a, f"LoRA: {label} trains the stage-2 trajectory bit for bit")
code, output, out = run("lora-resumed", "--stage", "3", "--stop_after", "5", "--export_unet", "false")
code, output, out = run("lora-resumed", "--stage", "3", "--resume", "latest", "--export_unet", "false", fresh=False)
if code != 0:
    print(output[-3000:])
check(code == 0 and all(losses(out).get(s) == a[s] for s in range(6, STEPS + 1)),
      "LoRA: stopped after step 5 and resumed, steps 6-10 equal the uninterrupted run bit for bit")
code, output, outd = run("lora-dropout", "--stage", "2", "--lora_dropout", "0.1", "--export_unet", "false")
d = losses(outd) if code == 0 else {}
check(code == 0 and d != a and all(math.isfinite(v) for v in d.values()),
      "LoRA dropout: trains (finite losses), another trajectory than without dropout")
code, output, out = run("lora-dropout-s3", "--stage", "3", "--lora_dropout", "0.1", "--stop_after", "5",
                        "--export_unet", "false")
code, output, out = run("lora-dropout-s3", "--stage", "3", "--lora_dropout", "0.1", "--resume", "latest",
                        "--export_unet", "false", fresh=False)
check(code == 0 and losses(out) == d,
      "LoRA dropout: stage 3, stopped and resumed, trains the stage-2 trajectory bit for bit")

# 4. init_from either file: the same start, the trained adapters.
starts = {}
for label, path in [("PEFT", os.path.join(out2, "lora", "pytorch_lora_weights.safetensors")),
                    ("kohya", os.path.join(out2, "lora", "lora_kohya.safetensors"))]:
    code, output, out = run(f"lora-init-{label}", "--stage", "2", "--lora_init_from", path, "--steps", "2",
                            "--export_unet", "false")
    if code != 0:
        print(output[-2000:])
    starts[label] = losses(out)[1] if code == 0 else None
check(starts["PEFT"] is not None and starts["PEFT"] == starts["kohya"] and starts["PEFT"] < a[1],
      f"init_from: the PEFT and kohya files start from the same trained adapters (step-1 loss {starts['PEFT']} "
      f"vs {a[1]} from scratch)")

# 5. Refusals (at N = 1: once, in the default N = 2 run).
for name, args, reason in [] if RANKS != 2 else [
        ("lora-freeze", ("--freeze", "conv_in.*"), "LoRA freezes the whole UNet"),
        ("lora-dropout-ckpt", ("--lora_dropout", "0.1", "--activation_checkpointing", "true"),
         "[lora] dropout = 0.1 does not work with activation_checkpointing"),
        ("lora-typo", ("--lora_target", "*.to_qq"), "target '*.to_qq' matches no Linear layer"),
        ("lora-conv", ("--lora_target", "*.conv1"), "matches the convolution"),
        ("lora-merge-off", ("--lora_rank", "0", "--merge_lora", "true"), "merge_lora needs [lora] rank > 0"),
        ("lora-init-rank", ("--lora_rank", "8", "--lora_init_from",
                            os.path.join(out2, "lora", "lora_kohya.safetensors")), "has rank 4, [lora] rank is 8")]:
    code, output, _ = run(name, *args, ranks=1)
    if code == 0 or reason not in output:
        print(output[-2000:])
    check(code != 0 and reason in output, f"{name}: refused, naming it ({reason})")

print(f"{len(failures) == 0 and 'all passed' or 'FAILED: ' + '; '.join(failures)}")
sys.exit(1 if failures else 0)
