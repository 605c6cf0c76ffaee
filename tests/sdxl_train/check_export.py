#!/usr/bin/env python3
"""The trainer's exports on CPU ranks (stdlib only).

  check_export.py TRAIN MPIEXEC CONFIG WORKDIR [mpiexec flags...]

A base single file in the original SDXL layout is built here: the tiny
fixture UNet (tests/fixtures/sdxl/tiny_a_weights.safetensors) under
"model.diffusion_model." names in fp16, as sd_xl_base_1.0 stores it, plus
VAE and text-encoder stand-ins in fp16, fp32, bf16 and int64, and metadata.
The original names come from this file's own mapping, written from the
original layout's conventions, so that the trainer's mapping is checked
against an independent one.

1. tiny.toml at N=2 for 3 steps from the fixture's weights with
   export_full_checkpoint = the base (fp32, EMA on): the base is checked
   before training; full_checkpoint.safetensors holds every key of the base
   with its metadata, the UNet tensors equal to the exported EMA UNet
   (auto picks the EMA) after the name mapping, every other tensor
   byte-identical to the base; every export's size and CRC32C is printed and
   matches the file.
2. The final checkpoint exported again (--resume, no step) in fp16 with
   export_full_checkpoint_unet = trained, and in bf16: every exported tensor
   equals the fp32 export rounded to nearest even; the full checkpoint holds
   the UNet asked for in that dtype, the rest byte-identical.
3. fp16 cannot hold a weight of 70000: the export is refused naming the
   tensor and its max |value|, nothing is exported, the checkpoint is kept.
4. Before any step: a missing base, a file that is not safetensors, a base
   missing a UNet tensor or with another shape, a UNet-only file, and
   export_full_checkpoint_unet = ema without EMA are refused, naming them.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import time

TRAIN, MPIEXEC, CONFIG, WORK = sys.argv[1:5]
MPI_FLAGS = sys.argv[5:]
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "sdxl",
                       "tiny_a_weights.safetensors")
STEPS = 3
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from e2e_harness import check, failures  # noqa: E402


# ---------------------------------------------------------------- safetensors

def read_st(path):
    """(metadata, {name: (dtype, shape, bytes)}, names in file order)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    meta = header.pop("__metadata__", {})
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return meta, {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
                  for k, v in header.items()}, order


def write_st(path, tensors, meta=None):
    """tensors: list of (name, dtype, shape, bytes), written in that order."""
    header, offset = {}, 0
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def floats(data):
    return struct.unpack(f"<{len(data) // 4}f", data)


def to_f16(data):
    return struct.pack(f"<{len(data) // 4}e", *floats(data))  # round to nearest even


