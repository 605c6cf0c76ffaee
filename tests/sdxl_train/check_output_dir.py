#!/usr/bin/env python3
"""What the trainer does with output_dir and the checkpoints in it when used
carelessly (examples/sdxl/train, tiny.toml; stdlib only, black-box: drives the
trainer and reads the files it leaves). One baseline run (checkpoints of
steps 2 and 4; N=2 for case 3, else N=1) is copied for each case.

  check_output_dir.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

1. Links: a step folder in output_dir/checkpoints that is a symbolic link to
   another run's checkpoint is refused, naming it, and the other run's files
   stay (rotation used to delete through it); so is a checkpoints folder that
   is a link.
2. Another run: a folder holding checkpoints and metrics is refused without
   --resume, untouched; --overwrite says what it removes and starts afresh. A
   second run into a folder a live run holds is refused naming the holder
   (pid, host); the live run finishes. A lock left by a killed run on this host
   is reported and taken over; one from another host is refused with the
   command that removes it.
3. Re-saving a step: resumed from step 2 with step 4 present, rank 1 killed
   while writing its step-4 shard (ZERO_FAULT_KILL_DURING_WRITE): the old step-4
   checkpoint is whole and unchanged, what the save left is hidden and ignored,
   --resume latest resumes from it, and its next save clears the leftovers.
4. The manifest's step is checked against the shards': "step": 1000, 3 and
   INT64_MAX are refused naming both values and the file; a version-1 manifest
   without CRCs is refused unless --accept_unchecksummed_checkpoint.
5. Smaller surprises: --resume latest with only incomplete checkpoints is
   refused (--overwrite starts afresh); a damaged newest checkpoint names the
   older complete one to resume; --steps below the checkpoint's step is
   refused naming both; "resumed from" is not printed before a refused resume;
   an output_dir that cannot be created is refused before the model is built.

ZERO_TEST_CASES=13 runs only some cases (CTest runs 1 and 2, 3, 4, 5 as four tests).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
TIMEOUT_S = 10  # ZERO_COMM_TIMEOUT_S for every run
CASES = os.environ.get("ZERO_TEST_CASES", "12345")
failures = []


def check(condition, message, output=None):
    print(("ok   " if condition else "FAIL ") + message, flush=True)
    if not condition:
        failures.append(message)
        if output:
            print("\n".join("    | " + line for line in output.splitlines()[-25:]))
    return condition


DEFAULTS = {"--steps": "6", "--warmup_steps": "0", "--synthetic_samples": "64", "--batch_size": "1", "--log_every": "1",
            "--checkpoint_every": "2", "--keep_checkpoints": "5", "--save_final": "false", "--export_unet": "false"}


def command(out, ranks, overrides):
    """The trainer's command line: the defaults above, each replaced by an override of the same option."""
    options = [o for o in overrides if o.startswith("--")]
    defaults = [x for key, value in DEFAULTS.items() if key not in options for x in (key, value)]
    return [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out, *defaults,
            *overrides]


def run(out, *overrides, ranks=1, env=None):
    """One mpirun to its end: (exit code, stdout + stderr)."""
    start = time.time()
    result = subprocess.run(command(out, ranks, overrides), capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, ZERO_COMM_TIMEOUT_S=str(TIMEOUT_S), **(env or {})))
    shown = " ".join(overrides) + "".join(f" [{k}={v}]" for k, v in (env or {}).items())
    print(f"  ran -np {ranks} {shown}: exit {result.returncode} in {time.time() - start:.1f} s", flush=True)
    return result.returncode, result.stdout + result.stderr


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step-{step:08d}")


def fingerprint(folder):
    """Every file under folder (not following links) with its bytes."""
    found = {}
    for base, dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found


def listing(out):
    root = os.path.join(out, "checkpoints")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []


def copy_of(source, name):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, symlinks=True)
    return out


def edit_manifest(out, folder_step, **changes):
    path = os.path.join(ckpt(out, folder_step), "manifest.json")
    manifest = json.load(open(path))
    manifest.update(changes)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return manifest


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
t0 = time.time()

# The run every case starts from: checkpoints of steps 2 and 4, metrics of
# steps 1-5; two ranks where a rank is killed (case 3), else one.
base = os.path.join(WORK, "baseline")
code, output = run(base, "--steps", "5", ranks=2 if "3" in CASES else 1)
if not check(code == 0 and listing(base) == ["step-00000002", "step-00000004"], "baseline: steps 2 and 4 saved", output):
    sys.exit(1)

