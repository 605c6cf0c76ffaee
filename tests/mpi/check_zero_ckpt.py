#!/usr/bin/env python3
"""zero-ckpt against the engine's own gathers (stdlib only).

  check_zero_ckpt.py ZERO_CKPT MPIEXEC CHECKPOINT_WRITER [mpiexec flags...]

For N in (2, 3), stage in (1, 2, 3) (AdamW; plus SGD with momentum and Lion at
N=3 stage 2), checkpoint_writer trains under mpirun and saves a checkpoint
folder plus a reference file of gather_master_params() & co. Then:

1. consolidate --dtype fp32 equals the reference bit for bit, names and shapes
   from the layout ([numel] where none was recorded);
2. --dtype bf16 equals round-to-nearest-even of the reference;
3. --what ema and --optimizer-state give the EMA and the moments under
   PyTorch's names;
4. verify passes; after flipping one byte, truncating a shard or deleting one
   it fails, naming the file; a FIFO in place of a shard is "not a regular file";
   consolidate refuses a flipped byte in the master data or a truncated shard
   (naming the file, writing nothing), and an --out inside the folder or
   linked to one of its files (the checkpoint stays as it was);
5. inspect --json parses and reports step, world size, stage, files.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from array import array

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import e2e_harness  # noqa: E402

ZERO_CKPT, MPIEXEC, WRITER = sys.argv[1:4]
MPI_FLAGS = sys.argv[4:]
STEP = 3
SHAPES = {"block.0.weight": [37, 11], "block.0.bias": [37], "scalar": [1], "block.1.weight": [5, 3, 3, 7],
          "no_shape": [513], "head.weight": [10, 100]}
STATE_NAMES = {"adamw": ["exp_avg", "exp_avg_sq"], "lion": ["exp_avg"], "sgd": ["momentum_buffer"]}

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300)


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} and the metadata."""
    return e2e_harness.read_safetensors(path, raw=True)