def to_bf16(data):
    words = struct.unpack(f"<{len(data) // 4}I", data)
    return struct.pack(f"<{len(words)}H", *(((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF for w in words))


def crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    table = CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- the original layout's names

RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
          "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def original_name(name, layers, up_with_attention):
    """Diffusers name -> original single-file name, for levels of `layers` resnets each."""
    p = name.split(".")
    rest = lambda i: ".".join(p[i:])
    per_level = layers + 1
    if p[0] == "conv_in":
        o = "input_blocks.0.0." + rest(1)
    elif p[0] in ("time_embedding", "add_embedding"):
        o = ("time_embed." if p[0] == "time_embedding" else "label_emb.0.") + \
            ("0." if p[1] == "linear_1" else "2.") + rest(2)
    elif p[0] == "conv_norm_out":
        o = "out.0." + rest(1)
    elif p[0] == "conv_out":
        o = "out.2." + rest(1)
    elif p[0] == "mid_block":
        k = int(p[2])
        o = (f"middle_block.{2 * k}." + RESNET[p[3]] + "." + rest(4)) if p[1] == "resnets" else \
            f"middle_block.{2 * k + 1}." + rest(3)
    else:
        level, kind = int(p[1]), p[2]
        down = p[0] == "down_blocks"
        blocks = "input_blocks" if down else "output_blocks"
        if kind in ("resnets", "attentions"):
            index = (1 + level * per_level if down else level * per_level) + int(p[3])
            o = f"{blocks}.{index}." + ("0." + RESNET[p[4]] + "." + rest(5) if kind == "resnets" else "1." + rest(4))
        elif kind == "downsamplers":
            o = f"{blocks}.{(level + 1) * per_level}.0.op." + rest(5)
        else:  # upsamplers
            o = f"{blocks}.{level * per_level + layers}.{2 if up_with_attention[level] else 1}." + rest(4)
    return "model.diffusion_model." + o


# ---------------------------------------------------------------- runs

def train(name, ranks, *overrides, expect_failure=False, steps=STEPS, weights=WEIGHTS):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config", CONFIG, "--output_dir", out,
           "--steps", str(steps), "--warmup_steps", "0", "--synthetic_samples", "64", "--log_every", "1",
           "--checkpoint_every", "0",
           "--model_weights", weights, *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    print(f"  ran {' '.join(cmd[3 + len(MPI_FLAGS):])} with {ranks} rank(s) in {time.time() - start:.1f} s "
          f"(exit {result.returncode})", flush=True)
    if (result.returncode != 0) != expect_failure:
        print(output[-4000:])
    return result.returncode, output, out


def reported(output):
    """path -> (bytes, crc) from the trainer's 'export: PATH (...): N bytes, CRC32C X' lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith("export: ") and " bytes, CRC32C " in line:
            path = line[len("export: "):line.index(" (")]
            tail = line[line.rindex("): ") + 3:]
            size = int(tail.split(" bytes")[0])
            crc = int(tail.split("CRC32C ")[1].split(";")[0].split()[0], 16)
            found[path] = (size, crc)
    return found


os.makedirs(WORK, exist_ok=True)
_, fixture, fixture_order = read_st(WEIGHTS)
config = json.loads(read_st(WEIGHTS)[0]["config"])
layers = config["layers_per_block"]
up_with_attention = [t == "CrossAttnUpBlock2D" for t in config["up_block_types"]]
to_original = {n: original_name(n, layers, up_with_attention) for n in fixture}
check(len(set(to_original.values())) == len(fixture), "the name mapping is one to one")

# The base: VAE and text-encoder stand-ins of several dtypes around the UNet in fp16.
others = [
    ("conditioner.embedders.0.transformer.text_model.embeddings.position_ids", "I64", [1, 77],
     struct.pack("<77q", *range(77))),
    ("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight", "F16", [16, 8],
     struct.pack("<128e", *[i / 64 - 1 for i in range(128)])),
    ("conditioner.embedders.1.model.positional_embedding", "BF16", [7, 8],
     struct.pack("<56H", *[0x3F80 + i for i in range(56)])),
    ("conditioner.embedders.1.model.text_projection", "F32", [8, 8], struct.pack("<64f", *[i * 0.5 for i in range(64)])),
    ("first_stage_model.decoder.conv_in.weight", "F16", [8, 4, 3, 3], struct.pack("<288e", *[i / 300 for i in range(288)])),
    ("first_stage_model.encoder.conv_in.bias", "F32", [8], struct.pack("<8f", *range(8))),
]
unet_part = [(to_original[n], "F16", fixture[n][1], to_f16(fixture[n][2])) for n in fixture_order]
BASE_META = {"modelspec.title": "check_export fixture base", "modelspec.architecture": "stable-diffusion-xl-v1-base"}
BASE = os.path.join(WORK, "base.safetensors")
write_st(BASE, sorted(others + unet_part), BASE_META)
base_meta, base, base_order = read_st(BASE)
unet_keys = set(to_original.values())
other_keys = set(base) - unet_keys
print(f"  base: {len(base)} tensors ({len(unet_keys)} UNet), {os.path.getsize(BASE)} bytes")


def check_full(out, label, unet_folder, dtype):
    """The full checkpoint against the base and the exported diffusers UNet."""
    path = os.path.join(out, "full_checkpoint.safetensors")
    if not os.path.exists(path):
        check(False, f"{label}: full_checkpoint.safetensors written")
        return
    meta, full, order = read_st(path)
    check(set(full) == set(base) and order == base_order, f"{label}: every key of the base, in the base's order")
    check(meta == base_meta, f"{label}: the base's metadata")
    same = [k for k in other_keys if full.get(k) == base[k]]
    check(len(same) == len(other_keys), f"{label}: the {len(other_keys)} non-UNet tensors byte-identical to the base")
    _, exported, _ = read_st(os.path.join(out, unet_folder, "diffusion_pytorch_model.safetensors"))
    equal = [n for n in fixture if n in exported and full.get(to_original[n]) == exported[n]]
    check(len(equal) == len(fixture) and all(full[k][0] == dtype for k in unet_keys),
          f"{label}: the {len(fixture)} UNet tensors ({dtype}) equal {unet_folder}/ after the name mapping "
          f"({len(fixture) - len(equal)} differ)")


# 1. fp32, the EMA UNet (auto).
code, output, out32 = train("fp32", 2, "--export_full_checkpoint", BASE, "--export_single_file", "true")
check(code == 0, "fp32 run with export_full_checkpoint trains and exports")
check("\ntf32 = false\n" in output and "\nexport_dtype = \"fp32\"\n" in output,
      "the effective configuration shows [device] tf32 = false (strict fp32) and [output] export_dtype")
check(f"export_full_checkpoint: base '{BASE}' checked" in output and output.find("checked") < output.find("step 1"),
      "the base is checked before the first step")
if code == 0:
    check_full(out32, "fp32", "unet_ema", "F32")
    check("full checkpoint: the EMA UNet in fp32" in output, "the export says the full checkpoint holds the EMA UNet")
    files = reported(output)
    expected = [os.path.join(out32, f) for f in ("unet/diffusion_pytorch_model.safetensors", "unet.safetensors",
                                                  "unet_ema/diffusion_pytorch_model.safetensors",
                                                  "unet_ema.safetensors", "full_checkpoint.safetensors")]
    check(all(p in files and files[p][0] == os.path.getsize(p) for p in expected),
          f"size and CRC32C printed for each of the {len(expected)} exported files, sizes as on disk")
    full = os.path.join(out32, "full_checkpoint.safetensors")
    check(full in files and files[full][1] == crc32c(open(full, "rb").read()),
          "the full checkpoint's printed CRC32C is the file's")
    check(not any(n.startswith(".") for n in os.listdir(out32)), "no temporary file left in the output folder")

# 2. The same checkpoint exported again in fp16 (the trained UNet) and bf16 (auto: EMA).
final = os.path.join(out32, "checkpoints", f"step-{STEPS:08d}")
for dtype, st, rounding, pick in (("fp16", "F16", to_f16, "trained"), ("bf16", "BF16", to_bf16, "auto")):
    code, output, out = train(dtype, 2, "--export_full_checkpoint", BASE, "--export_dtype", dtype,
                              "--export_full_checkpoint_unet", pick, "--resume", final)
    check(code == 0 and "step 1" not in output, f"{dtype}: the final checkpoint exported again without training")
    if code != 0:
        continue
    for folder in ("unet", "unet_ema"):
        _, ref, _ = read_st(os.path.join(out32, folder, "diffusion_pytorch_model.safetensors"))
        _, got, _ = read_st(os.path.join(out, folder, "diffusion_pytorch_model.safetensors"))
        rounded = [n for n in fixture if got[n][0] == st and got[n][2] == rounding(ref[n][2])]
        check(len(rounded) == len(fixture), f"{dtype}: {folder}/ equals the fp32 export rounded to nearest even "
              f"({len(fixture) - len(rounded)} tensors differ)")
    check_full(out, dtype, "unet" if pick == "trained" else "unet_ema", st)
    which = "trained" if pick == "trained" else "EMA"
    check(f"full checkpoint: the {which} UNet in {dtype}" in output, f"{dtype}: the export says it holds the {which} UNet")

# 3. fp16 overflow: a weight of 70000 (conv_out.bias[0]) stays above 65504 after 1 step at lr 2e-3.
big = os.path.join(WORK, "big_weights.safetensors")
meta, tensors, order = read_st(WEIGHTS)
dtype_, shape, data = tensors["conv_out.bias"]
tensors["conv_out.bias"] = (dtype_, shape, struct.pack("<f", 70000.0) + data[4:])
write_st(big, [(n, *tensors[n]) for n in order], meta)
code, output, out = train("fp16-overflow", 1, "--export_dtype", "fp16", steps=1, weights=big)
check(code != 0 and "export_dtype = fp16: tensor 'conv_out.bias' of the trained UNet has max |value| 6999" in output
      and "beyond fp16's largest finite value 65504" in output,
      "fp16 export of a weight near 70000 is refused, naming the tensor and its max |value|")
check(not os.path.exists(os.path.join(out, "unet")) and os.path.isdir(os.path.join(out, "checkpoints", "step-00000001")),
      "fp16 overflow: nothing exported, the final checkpoint kept")

# 4. Refusals before the first step.
missing_key = os.path.join(WORK, "base_missing.safetensors")
dropped = to_original["mid_block.attentions.0.proj_in.weight"]
write_st(missing_key, [(n, *base[n]) for n in base_order if n != dropped], base_meta)
misshapen = os.path.join(WORK, "base_misshapen.safetensors")
reshaped = to_original["conv_in.bias"]
write_st(misshapen, [(n, *(base[n] if n != reshaped else ("F16", [2, 16], base[n][2]))) for n in base_order], base_meta)
garbage = os.path.join(WORK, "not_safetensors.ckpt")
with open(garbage, "wb") as f:
    f.write(b"PK\x03\x04 a pickle, not safetensors" * 10)
unet_only = os.path.join(out32, "unet.safetensors")
for name, args, reasons in [
        ("no-base", ("--export_full_checkpoint", os.path.join(WORK, "nowhere.safetensors")),
         ["export_full_checkpoint: base checkpoint", "nowhere.safetensors' does not exist"]),
        ("garbage-base", ("--export_full_checkpoint", garbage), ["is not a readable safetensors file"]),
        ("missing-key", ("--export_full_checkpoint", missing_key),
         ["does not match the trained UNet", "1 missing tensors", dropped]),
        ("misshapen", ("--export_full_checkpoint", misshapen),
         ["1 tensors with another shape", reshaped + ": base [2, 16], trained UNet [32]"]),
        ("unet-only", ("--export_full_checkpoint", unet_only), ["holds only", "no VAE"]),
        ("ema-without-ema", ("--export_full_checkpoint", BASE, "--ema_decay", "0", "--export_full_checkpoint_unet",
                             "ema"), ["export_full_checkpoint_unet = \"ema\" needs an EMA"])]:
    code, output, out = train(name, 1, *args, expect_failure=True)
    ok = code != 0 and all(r in output for r in reasons) and "step 1" not in output
    check(ok, f"{name}: refused before the first step, naming it ({reasons[-1]})")
    if not ok:
        print(output[-2000:])

print(f"{len(failures) == 0 and 'all passed' or 'FAILED: ' + '; '.join(failures)}")
sys.exit(1 if failures else 0)