# 1. Links in the checkpoints folder.
if "1" in CASES:
    other = copy_of(base, "link-target")
    before = fingerprint(other)
    out = os.path.join(WORK, "link-holder")
    os.makedirs(os.path.join(out, "checkpoints"))
    link = os.path.join(out, "checkpoints", "step-00000001")
    os.symlink(ckpt(other, 4), link)
    code, output = run(out, "--steps", "8", "--keep_checkpoints", "1", "--resume", "latest")
    check(code != 0 and f"checkpoint folder {link} is a symbolic link" in output,
          "1. a step folder that is a link is refused, naming it", output)
    check(fingerprint(other) == before and os.path.islink(link),
          "1. the linked run's files are untouched (nothing deleted through the link)")
    out = os.path.join(WORK, "linked-root")
    os.makedirs(out)
    os.symlink(os.path.join(other, "checkpoints"), os.path.join(out, "checkpoints"))
    code, output = run(out, "--steps", "8", "--keep_checkpoints", "1")
    check(code != 0 and "checkpoints is a symbolic link" in output and "must be a real folder" in output,
          "1. a checkpoints folder that is a link is refused", output)
    check(fingerprint(other) == before, "1. the run it links to is untouched")

# 2. Another run in the folder: refused, --overwrite, the lock.
if "2" in CASES:
    out = copy_of(base, "reused")
    before = fingerprint(out)
    code, output = run(out, "--steps", "3")
    check(code != 0 and "holds an earlier run: 2 checkpoint(s) (step-00000002, step-00000004)" in output
          and "metrics.jsonl (5 steps logged)" in output and "--overwrite" in output and "--resume latest" in output,
          "2. a folder with another run is refused without --resume, saying what it holds", output)
    check(fingerprint(out) == before, "2. the refused run changed nothing in the folder")
    code, output = run(out, "--steps", "3", "--overwrite")
    check(code == 0 and "--overwrite: removing the earlier run" in output and "step-00000004" in output,
          "2. --overwrite says what it removes and runs", output)
    check(listing(out) == ["step-00000002"] and logged_steps(out) == [1, 2, 3],
          f"2. after --overwrite only the new run is there (checkpoints {listing(out)}, steps {logged_steps(out)})")

    # A live run holds the folder: a second one is refused, naming it.
    out = os.path.join(WORK, "concurrent")
    first = subprocess.Popen(command(out, 1, ("--steps", "400", "--checkpoint_every", "0")), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=dict(os.environ, ZERO_COMM_TIMEOUT_S="30"))
    first_lines = []
    started = threading.Event()

    def read_first():
        for line in first.stdout:
            first_lines.append(line)
            if re.match(r"\s*step\s+\d+", line) or "step 1/" in line or line.startswith("step "):
                started.set()
        started.set()

    threading.Thread(target=read_first, daemon=True).start()
    lock = os.path.join(out, ".lock")
    started.wait(timeout=120)
    holder = open(lock).read() if os.path.exists(lock) else ""
    code, output = run(out, "--steps", "2")
    alive = first.poll() is None
    holder_pid = re.search(r"pid=(\d+)", holder)
    check(alive and code != 0 and "is in use by another run" in output and f"host {socket.gethostname()}" in output
          and holder_pid is not None and f"pid {holder_pid.group(1)} on host" in output,
          "2. a second run into a folder a live run holds is refused, naming its pid and host", output)
    check(alive and os.path.exists(lock) and open(lock).read() == holder,
          "2. the refused run left the live run's lock alone")
    # Kill the live run's rank outright (our own child's child, by pid): it leaves its lock.
    for pid in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if pid.isdigit() and argv and argv[0] == TRAIN.encode() and out.encode() in argv:
            os.kill(int(pid), signal.SIGKILL)
    first.wait(timeout=60)
    check(os.path.exists(lock), "2. a killed run leaves its lock file behind")
    code, output = run(out, "--steps", "2", "--resume", "latest")
    check(code == 0 and re.search(r"\.lock was left by pid \d+ on host \S+ .*which no longer runs.*taking it over",
                                  output) is not None,
          "2. a stale lock of this host is reported and taken over", output)
    check(not os.path.exists(lock), "2. the lock is removed when the run ends")
    # A lock from another host: refused, with the command that removes it.
    out = os.path.join(WORK, "other-host")
    os.makedirs(out)
    with open(os.path.join(out, ".lock"), "w") as f:
        f.write("pid=4242\nhost=some-other-node\nsince=2025-01-01T00:00:00Z\n")
    code, output = run(out, "--steps", "2")
    check(code != 0 and "locked by pid 4242 on host some-other-node" in output
          and f"rm {os.path.join(out, '.lock')}" in output and os.path.exists(os.path.join(out, ".lock")),
          "2. a lock from another host is refused, naming the command that removes it", output)

