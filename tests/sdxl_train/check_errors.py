#!/usr/bin/env python3
"""The trainer's and unet_forward's error messages and the inputs they accept (issue #21; stdlib only).

  check_errors.py TRAIN UNET_FORWARD MPIEXEC CONFIG UNET_JSON WEIGHTS WORKDIR [mpiexec flags...]

1. A bad option under mpirun -np 2: the message is printed once (rank 0, with
   its rank; one line naming the ranks that failed the same way), never run
   together with another line, without zero's source paths
   (train_config_validate.cpp:N) unless ZERO_DEBUG=1; bucket_mib's message
   names bucket_mib (not EngineOptions.bucket_bytes); the batch-size message
   names options a user can set (not LastBatchPolicy::pad).
2. Sizes known before anything is allocated, and offload options that do not
   combine (offload_ema_on_device alone, state_dtype bf16 with
   offload_optimizer: the engine's rules, in the trainer's words), and
   state_dtype fp16, are refused at once, naming the
   option and its limit: synthetic_samples 2e9, latent_size 65536,
   batch_size 1e6, a UNet config with layers_per_block 100000 and one whose
   parameters exceed kMaxParameters.
3. --model_config a diffusers config.json (tiny_unet.json) trains.
4. A cached dataset whose sequence length (5) differs from text_length (7):
   the trainer takes the dataset's and trains.
5. unet_forward on an empty batch: one line naming the sample's shape, no
   C++ frames.
6. A step whose activations cannot be allocated (batch_size 4096 under a
   3 GiB address-space limit, so that allocation fails instead of the OOM
   killer striking): one line naming the step, batch_size and latent_size,
   the bytes LibTorch asked for, and what to lower; no C++ frames.
"""
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import time

TRAIN, UNET_FORWARD, MPIEXEC, CONFIG, UNET_JSON, WEIGHTS, WORK = sys.argv[1:8]
MPI_FLAGS = sys.argv[8:]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402


def train(name, *overrides, ranks=2, env=None):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           "--checkpoint_every", "0", "--save_final", "false", "--export_unet", "false", *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    result.elapsed = time.time() - start
    print(f"  ran {' '.join(overrides)}{' ' + str(env) if env else ''}: exit {result.returncode} "
          f"in {result.elapsed:.1f} s", flush=True)
    return result


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def show(result):
    print("    | " + "\n    | ".join((result.stdout[-1500:] + result.stderr[-3000:]).splitlines()))


SOURCE_PATH = re.compile(r"\b[\w/]+\.(cpp|hpp|cu|h):\d+")


def check_refused(result, what, pattern, forbidden=()):
    """Non-zero exit; one stderr line holds `pattern`, printed once; no source paths, no C++ frames."""
    lines = error_lines(result)
    said = [line for line in lines if re.search(pattern, line)]
    ok = check(result.returncode != 0, f"{what}: exits non-zero ({result.returncode})")
    ok &= check(len(said) == 1, f"{what}: the message ({pattern}) is printed once, found {len(said)} times")
    ok &= check(not any(SOURCE_PATH.search(line) for line in lines), f"{what}: no source path in the message")
    ok &= check(not any("frame #" in line or "Exception raised from" in line for line in lines),
                f"{what}: no C++ frames")
    for bad in forbidden:
        ok &= check(bad not in result.stderr, f"{what}: does not say {bad!r}")
    if said:
        print("    > " + said[0])
    if not ok:
        show(result)
    return said[0] if said else ""


os.makedirs(WORK, exist_ok=True)

# 1. One message, from rank 0, with its rank; ranks that agree are named in one line.
r = train("bucket", "--bucket_mib", "1e-9")
said = check_refused(r, "bucket_mib 1e-9", r"bucket_mib", forbidden=("EngineOptions", "bucket_bytes"))
check(said.startswith("[zero rank 0] "), "bucket_mib 1e-9: printed by rank 0, naming its rank")
check(any(re.fullmatch(r"\[zero\] rank 1 failed the same way", line) for line in error_lines(r)),
      "bucket_mib 1e-9: rank 1 is named as failing the same way, in a line of its own")
r = train("bucket_debug", "--bucket_mib", "1e-9", env={"ZERO_DEBUG": "1"})
check(re.search(r"examples/sdxl/train_config_validate\.cpp:\d+: ", r.stderr) is not None,
      "ZERO_DEBUG=1: the message names the source file and line")

r = train("batch", "--batch_size", "200")
check_refused(r, "batch_size 200 of 256 samples on 2 ranks", r"lower batch_size", forbidden=("LastBatchPolicy",))

# 2. Sizes refused before anything is allocated (quickly: nothing was built).
def check_refused_early(result, what, pattern):
    check_refused(result, what, pattern)
    check(result.elapsed < 30, f"{what}: refused in {result.elapsed:.1f} s (< 30 s)")


check_refused_early(train("samples", "--synthetic_samples", "2000000000"), "synthetic_samples 2e9",
                    r"synthetic_samples .*\[1, 10000000\]")
check_refused_early(train("latent", "--latent_size", "65536"), "latent_size 65536", r"latent_size .*\[8, 1024\]")
check_refused_early(train("batch_huge", "--batch_size", "1000000"), "batch_size 1e6", r"batch_size .*\[1, 65536\]")
check_refused_early(train("ema_every", "--ema_decay", "0.99", "--ema_every", "200"), "ema_every 200 at decay 0.99",
                    r"ema_every = 200 is longer than the EMA's horizon")
check_refused_early(train("threads", "--offload_update_threads", "-1"), "offload_update_threads -1",
                    r"offload_update_threads must be in \[0, 4096\]")
