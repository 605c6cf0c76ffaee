#!/usr/bin/env python3
"""Stopping examples/sdxl/train with a signal (tiny.toml, mpirun -np 2, no
periodic checkpoints): what a scheduler's time limit or warning, Ctrl-C or a
`kill` of one rank does (stdlib only; black-box: signals mpirun or a rank as a
user would, reads the output and the files left).

  check_signals.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

a. SIGUSR1 to mpirun (Slurm: #SBATCH --signal=B:USR1@120 with the batch
   script passing it on; Open MPI forwards SIGUSR1 to every rank): every rank
   finishes its step, the checkpoint of that step is complete, rank 0 says so,
   mpirun exits 75. --resume latest then resumes from that step.
b. SIGTERM to mpirun (a time limit, `kill`; Ctrl-C's SIGINT is handled the
   same by mpirun): Open MPI 4.1 sends the ranks SIGCONT, then SIGTERM
   odls_base_sigkill_timeout seconds later, then SIGKILL as long again after
   that (default 1 s). With --mca odls_base_sigkill_timeout 3 the ranks
   checkpoint and say so; mpirun itself exits 1 (it reports its own abort,
   not the ranks' 75).
c. SIGTERM to one rank only, twice (Slurm signals every task; a request can
   arrive more than once): all ranks stop after the same step with a complete
   checkpoint; exit 75.
d. SIGUSR1 then SIGTERM to one rank (a second request): that rank stops at
   once and says so, no checkpoint is written, every rank is gone, mpirun
   exits non-zero and not 75.

ZERO_TEST_CASES=ad runs only some cases (debugging).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
TIMEOUT_S = 10          # ZERO_COMM_TIMEOUT_S for every run
STOP_LIMIT_S = 15       # signal -> mpirun gone
GRACE_S = 3             # b: mpirun's odls_base_sigkill_timeout
EXIT_STOPPED = 75       # kExitStoppedBySignal (examples/sdxl/stop_signals.hpp)
CASES = os.environ.get("ZERO_TEST_CASES", "abcd")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402


class Run:
    """One mpirun in the background: its output lines, and the last step it logged."""

    def __init__(self, out, *overrides, mpi_flags=(), steps=1000):
        cmd = [MPIEXEC, "-np", "2", *MPI_FLAGS, *mpi_flags, TRAIN, "--config", CONFIG, "--output_dir", out,
               "--steps", str(steps), "--synthetic_samples", "64", "--log_every", "1", "--checkpoint_every", "0",
               "--save_final", "false", "--export_unet", "false", *overrides]
        self.out = out
        self.lines = []
        self.stepped = threading.Event()
        self.start = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, ZERO_COMM_TIMEOUT_S=str(TIMEOUT_S)))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if re.match(r"step \d+/", line):
                self.stepped.set()

    def last_step(self):
        steps = [int(m.group(1)) for m in (re.match(r"step (\d+)/", line) for line in self.lines) if m]
        return steps[-1] if steps else 0

    def wait_for_steps(self):
        deadline = time.time() + 120
        while not self.stepped.wait(timeout=0.1) and self.proc.poll() is None and time.time() < deadline:
            pass
        return check(self.stepped.is_set(), "the run trains (a step is logged)")

    def rank_pid(self, rank):
        """The pid of the rank process with OMPI_COMM_WORLD_RANK=rank, a child of our mpirun."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"OMPI_COMM_WORLD_RANK={rank}".encode() in f.read().split(b"\0"):
                        return int(pid)
            except (OSError, IndexError, ValueError):
                pass
        return None

    def finish(self):
        try:
            self.code = self.proc.wait(timeout=STOP_LIMIT_S + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.code = None
            self.proc.wait()
        self.reader.join(timeout=10)
        self.ended = time.time()
        self.output = "\n".join(self.lines)
        return self

    def said(self, pattern):
        return next((line for line in self.lines if re.search(pattern, line)), None)

    def show(self):
        print("\n".join("    | " + line for line in self.lines[-30:]))


def ranks_alive(out):
    """Processes whose command line names this run's output folder."""
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if out.encode() in f.read():
                        alive.append(int(pid))
            except OSError:
                pass
    return alive


def complete_checkpoints(out):
    """Steps whose checkpoint folder has a manifest naming 2 rank files that exist."""
    steps = []
    folder = os.path.join(out, "checkpoints")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            manifest = json.load(open(os.path.join(folder, name, "manifest.json")))
        except (OSError, ValueError):
            continue
        files = manifest.get("files", [])
        if len(files) == 2 and all(os.path.isfile(os.path.join(folder, name, f["file"])) for f in files):
            steps.append(manifest.get("step"))
    return steps


def fresh(name):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    return out


def check_stopped(run, what, signal_name, signaled_at_step, expect_code=EXIT_STOPPED, slack=3):
    """The run stopped after a step at or after the signal, with that step's checkpoint, and said so."""
    ok = check(run.code == expect_code, f"{what}: mpirun exits {expect_code} (exit {run.code})")
    said = run.said(rf"stopped after step (\d+) on {signal_name}: checkpoint written")
    ok &= check(said is not None, f"{what}: rank 0 says it stopped on {signal_name} with a checkpoint")
    stopped = int(re.search(r"step (\d+)", said).group(1)) if said else None
    if said:
        print("    > " + said.strip())
    ok &= check(stopped is not None and signaled_at_step <= stopped <= signaled_at_step + slack,
                f"{what}: it stops after the step the signal came in (signaled after step {signaled_at_step} "
                f"as logged, stopped after {stopped})")
    ok &= check(complete_checkpoints(run.out) == [stopped],
                f"{what}: the checkpoint of step {stopped} is complete (complete: {complete_checkpoints(run.out)})")
    ok &= check(run.last_step() == stopped, f"{what}: no step after it is logged (last logged {run.last_step()})")
    time.sleep(0.5)
    ok &= check(not ranks_alive(run.out), f"{what}: no rank process is left")
    if not ok:
        run.show()
    return stopped


def case_a():
    out = fresh("usr1_to_mpirun")
    run = Run(out)
    if not run.wait_for_steps():
        return run.finish().show()
    at = run.last_step()
    run.proc.send_signal(signal.SIGUSR1)
    run.finish()
    print(f"  SIGUSR1 to mpirun after step {at}: exit {run.code}, {run.ended - run.start:.1f} s in all")
    stopped = check_stopped(run, "a. SIGUSR1 to mpirun", "SIGUSR1", at)
    if stopped is None:
        return
    resumed = Run(out, "--resume", "latest", "--stop_after", str(stopped + 1)).finish()
    ok = check(resumed.code == 0, f"a. --resume latest trains on (exit {resumed.code})")
    ok &= check(resumed.said(rf"resumed from .*step-0*{stopped} at step {stopped}") is not None,
                f"a. it resumes from the step-{stopped} checkpoint")
    if not ok:
        resumed.show()


def case_b():
    out = fresh("term_to_mpirun")
    run = Run(out, mpi_flags=("--mca", "odls_base_sigkill_timeout", str(GRACE_S)))
    if not run.wait_for_steps():
        return run.finish().show()
    at = run.last_step()
    run.proc.send_signal(signal.SIGTERM)
    signaled = time.time()
    run.finish()
    print(f"  SIGTERM to mpirun after step {at}: exit {run.code}, {run.ended - signaled:.1f} s after it")
    # The ranks get SIGTERM only GRACE_S seconds after mpirun did (SIGCONT
    # first), so they train on meanwhile: no bound on the step they stop at.
    check_stopped(run, f"b. SIGTERM to mpirun (odls_base_sigkill_timeout {GRACE_S})", "SIGTERM", at,
                  expect_code=1, slack=10**9)


def case_c():
    out = fresh("term_to_one_rank")
    run = Run(out)
    if not run.wait_for_steps():
        return run.finish().show()
    pid = run.rank_pid(1)
    if not check(pid is not None, "c. rank 1's process is found"):
        return run.finish().show()
    at = run.last_step()
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGTERM)  # the same request again: ignored
    except ProcessLookupError:
        print("  (rank 1 had already exited before the repeated SIGTERM)")
    run.finish()
    print(f"  SIGTERM twice to rank 1 after step {at}: exit {run.code}")
    check_stopped(run, "c. SIGTERM (twice) to rank 1", "SIGTERM", at)


