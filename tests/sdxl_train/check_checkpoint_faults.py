#!/usr/bin/env python3
"""Checkpoints survive failures: examples/sdxl/train (tiny.toml, mpirun -np 2,
checkpoint every 2 steps) is made to fail while it saves the step-4
checkpoint, and must leave the step-2 checkpoint complete and resumable (stdlib
only; black-box: drives the trainer and reads the files it leaves).

  check_checkpoint_faults.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

a. Killed during a save (ZERO_FAULT_KILL_DURING_WRITE, see
   include/zero/io/atomic_file.hpp): rank 1 while it writes its shard, then
   rank 0 while it writes manifest.json. mpirun exits non-zero within the
   communicator timeout; there is no step-4 folder, only a hidden staging
   folder (.step-00000004.tmp-*) without manifest and without a partial file
   under a final name; --resume latest resumes from step 2, its losses equal
   an uninterrupted run's bit for bit, and its step-4 save clears the leftover. Rank 1 stopped (SIGSTOP,
   ZERO_FAULT_STOP_DURING_WRITE) in its shard: rank 0's wait in the save ends
   by the communicator timeout and every rank exits.
b. Read-only target: the checkpoints folder is a tmpfs remounted read-only
   after the step-2 save; the step-4 save fails naming the path and the cause,
   every rank exits non-zero within the timeout; step 2 resumes after remounting
   read-write. Without mount rights: a folder without write permission (and,
   as root, without CAP_DAC_OVERRIDE through setpriv).
c. Full disk: the checkpoints folder is a tmpfs that holds one checkpoint and a
   half; the step-4 save fails with "No space left on device" naming the file,
   every rank exits non-zero within the timeout, a rank that failed cleanly
   leaves no temporary file, step 2 resumes once the tmpfs is enlarged.
   Without mount rights: a file-size rlimit set in each rank (EFBIG, SIGXFSZ ignored).
d. Non-finite gradients (ZERO_FAULT_NAN_GRAD_STEPS, a NaN in one gradient
   element on rank 1): 2 poisoned steps in a row with max_nonfinite_steps = 3
   are skipped, counted in metrics.jsonl, logged, and the run finishes with
   finite losses and the same weights as before the skips; 3 in a row stop the
   run with a message naming the limit, every rank gone, non-zero exit. The
   checkpoint after the skipped steps resumes (its manifest's step counts
   them, its shards count them apart).

Exit 77 (skipped) only if neither mounting nor the fallbacks can make b and c
fail; every case that can run still does first. ZERO_TEST_NO_MOUNT=1 forces
the fallbacks; ZERO_TEST_CASES=ad runs only some cases (debugging).
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
TIMEOUT_S = 10          # ZERO_COMM_TIMEOUT_S for every run
EXIT_LIMIT_S = TIMEOUT_S + 5  # failure seen -> mpirun gone; the timeout plus teardown
STEPS = 6
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402
skipped = []


# ------------------------------------------------------------------ running the trainer

class Run:
    """One mpirun: exit code, output lines with the time each arrived, and how
    long mpirun took to exit after the first line matching `failure`."""

    def __init__(self, out, *overrides, env=None, failure=None, wrapper=(), rank_wrapper=()):
        cmd = [*wrapper, MPIEXEC, "-np", "2", *MPI_FLAGS, *rank_wrapper, TRAIN, "--config", CONFIG, "--output_dir", out,
               "--steps", str(STEPS), "--synthetic_samples", "64", "--log_every", "1", "--checkpoint_every", "2",
               "--keep_checkpoints", "5", "--save_final", "false", "--export_unet", "false", *overrides]
        full_env = dict(os.environ, ZERO_COMM_TIMEOUT_S=str(TIMEOUT_S), **(env or {}))
        self.lines = []  # (seconds since start, text)
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)

        def read():
            for line in proc.stdout:
                self.lines.append((time.time() - start, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            self.code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its handle
            self.code = None
            proc.wait()
        self.elapsed = time.time() - start
        reader.join(timeout=10)
        self.output = "\n".join(text for _, text in self.lines)
        self.exit_after_failure = None
        if failure is not None:
            seen = [t for t, text in self.lines if re.search(failure, text)]
            if seen:
                self.exit_after_failure = self.elapsed - seen[0]
        shown = " ".join(overrides) + "".join(f" [{k}={v}]" for k, v in (env or {}).items())
        after = f", {self.exit_after_failure:.1f} s after the failure" if self.exit_after_failure is not None else ""
        print(f"  ran {shown or 'with no overrides'}: exit {self.code} in {self.elapsed:.1f} s{after}", flush=True)

    def show(self):
        print("\n".join("    | " + text for _, text in self.lines[-40:]))


def ranks_alive(out):
    """Processes whose command line names this run's output folder."""
    alive = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if out.encode() in f.read():
                    alive.append(int(pid))
        except OSError:
            pass
    return alive