def bf16_rne(fp32_bytes):
    words = array("I")
    words.frombytes(fp32_bytes)
    out = array("H")
    for x in words:
        if (x & 0x7FFFFFFF) > 0x7F800000:
            out.append((x >> 16) | 0x40)
        else:
            out.append(((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF)
    return out.tobytes()


def check_consolidated(work, folder, reference, label, optimizer):
    ref, _ = read_safetensors(reference)
    out = os.path.join(work, "full.safetensors")
    r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
    if not check(r.returncode == 0, f"{label}: consolidate fp32 runs ({r.stderr.strip()})"):
        return
    got, meta = read_safetensors(out)
    check(list(got) == list(SHAPES), f"{label}: fp32 holds every parameter in layout order")
    check(all(got[n][0] == "F32" and got[n][1] == SHAPES[n] for n in SHAPES), f"{label}: fp32 dtypes and shapes")
    check(all(got[n][2] == ref[n][2] for n in SHAPES),
          f"{label}: fp32 weights equal gather_master_params() bit for bit")
    check(meta.get("zero.step") == str(STEP), f"{label}: metadata records the step")

    r = run(ZERO_CKPT, "consolidate", folder, "--out", out, "--dtype", "bf16")
    check(r.returncode == 0, f"{label}: consolidate bf16 runs")
    got, _ = read_safetensors(out)
    check(all(got[n][0] == "BF16" and got[n][2] == bf16_rne(ref[n][2]) for n in SHAPES),
          f"{label}: bf16 weights are the reference rounded to nearest even")

    r = run(ZERO_CKPT, "consolidate", folder, "--out", out, "--what", "ema", "--optimizer-state")
    check(r.returncode == 0, f"{label}: consolidate --what ema --optimizer-state runs ({r.stderr.strip()})")
    got, _ = read_safetensors(out)
    names = STATE_NAMES[optimizer]
    want = list(SHAPES) + [f"{n}.{s}" for s in names for n in SHAPES]
    check(list(got) == want, f"{label}: ema + optimizer state names {names}")
    check(all(got[n][2] == ref[n + ".ema"][2] for n in SHAPES), f"{label}: EMA equals gather_ema_params()")
    check(all(got[f"{n}.{s}"][2] == ref[f"{n}.state{k}"][2] for k, s in enumerate(names) for n in SHAPES),
          f"{label}: moments equal gather_optimizer_state()")


def check_inspect(folder, label, ranks, stage, optimizer):
    r = run(ZERO_CKPT, "inspect", folder, "--json", "--params")
    try:
        info = json.loads(r.stdout)
    except ValueError:
        check(False, f"{label}: inspect --json parses ({r.stdout[:200]!r})")
        return
    check(r.returncode == 0 and info["step"] == STEP and info["world_size"] == ranks and info["stage"] == stage,
          f"{label}: inspect --json reports step {STEP}, world size {ranks}, stage {stage}")
    check(info["optimizer"]["name"] == optimizer and info["param_dtype"] == "bf16" and info["seed"] == 1234,
          f"{label}: inspect --json reports optimizer, dtype and seed")
    check(len(info["files"]) == ranks and all("master" in [t["name"] for t in f["tensors"]] for f in info["files"]),
          f"{label}: inspect --json lists every rank file and its tensors")
    check([p["name"] for p in info["params"]] == list(SHAPES) and
          all(p["shape"] == SHAPES[p["name"]] for p in info["params"]), f"{label}: inspect --params lists shapes")
    r = run(ZERO_CKPT, "inspect", folder, "--params")
    check(r.returncode == 0 and "block.1.weight" in r.stdout and "[5, 3, 3, 7]" in r.stdout,
          f"{label}: inspect (text) runs")


def check_verify(work, folder, label, ranks):
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode == 0 and r.stdout.count("OK") == ranks + 2, f"{label}: verify passes on a good checkpoint")
    victim = os.path.join(folder, "rank-00001.safetensors")
    saved = os.path.join(work, "saved.safetensors")
    shutil.copyfile(victim, saved)
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.seek(size - 5)
        byte = f.read(1)
        f.seek(size - 5)
        f.write(bytes([byte[0] ^ 0x10]))
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode != 0 and "rank-00001.safetensors" in r.stdout and "corrupted" in r.stdout,
          f"{label}: verify names a shard with one flipped byte")
    shutil.copyfile(saved, victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode != 0 and "rank-00001.safetensors" in r.stdout and "truncated" in r.stdout,
          f"{label}: verify names a truncated shard")
    os.remove(victim)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode != 0 and "rank-00001.safetensors" in r.stdout and "missing" in r.stdout,
          f"{label}: verify names a deleted shard")
    r = run(ZERO_CKPT, "consolidate", folder, "--out", os.path.join(work, "x.safetensors"))
    check(r.returncode != 0 and "rank-00001.safetensors" in r.stderr, f"{label}: consolidate refuses, naming the file")
    shutil.copyfile(saved, victim)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode == 0, f"{label}: restored shard verifies again")
    manifest_path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(manifest_path))
    a, b = (os.path.join(folder, f"rank-0000{i}.safetensors") for i in (0, 1))
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    # A version-1 manifest (the trainer's first format, checksums optional)
    # with the swapped files' sizes: only the shard metadata can tell.
    v1 = {"format": "zero.sdxl.checkpoint", "version": 1, "step": manifest["step"],
          "world_size": manifest["world_size"], "stage": manifest["stage"],
          "files": [{"file": f["file"], "bytes": os.path.getsize(os.path.join(folder, f["file"]))}
                    for f in manifest["files"]]}
    with open(manifest_path, "w") as f:
        json.dump(v1, f)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode != 0 and "rank-00000.safetensors" in r.stdout and "says it is rank 1" in r.stdout,
          f"{label}: verify refuses shards in the wrong rank order (version-1 manifest read)")