def case_d():
    out = fresh("second_signal")
    run = Run(out)
    if not run.wait_for_steps():
        return run.finish().show()
    pid = run.rank_pid(1)
    if not check(pid is not None, "d. rank 1's process is found"):
        return run.finish().show()
    os.kill(pid, signal.SIGUSR1)
    os.kill(pid, signal.SIGTERM)
    signaled = time.time()
    run.finish()
    print(f"  SIGUSR1 then SIGTERM to rank 1: exit {run.code}, {run.ended - signaled:.1f} s after")
    ok = check(run.code not in (None, 0, EXIT_STOPPED), f"d. mpirun exits non-zero, not {EXIT_STOPPED} (exit {run.code})")
    said = run.said(r"\[rank 1\] SIG\w+ after SIG\w+: stopping at once, without a checkpoint")
    ok &= check(said is not None, "d. rank 1 says it stops at once, without a checkpoint")
    if said:
        print("    > " + said.strip())
    ok &= check(run.ended - signaled <= STOP_LIMIT_S, f"d. every rank is gone within {STOP_LIMIT_S} s")
    ok &= check(complete_checkpoints(out) == [], "d. no checkpoint is written")
    time.sleep(0.5)
    ok &= check(not ranks_alive(out), "d. no rank process is left")
    if not ok:
        run.show()


def main():
    os.makedirs(WORK, exist_ok=True)
    for letter, case in zip("abcd", (case_a, case_b, case_c, case_d)):
        if letter in CASES:
            started = time.time()
            case()
            print(f"  ({letter}: {time.time() - started:.1f} s)", flush=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