def check_failed_run(run, out, what, cause, says="names the file and the cause"):
    """Non-zero exit soon after the failure, the cause printed, no rank left."""
    ok = check(run.code not in (None, 0), f"{what}: mpirun exits non-zero (exit {run.code})")
    ok &= check(run.exit_after_failure is not None and run.exit_after_failure <= EXIT_LIMIT_S,
                f"{what}: every rank is gone within {EXIT_LIMIT_S} s of the failure "
                f"({run.exit_after_failure if run.exit_after_failure is None else round(run.exit_after_failure, 1)} s)")
    said = next((text for _, text in run.lines if re.search(cause, text)), None)
    ok &= check(said is not None, f"{what}: the message {says}")
    if said:
        print("    > " + said.strip())
    time.sleep(0.5)
    ok &= check(not ranks_alive(out), f"{what}: no rank process is left")
    if not ok:
        run.show()


def losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {row["step"]: row["loss"] for row in rows}, rows


# ------------------------------------------------------------------ checkpoint files

def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step-{step:08d}")


def safetensors_complete(path):
    """The header parses and the file is exactly as long as it says."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size:
                return False
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, struct.error):
        return False


def tensors(path):
    """Raw bytes of every tensor in a safetensors file (metadata left out)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items() if k != "__metadata__"}


def checkpoint_complete(out, step):
    """Manifest present and valid, every listed shard complete with the listed size."""
    d = ckpt(out, step)
    try:
        manifest = json.load(open(os.path.join(d, "manifest.json")))
    except (OSError, ValueError):
        return False
    files = manifest.get("files", [])
    return manifest.get("step") == step and len(files) == 2 and all(
        safetensors_complete(os.path.join(d, f["file"])) and os.path.getsize(os.path.join(d, f["file"])) == f["bytes"]
        for f in files)


def fingerprint(out, step):
    d = ckpt(out, step)
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


def staging_folder(out, step):
    """The hidden folder an interrupted save of `step` left (.step-<step>.tmp-<nonce>), or None."""
    root = os.path.join(out, "checkpoints")
    found = [n for n in os.listdir(root) if n.startswith(f".step-{step:08d}.tmp-")] if os.path.isdir(root) else []
    return os.path.join(root, found[0]) if len(found) == 1 else None


def check_interrupted_folder(out, step, what):
    """The save went to a hidden staging folder: no step-<step> folder; in the staging
    folder no manifest, every file under a final name complete, hidden ones temporaries."""
    check(not os.path.exists(ckpt(out, step)), f"{what}: no step-{step} folder (the save never got that far)")
    d = staging_folder(out, step)
    if not check(d is not None, f"{what}: the interrupted save left one hidden staging folder for step {step}"):
        return []
    names = sorted(os.listdir(d))
    check("manifest.json" not in names, f"{what}: the staging folder has no manifest.json ({', '.join(names) or 'empty'})")
    visible = [n for n in names if not n.startswith(".")]
    check(all(n.endswith(".safetensors") and safetensors_complete(os.path.join(d, n)) for n in visible),
          f"{what}: every file under a final name in the staging folder is complete ({', '.join(visible) or 'none'})")
    return [n for n in names if n.startswith(".")]