# How options combine is the engine's rule, checked before anything is built,
# named by the trainer's keys.
r = train("ema_on_device", "--offload_ema_on_device", "true")
check_refused(r, "offload_ema_on_device without offload_optimizer", r"offload_ema_on_device needs offload_optimizer",
              forbidden=("EngineOptions", "[zero] [zero]"))
check(r.elapsed < 30, f"offload_ema_on_device: refused in {r.elapsed:.1f} s (< 30 s)")
check_refused_early(train("state_fp16", "--state_dtype", "fp16"), "state_dtype fp16",
                    r"state_dtype: 'fp16' is not one of fp32, bf16")
check_refused_early(train("in_flight", "--reductions_in_flight", "0"), "reductions_in_flight 0",
                    r"reductions_in_flight \(\[zero\]\) must be in \[1, 1024\]")
check_refused_early(train("prefetch", "--prefetch_units", "-1"), "prefetch_units -1",
                    r"prefetch_units \(\[zero\]\) must be in \[0, 64\]")
check_refused_early(train("host-threads", "--host_threads", "-2"), "host_threads -2",
                    r"host_threads \(\[device\]\) must be in \[0, 4096\] \(0: the host's cores / ranks on it\), got -2")
unet = json.load(open(UNET_JSON))
deep = dict(unet, layers_per_block=100000)
path_deep = os.path.join(WORK, "layers_100000.json")
json.dump(deep, open(path_deep, "w"))
check_refused_early(train("layers", "--model_config", path_deep), "layers_per_block 100000",
              r"layers_per_block' = 100000 exceeds the limit of 64 \(kMaxLayersPerBlock")
wide = dict(unet, block_out_channels=[32768, 32768], layers_per_block=64, norm_num_groups=32,
            attention_head_dim=[32, 32], transformer_layers_per_block=[64, 64])
path_wide = os.path.join(WORK, "wide.json")
json.dump(wide, open(path_wide, "w"))
check_refused_early(train("wide", "--model_config", path_wide), "a UNet of 1e12 parameters",
                    r"parameters .* exceed the limit of 20000000000 \(kMaxParameters")

# 3. A diffusers config.json as --model_config.
r = train("json_config", "--model_config", UNET_JSON, "--steps", "2", "--warmup_steps", "0", "--synthetic_samples", "64")
if not check(r.returncode == 0, "--model_config tiny_unet.json trains"):
    show(r)

# 4. A cached dataset of sequence length 5 while text_length stays 7.
def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, shape, values in tensors:
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


dataset = os.path.join(WORK, "dataset_seq5")
shutil.rmtree(dataset, ignore_errors=True)
os.makedirs(dataset)
n, seq, width, pooled = 8, 5, unet["cross_attention_dim"], 80 - 6 * 8
tensors = []
for i in range(n):
    tensors += [(f"{i}.latents", [4, 16, 16], [((i * 7 + k) % 13) / 13.0 - 0.5 for k in range(4 * 16 * 16)]),
                (f"{i}.prompt_embeds", [seq, width], [((i + k) % 5) / 5.0 for k in range(seq * width)]),
                (f"{i}.pooled_prompt_embeds", [pooled], [((i + k) % 3) / 3.0 for k in range(pooled)])]
shard = os.path.join(dataset, "shard-00000.safetensors")
write_safetensors(shard, tensors, {"format": "zero-sdxl-cached-latents"})
index = {"format": "zero-sdxl-cached-latents", "version": 1, "latent_channels": 4, "vae_scaling_factor": 0.13025,
         "text": {"sequence_length": seq, "width": width, "pooled_width": pooled}, "num_samples": n,
         "shards": [{"file": "shard-00000.safetensors", "num_samples": n, "size": os.path.getsize(shard)}],
         "samples": [{"shard": 0, "key": str(i), "latent_shape": [4, 16, 16], "original_size": [128, 128],
                      "crop_top_left": [0, 0], "target_size": [128, 128]} for i in range(n)]}
json.dump(index, open(os.path.join(dataset, "index.json"), "w"))
r = train("seq5_run", "--synthetic", "false", "--dataset", dataset, "--steps", "2", "--warmup_steps", "0",
          "--batch_size", "2")
if not check(r.returncode == 0, "a cached dataset of sequence length 5 trains with text_length 7"):
    show(r)

# 5. unet_forward on an empty batch.
inputs = os.path.join(WORK, "empty_batch.safetensors")
write_safetensors(inputs, [("sample", [0, 4, 16, 16], []), ("timestep", [0], []),
                           ("encoder_hidden_states", [0, 7, width], []), ("text_embeds", [0, pooled], []),
                           ("time_ids", [0, 6], [])], {})
r = subprocess.run([UNET_FORWARD, "--model", WEIGHTS, "--inputs", inputs, "--output", os.path.join(WORK, "out.safetensors")],
                   capture_output=True, text=True, timeout=120)
check_refused(r, "unet_forward on an empty batch", r"'sample' has shape \[0, 4, 16, 16\]")

# 6. Out of memory in a step (one process: the limit applies to it alone).
def limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


r = subprocess.run([TRAIN, "--config", CONFIG, "--output_dir", os.path.join(WORK, "oom"), "--batch_size", "4096",
                    "--synthetic_samples", "4096", "--steps", "1", "--warmup_steps", "0", "--export_unet", "false"],
                   capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space)
check_refused(r, "batch_size 4096 out of memory",
              r"step 1: forward and backward of batch_size 4096 at latent_size 16: out of memory "
              r"\(DefaultCPUAllocator: .*allocate \d+ bytes.*\); set activation_checkpointing = true, or lower "
              r"batch_size \(raising accumulation keeps the global batch\)")

if failures:
    print(f"{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("all error checks passed")