# 3. Re-saving an existing step, killed in the middle: the old one survives.
if "3" in CASES:
    out = copy_of(base, "resave-killed")
    before = fingerprint(ckpt(out, 4))
    code, output = run(out, "--resume", ckpt(out, 2), ranks=2,
                       env={"ZERO_FAULT_KILL_DURING_WRITE": "rank-00001.safetensors:1"})
    check(code != 0 and "ZERO_FAULT_KILL_DURING_WRITE: killing" in output, "3. rank 1 was killed in its step-4 shard",
          output)
    check(fingerprint(ckpt(out, 4)) == before, "3. the old step-4 checkpoint is whole and unchanged")
    leftovers = [n for n in listing(out) if n.startswith(".")]
    check(len(leftovers) == 1 and leftovers[0].startswith(".step-00000004.tmp-")
          and "manifest.json" not in os.listdir(os.path.join(out, "checkpoints", leftovers[0])),
          f"3. the interrupted save is a hidden staging folder without a manifest ({leftovers})")
    code, output = run(out, "--resume", "latest", "--steps", "8", ranks=2)
    check(code == 0 and re.search(r"resumed from \S*step-00000004 at step 4\b", output) is not None,
          "3. --resume latest resumes from the old step-4 checkpoint", output)
    check(listing(out) == ["step-00000002", "step-00000004", "step-00000006"],
          f"3. the next save cleared the leftover ({listing(out)})")

# 4. The manifest's step against the shards'; checkpoints without CRCs.
if "4" in CASES:
    for step in (1000, 3, 2**63 - 1):
        out = copy_of(base, f"step-{step}")
        manifest_path = os.path.join(ckpt(out, 4), "manifest.json")
        edit_manifest(out, 4, step=step)
        code, output = run(out, "--resume", "latest")
        check(code != 0 and "holds step 4 (4 applied, 0 skipped)" in output
              and f"the manifest '{manifest_path}' says step {step}" in output,
              f'4. "step": {step} in the manifest is refused, naming both values and the file', output)
        check(logged_steps(out) == [1, 2, 3, 4, 5], f'4. "step": {step}: nothing was trained or logged')
    out = copy_of(base, "v1")
    manifest = json.load(open(os.path.join(ckpt(out, 4), "manifest.json")))
    v1 = {"format": "zero.sdxl.checkpoint", "version": 1, "step": 4, "world_size": manifest["world_size"], "stage": manifest["stage"],
          "files": [{"file": f["file"], "bytes": f["bytes"]} for f in manifest["files"]], "config": manifest["config"]}
    with open(os.path.join(ckpt(out, 4), "manifest.json"), "w") as f:
        json.dump(v1, f)
    code, output = run(out, "--resume", "latest")
    check(code != 0 and "lists no CRC32C for rank-00000.safetensors" in output
          and "--accept_unchecksummed_checkpoint" in output,
          "4. a version-1 manifest without CRCs is refused, naming the option", output)
    code, output = run(out, "--resume", "latest", "--accept_unchecksummed_checkpoint")
    check(code == 0 and re.search(r"resumed from \S*step-00000004 at step 4\b", output) is not None,
          "4. --accept_unchecksummed_checkpoint resumes from it", output)

# 5. Smaller surprises.
if "5" in CASES:
    out = copy_of(base, "only-incomplete")
    for step in (2, 4):
        os.remove(os.path.join(ckpt(out, step), "manifest.json"))
    code, output = run(out, "--resume", "latest")
    check(code != 0 and "holds only incomplete checkpoints (step-00000002, step-00000004" in output
          and "--overwrite" in output, "5. --resume latest with only incomplete checkpoints is refused", output)
    check(logged_steps(out) == [1, 2, 3, 4, 5], "5. ... and the earlier metrics are untouched")
    code, output = run(out, "--resume", "latest", "--overwrite", "--steps", "2")
    check(code == 0 and "--overwrite: removing" in output and "starting fresh" in output and listing(out) == [],
          "5. --overwrite removes them and starts afresh", output)

    out = copy_of(base, "damaged-newest")
    shard = os.path.join(ckpt(out, 4), "rank-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, output = run(out, "--resume", "latest")
    check(code != 0 and "rank-00000.safetensors is corrupted" in output
          and f"an older complete one is {ckpt(out, 2)} (step 2): resume from it with --resume {ckpt(out, 2)}" in output,
          "5. a damaged newest checkpoint names the older complete one to resume from", output)

    out = copy_of(base, "steps-below")
    code, output = run(out, "--resume", "latest", "--steps", "3")
    check(code != 0 and "is at step 4, beyond --steps 3" in output and "resumed from" not in output,
          "5. --steps below the checkpoint's step is refused, naming both", output)

    code, output = run(out, "--resume", "latest", "--seed", "99")
    check(code != 0 and "sampler restore" in output and "resumed from" not in output,
          "5. a resume refused after loading (another seed) never says 'resumed from'", output)

    blocker = os.path.join(WORK, "a-file")
    open(blocker, "w").close()
    code, output = run(os.path.join(blocker, "run"))
    check(code != 0 and f"output_dir '{os.path.join(blocker, 'run')}': cannot create it" in output
          and "UNet:" not in output, "5. an output_dir that cannot be created is refused before the model is built",
          output)

print(f"  total {time.time() - t0:.0f} s")
if failures:
    print("FAILED: " + "; ".join(failures))
    sys.exit(1)
print("all passed")
