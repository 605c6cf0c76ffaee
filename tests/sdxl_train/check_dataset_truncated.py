#!/usr/bin/env python3
"""A cached dataset's shards truncated while examples/sdxl/train reads them
(tiny.toml, mpirun -np 2, --synthetic false): every rank exits non-zero within
seconds with a message naming the shard file, the sample and both sizes;
none dies of SIGBUS (shards were memory-mapped: exit 135, no message) and none
is left running (stdlib only; black-box).

  check_dataset_truncated.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

The dataset (tiny model dims: 16x16 latents, text 7x64, pooled 32; 4 shards
of 16 samples) is written with the stdlib writer cached_dataset_writer.py. Once
the run has logged a step, every shard is cut to 20000 bytes (as
`truncate -s 20000 DS/shard-*.safetensors` would).
"""
import os
import re
import shutil
import subprocess
import sys
import threading
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
TIMEOUT_S = 10       # ZERO_COMM_TIMEOUT_S: a rank waiting on a failed one gives up after this
EXIT_LIMIT_S = 20    # truncation -> mpirun gone (the loader runs two batches ahead; then the timeout)
TRUNCATED_SIZE = 20000
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures, load_dataset_writer, pattern_values  # noqa: E402


def half_values(count, seed):  # fp16 values in [-1, 1), a different pattern per sample
    return pattern_values(count, seed, "<e")


def write_dataset(directory):
    """64 samples of the tiny model's dims, fp16, 16 per shard: shards of ~49 KB."""
    prepare = load_dataset_writer()
    text = {"sequence_length": 7, "width": 64, "pooled_width": 32}
    writer = prepare.DatasetWriter(directory=prepare.Path(directory), text_dims=text, samples_per_shard=16,
                                   vae_scaling_factor=prepare.SDXL_VAE_SCALING_FACTOR)

    for i in range(64):
        writer.add(("F16", (4, 16, 16), half_values(4 * 16 * 16, i)), ("F16", (7, 64), half_values(7 * 64, i + 100)),
                   ("F16", (32,), half_values(32, i + 200)), (128, 128), (0, 0), (128, 128), f"sample {i}")
    writer.finish()
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.startswith("shard-"))


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


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    dataset = os.path.join(WORK, "dataset")
    out = os.path.join(WORK, "run")
    shards = write_dataset(dataset)
    check(len(shards) == 4 and all(os.path.getsize(s) > TRUNCATED_SIZE for s in shards),
          f"dataset written: {len(shards)} shards of {[os.path.getsize(s) for s in shards]} bytes")

    cmd = [MPIEXEC, "-np", "2", *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out, "--synthetic", "false",
           "--dataset", dataset, "--steps", "300", "--log_every", "1", "--checkpoint_every", "0",
           "--save_final", "false", "--export_unet", "false"]
    env = dict(os.environ, ZERO_COMM_TIMEOUT_S=str(TIMEOUT_S))
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    stepped = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if re.match(r"\s*step\s+\d+", line):
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    truncated_at = None
    deadline = time.time() + 120
    while not stepped.wait(timeout=0.1) and proc.poll() is None and time.time() < deadline:
        pass
    if check(stepped.is_set(), "the run trains on the cached dataset (a step is logged)"):
        for shard in shards:
            os.truncate(shard, TRUNCATED_SIZE)
        truncated_at = time.time()
        print(f"  truncated every shard to {TRUNCATED_SIZE} bytes {truncated_at - start:.1f} s after the start")
    try:
        code = proc.wait(timeout=EXIT_LIMIT_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()  # our own child, by its handle
        code = None
        proc.wait()
    reader.join(timeout=10)
    ended = time.time()
    output = "\n".join(lines)
    print(f"  mpirun exit {code}, {ended - (truncated_at or start):.1f} s after the truncation")

    check(code not in (None, 0), f"mpirun exits non-zero (exit {code})")
    check(code not in (135, -7) and "Bus error" not in output and "SIGBUS" not in output,
          "no rank dies of SIGBUS")
    check(truncated_at is not None and ended - truncated_at <= EXIT_LIMIT_S,
          f"every rank is gone within {EXIT_LIMIT_S} s of the truncation")
    said = next((line for line in lines if re.search(r"shard-\d{5}\.safetensors", line)), None)
    check(said is not None, "the message names the shard file")
    if said:
        print("    > " + said.strip())
        check("truncated or rewritten while training" in said and re.search(r"sample \d+", said) is not None,
              "the message says the shard was truncated or rewritten while training, and which sample")
        check(f"is now {TRUNCATED_SIZE} bytes" in said and re.search(r"index\.json records \d+", said) is not None,
              "the message gives the shard's size now and the size index.json records")
    time.sleep(0.5)
    check(not ranks_alive(out), "no rank process is left")
    if failures:
        print("\n".join("    | " + line for line in lines[-40:]))
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