def tensor_range(path, name):
    """(first, end) byte offsets of tensor `name` in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    a, b = header[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def check_output_refused(work, folder, label):
    """consolidate --out inside the folder, or a link to one of its files, is refused; nothing changes."""
    victim = os.path.join(folder, "rank-00000.safetensors")
    link = os.path.join(work, "link.safetensors")
    os.symlink(os.path.join(folder, "rank-00001.safetensors"), link)
    before = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
    for out, what in [(victim, "is the checkpoint's own file"),
                      (os.path.join(folder, "manifest.json"), "is the checkpoint's own file"),
                      (os.path.join(folder, "full.safetensors"), "lies inside the checkpoint folder"),
                      (os.path.join(folder, "sub", "..", "x.safetensors"), "lies inside the checkpoint folder"),
                      (link, "is the checkpoint's own file")]:
        r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
        check(r.returncode == 1 and what in r.stderr and out in r.stderr,
              f"{label}: consolidate --out {os.path.relpath(out, work)} is refused, naming it ({r.stderr.strip()})")
    after = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
    check(after == before, f"{label}: the refused outputs left the checkpoint folder as it was")
    check(os.path.islink(link), f"{label}: the refused link output is still the link")
    os.remove(link)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode == 0, f"{label}: the checkpoint still verifies after the refused outputs")


def check_consolidate_verifies(work, folder, label):
    """A flipped byte in a shard's master data, a truncated shard, a FIFO: consolidate fails naming the file,
    and the output (here an older file) stays as it was, with no temporary file left."""
    victim = os.path.join(folder, "rank-00001.safetensors")
    saved = os.path.join(work, "saved-for-consolidate.safetensors")
    shutil.copyfile(victim, saved)
    out_dir = os.path.join(work, "consolidated")
    os.makedirs(out_dir)
    out = os.path.join(out_dir, "full.safetensors")
    with open(out, "wb") as f:
        f.write(b"an older output")
    first, end = tensor_range(victim, "master")
    with open(victim, "r+b") as f:
        f.seek((first + end) // 2)
        byte = f.read(1)
        f.seek((first + end) // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
    check(r.returncode == 1 and "rank-00001.safetensors" in r.stderr and "corrupted" in r.stderr,
          f"{label}: consolidate refuses a flipped byte in the master data, naming the file ({r.stderr.strip()})")
    fresh = os.path.join(out_dir, "fresh.safetensors")
    r = run(ZERO_CKPT, "consolidate", folder, "--out", fresh, "--dtype", "bf16")
    check(r.returncode == 1 and not os.path.exists(fresh), f"{label}: a refused consolidate writes no output file")
    shutil.copyfile(saved, victim)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(saved) - 4)
    r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
    check(r.returncode == 1 and "rank-00001.safetensors" in r.stderr and "truncated" in r.stderr,
          f"{label}: consolidate refuses a truncated shard, naming the file ({r.stderr.strip()})")
    os.remove(victim)
    os.mkfifo(victim)
    r = run(ZERO_CKPT, "verify", folder)
    check(r.returncode == 1 and "rank-00001.safetensors" in r.stdout and "not a regular file" in r.stdout
          and "FIFO" in r.stdout, f"{label}: verify calls a FIFO rank file not a regular file ({r.stdout.strip()})")
    r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
    check(r.returncode == 1 and "not a regular file" in r.stderr, f"{label}: consolidate refuses a FIFO rank file")
    os.remove(victim)
    shutil.copyfile(saved, victim)
    check(open(out, "rb").read() == b"an older output" and os.listdir(out_dir) == ["full.safetensors"],
          f"{label}: the refused consolidations left the older output and no temporary file")
    r = run(ZERO_CKPT, "consolidate", folder, "--out", out)
    check(r.returncode == 0, f"{label}: the restored checkpoint consolidates again")
    shutil.rmtree(out_dir)


def main():
    work = tempfile.mkdtemp(prefix="zero-ckpt-test-")
    try:
        cases = [(n, s, "adamw") for n in (2, 3) for s in (1, 2, 3)] + [(3, 2, "sgd"), (3, 2, "lion")]
        for ranks, stage, optimizer in cases:
            label = f"N={ranks} stage {stage} {optimizer}"
            case = os.path.join(work, f"n{ranks}-s{stage}-{optimizer}")
            root = os.path.join(case, "checkpoints")
            reference = os.path.join(case, "reference.safetensors")
            os.makedirs(root)
            r = run(MPIEXEC, "-np", str(ranks), *MPI_FLAGS, WRITER, root, str(stage), optimizer, reference)
            if not check(r.returncode == 0, f"{label}: checkpoint_writer ran"):
                print(r.stdout[-2000:], r.stderr[-2000:])
                continue
            folder = os.path.join(root, f"step-{STEP:08d}")
            check(os.path.exists(os.path.join(folder, "manifest.json")), f"{label}: manifest written")
            check_consolidated(case, folder, reference, label, optimizer)
            check_inspect(root, label + " (root folder)", ranks, stage, optimizer)
            check_output_refused(case, folder, label)
            check_consolidate_verifies(case, folder, label)
            check_verify(case, folder, label, ranks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


main()