def check_resume(out, reference, what, expect_from=2):
    run = Run(out, "--resume", "latest")
    if not check(run.code == 0, f"{what}: --resume latest finishes"):
        run.show()
        return
    check(re.search(rf"resumed from \S*step-{expect_from:08d} at step {expect_from}\b", run.output) is not None,
          f"{what}: resumed from the step-{expect_from} checkpoint")
    got, _ = losses(out)
    check(sorted(got) == list(range(1, STEPS + 1)), f"{what}: every step logged once after resuming")
    check(staging_folder(out, 4) is None and os.path.isdir(ckpt(out, 4)),
          f"{what}: the resumed run's step-4 save cleared what the interrupted one left")
    check(all(got.get(s) == reference[s] for s in range(expect_from + 1, STEPS + 1)),
          f"{what}: losses of steps {expect_from + 1}-{STEPS} equal the uninterrupted run's bit for bit")


# ------------------------------------------------------------------ mounts

def can_mount():
    if os.environ.get("ZERO_TEST_NO_MOUNT"):  # to exercise the fallbacks
        return False
    probe = tempfile.mkdtemp(dir=WORK)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", probe], check=True)
        return ok
    except OSError:
        return False
    finally:
        os.rmdir(probe)


class Tmpfs:
    """A tmpfs at `where`, unmounted on exit whatever happened."""

    def __init__(self, where, size):
        self.where, self.size = where, size

    def __enter__(self):
        os.makedirs(self.where, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0755", "tmpfs", self.where], check=True)
        return self

    def remount(self, options):
        subprocess.run(["mount", "-o", f"remount,{options}", self.where], check=True)

    def __exit__(self, *exc):
        subprocess.run(["umount", self.where])


def fresh(name):
    out = os.path.join(WORK, name)
    ck = os.path.join(out, "checkpoints")
    if os.path.ismount(ck):
        subprocess.run(["umount", ck])
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


# ------------------------------------------------------------------ the cases

os.makedirs(WORK, exist_ok=True)
t0 = time.time()

# The uninterrupted run every resumed one is compared with.
base = fresh("baseline")
run = Run(base)
if run.code != 0:
    run.show()
    raise SystemExit(f"the uninterrupted run failed ({run.code})")
reference, _ = losses(base)
check(checkpoint_complete(base, 2) and checkpoint_complete(base, 4), "baseline: checkpoints of steps 2 and 4 complete")
checkpoint_bytes = sum(os.path.getsize(os.path.join(ckpt(base, 2), n)) for n in os.listdir(ckpt(base, 2)))
shard_bytes = os.path.getsize(os.path.join(ckpt(base, 2), "rank-00001.safetensors"))
print(f"  one checkpoint: {checkpoint_bytes} bytes ({shard_bytes} per shard)")

CASES = os.environ.get("ZERO_TEST_CASES", "abcd")

# a. Killed while writing rank 1's shard of step 4, then rank 0's manifest.
# A process writes its file of every save under the same name, into another
# staging folder each time: ":2" is its second write, the step-4 save.
for what, target, victim_file in (("kill rank 1 in its shard", "rank-00001.safetensors:2", "rank-00001.safetensors"),
                                  ("kill rank 0 in the manifest", "manifest.json:2", "manifest.json")):
    if "a" not in CASES:
        break
    out = fresh("killed-" + victim_file.split(".")[0])
    run = Run(out, env={"ZERO_FAULT_KILL_DURING_WRITE": target}, failure="ZERO_FAULT_KILL_DURING_WRITE: killing")
    check_failed_run(run, out, what, r"ZERO_FAULT_KILL_DURING_WRITE: killing process \d+ while writing",
                     says="shows the injected kill")
    check(checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is complete")
    hidden = check_interrupted_folder(out, 4, what)
    staging = staging_folder(out, 4) or ckpt(out, 4)
    check(not os.path.exists(os.path.join(staging, victim_file)), f"{what}: no {victim_file} under its final name")
    partial = [n for n in hidden if n.startswith("." + victim_file + ".tmp.")]
    check(len(partial) == 1 and (victim_file == "manifest.json" or not safetensors_complete(os.path.join(staging, partial[0]))),
          f"{what}: the killed write left a partial temporary file ({', '.join(partial) or 'none'})")
    if victim_file == "manifest.json":
        check(all(safetensors_complete(os.path.join(staging, f"rank-{r:05d}.safetensors")) for r in (0, 1)),
              f"{what}: both shards of step 4 were complete (only the manifest was missing)")
    check_resume(out, reference, what)

# a'. Rank 1 hangs (SIGSTOP) while writing its shard: rank 0 waits for it in the
# save's checksum gather, and only the communicator timeout can end the run.
if "a" in CASES:
    what = "rank 1 hangs in its shard"
    out = fresh("hung-rank-00001")
    run = Run(out, env={"ZERO_FAULT_STOP_DURING_WRITE": "rank-00001.safetensors:2"},
              failure="ZERO_FAULT_STOP_DURING_WRITE: stopping")
    check_failed_run(run, out, what, r"did not complete within", says="is the communicator timeout's")
    check(run.exit_after_failure is not None and run.exit_after_failure >= TIMEOUT_S - 1,
          f"{what}: the run ended by the {TIMEOUT_S} s timeout, not before")
    check(checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is complete")
    check_interrupted_folder(out, 4, what)

# b. Read-only checkpoints folder.
mount_ok = can_mount()
print(f"  mount -t tmpfs: {'permitted' if mount_ok else 'not permitted, using the fallbacks'}")
what = "read-only"
out = fresh("read-only")
ck = os.path.join(out, "checkpoints")
ro_cause = r"(?=.*step-00000004)(?=.*(Read-only file system|Permission denied))"


def run_read_only_case(make_read_only, make_writable, wrapper=()):
    run = Run(out, "--stop_after", "2")
    if not check(run.code == 0 and checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is saved"):
        run.show()
        return
    before = fingerprint(out, 2)
    make_read_only()
    run = Run(out, "--resume", "latest", failure=r"Read-only file system|Permission denied", wrapper=wrapper)
    check_failed_run(run, out, what, ro_cause)
    check(fingerprint(out, 2) == before, f"{what}: the step-2 checkpoint is unchanged")
    make_writable()
    check_resume(out, reference, what)


if "b" not in CASES:
    pass
elif mount_ok:
    with Tmpfs(ck, "64m") as fs:
        run_read_only_case(lambda: fs.remount("ro"), lambda: fs.remount("rw"))
else:
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is None:
        print("  read-only: cannot mount, and no setpriv to drop CAP_DAC_OVERRIDE as root")
        skipped.append("read-only")
    else:
        wrapper = (setpriv, "--bounding-set=-dac_override,-dac_read_search") if os.geteuid() == 0 else ()
        os.makedirs(ck, exist_ok=True)
        try:
            run_read_only_case(lambda: os.chmod(ck, 0o555), lambda: os.chmod(ck, 0o755), wrapper)
        finally:
            os.chmod(ck, 0o755)

# c. Full disk: room for one checkpoint and a half, so the second cannot fit.
what = "full disk"
out = fresh("full-disk")
ck = os.path.join(out, "checkpoints")


def check_clean_failures(run):
    """Every rank that reported its write error removed its temporary file."""
    temps = re.findall(r"temporary file '([^']+)'", run.output)
    check(temps and all(not os.path.exists(t) for t in temps),
          f"{what}: the {len(temps)} rank(s) that failed cleanly left no temporary file")


if "c" not in CASES:
    pass
elif mount_ok:
    size = (checkpoint_bytes * 3 // 2 // 4096 + 4) * 4096
    with Tmpfs(ck, str(size)) as fs:
        run = Run(out, failure="No space left on device")
        check_failed_run(run, out, what, r"cannot write '\S*step-00000004\.tmp-\S*/rank-0000\d\.safetensors' .*No space left on device")
        check(checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is complete")
        check_interrupted_folder(out, 4, what)
        check_clean_failures(run)
        fs.remount(f"size={4 * checkpoint_bytes}")  # room for the step-4 save on top of what is left
        check_resume(out, reference, what)
else:
    # A file-size limit below one shard: the step-2 save runs without it.
    run = Run(out, "--stop_after", "2")
    if check(run.code == 0 and checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is saved"):
        # Each rank sets the limit and ignores SIGXFSZ itself, then execs the
        # trainer: mpirun's launcher resets signal dispositions of what it starts,
        # so neither prlimit nor an ignored SIGXFSZ around mpirun reaches the ranks.
        limit = shard_bytes // 2
        rank_wrapper = (sys.executable, "-c",
                        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); os.execv(sys.argv[1], sys.argv[1:])")
        run = Run(out, "--resume", "latest", failure="File too large", rank_wrapper=rank_wrapper)
        if run.code != 0 and "File too large" not in run.output:
            print("  full disk: the file-size limit did not give EFBIG in the ranks (SIGXFSZ not ignored there?)")
            run.show()
            skipped.append("full disk")
        else:
            check_failed_run(run, out, what, r"cannot write '\S*step-00000004\.tmp-\S*/rank-0000\d\.safetensors' .*File too large")
            check(checkpoint_complete(out, 2), f"{what}: the step-2 checkpoint is complete")
            check_clean_failures(run)
            check_resume(out, reference, what)
    else:
        run.show()

# d. Non-finite gradients.
def nonfinite_case():
    what = "NaN gradients"
    out = fresh("nan-skipped")
    run = Run(out, "--max_nonfinite_steps", "3", env={"ZERO_FAULT_NAN_GRAD_STEPS": "3-4@1"})
    if check(run.code == 0, f"{what}: 2 poisoned steps in a row (limit 3): the run finishes"):
        got, rows = losses(out)
        skipped_by_step = {row["step"]: row.get("skipped_steps") for row in rows}
        check([skipped_by_step[s] for s in range(1, STEPS + 1)] == [0, 0, 1, 2, 2, 2],
              f"{what}: metrics.jsonl counts the skipped steps ({[skipped_by_step[s] for s in range(1, STEPS + 1)]})")
        check(all(re.search(rf"step {s}: non-finite gradients, step skipped", run.output) for s in (3, 4)),
              f"{what}: the log says steps 3 and 4 were skipped")
        check(all(isinstance(got[s], float) and abs(got[s]) < 1e30 for s in range(1, STEPS + 1)),
              f"{what}: every loss is finite")
        check(all(got[s] == reference[s] for s in (1, 2, 3)), f"{what}: losses up to the first skipped step equal the baseline")
        check(got[5] != reference[5], f"{what}: the skipped updates changed the later trajectory (it did skip)")
        # Steps 3 and 4 skipped: the step-4 checkpoint holds the step-2 state bit for bit
        # (master weights, optimizer moments, EMA) on both ranks.
        same = [tensors(os.path.join(ckpt(out, 4), f)) == tensors(os.path.join(ckpt(out, 2), f))
                for f in ("rank-00000.safetensors", "rank-00001.safetensors")]
        check(all(same), f"{what}: master weights, optimizer state and EMA after the skipped steps are bitwise those before")
        # The manifest counts the skipped steps (step 4), the shards count them
        # apart (2 applied + 2 skipped): the resume's cross-check accepts it.
        run = Run(out, "--resume", "latest", "--max_nonfinite_steps", "3")
        check(run.code == 0 and re.search(r"resumed from \S*step-00000004 at step 4\b", run.output) is not None,
              f"{what}: the step-4 checkpoint (2 steps applied, 2 skipped) resumes at step 4")
    else:
        run.show()
    out = fresh("nan-stopped")
    run = Run(out, "--max_nonfinite_steps", "3", env={"ZERO_FAULT_NAN_GRAD_STEPS": "3-5@1"},
              failure="steps in a row had non-finite gradients")
    check_failed_run(run, out, what + " x3",
                     r"training stopped at step 5: .*3 steps in a row had non-finite gradients \(limit 3\).*max_nonfinite_steps = 3",
                     says="names the limit and the option")
    got, _ = losses(out)
    check(max(got) == 4, f"{what} x3: the run stopped at step 5 (last step logged: {max(got)})")


if "d" in CASES:
    nonfinite_case()

print(f"  total {time.time() - t0:.0f} s")
if failures:
    print("FAILED: " + "; ".join(failures))
    sys.exit(1)
if skipped:
    print("SKIPPED (no way to make the file system fail here): " + ", ".join(skipped))
    sys.exit(77)
print("all passed")
