#!/usr/bin/env python3
"""Encode an image folder into zero's cached SDXL dataset (docs/dataset.md).

Each image ``name.<ext>`` in --images is paired with ``name.txt`` holding its
caption (UTF-8; a missing file means an empty caption unless
--require-captions). For every image the script

  1. picks the aspect-ratio bucket closest to the image's aspect ratio (sides
     multiples of --bucket-step, area at most --resolution², sides within
     [--min-side, --max-side]);
  2. resizes the image so that it covers the bucket, then crops it to the
     bucket (center or random), recording original_size (h, w),
     crop_top_left (top, left) in the resized image and target_size (h, w):
     SDXL's micro-conditioning (diffusers' add_time_ids);
  3. VAE-encodes it and multiplies by the VAE's scaling factor (0.13025 for
     SDXL), so latents are stored ready to be noised;
  4. encodes the caption with both text encoders: the penultimate hidden states
     of encoder 1 (768) and encoder 2 (1280) concatenated to [77, 2048], and
     encoder 2's projected pooled output [1280];

and writes shards of --samples-per-shard samples plus index.json, each through
a temporary file renamed into place, index last: a directory with an
index.json is complete.

Requires torch, diffusers, transformers and Pillow (not needed by zero itself):

    pip install torch diffusers transformers pillow
    python tools/prepare_dataset.py --images photos/ --output my-dataset \\
        --model stabilityai/stable-diffusion-xl-base-1.0 \\
        --vae madebyollin/sdxl-vae-fp16-fix

The safetensors shards and the index are written with the standard library
only (below), so the on-disk format is defined in this file and in
examples/sdxl/data/cached_dataset.cpp, which validates exactly what this
writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_NAME = "zero-sdxl-cached-latents"
FORMAT_VERSION = 1
# Version 2 adds the optional "empty_prompt" entry; written only with it, so
# datasets without one stay version 1.
FORMAT_VERSION_EMPTY_PROMPT = 2
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
LATENT_CHANNELS = 4
SDXL_VAE_SCALING_FACTOR = 0.13025
VAE_DOWNSAMPLE = 8
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"}

# ---------------------------------------------------------------- format writing (stdlib only)

# Element sizes of the safetensors dtypes this format stores.
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def fsync_directory(path: Path) -> None:
    """Makes renames inside `path` durable (as zero::io::fsync_directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # file systems that cannot fsync a directory
    finally:
        os.close(fd)


def write_atomically(target: Path, chunks) -> str:
    """Writes the byte chunks to `target` through a hidden temporary file in
    the same directory, fsyncs, renames over the target. Returns the sha256."""
    temp = target.parent / f".{target.name}.tmp.{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with open(temp, "wb") as out:
            for chunk in chunks:
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
    return digest.hexdigest()


def safetensors_chunks(tensors, metadata=None):
    """The bytes of a safetensors file: tensors are (name, dtype, shape, data)
    with little-endian `data` bytes. The header is padded with spaces to a
    multiple of 8 so the data section is 8-byte aligned, as zero writes it."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in tensors:
        expected = DTYPE_SIZES[dtype] * math.prod(shape)
        if len(data) != expected:
            raise ValueError(f"tensor {name}: {len(data)} bytes, expected {expected} for {dtype} {shape}")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text))
    yield text
    for _, _, _, data in tensors:
        yield data


@dataclass
class SampleRecord:
    key: str
    shard: int
    latent_shape: tuple
    original_size: tuple
    crop_top_left: tuple
    target_size: tuple
    caption: str


@dataclass
class DatasetWriter:
    """Buffers encoded samples and writes shards and the index (the Python twin
    of sdxl::data::CachedDatasetWriter)."""

    directory: Path
    text_dims: dict
    samples_per_shard: int
    vae_scaling_factor: float
    overwrite: bool = False
    shards: list = field(default_factory=list)
    records: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    pending_samples: int = 0
    empty_prompt: dict = None  # {"file", "size", "sha256"} once set_empty_prompt wrote it

    def __post_init__(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / "index.json"
        if index.exists():
            if not self.overwrite:
                sys.exit(f"{self.directory} already holds a dataset (index.json); pass --overwrite to replace it")
            # Gone before the first new shard lands, so that an interrupted
            # rewrite never leaves an index describing a mix of old and new shards.
            index.unlink()
            fsync_directory(self.directory)

    def add(self, latents, prompt_embeds, pooled, original_size, crop_top_left, target_size, caption):
        """latents, prompt_embeds, pooled: (dtype, shape, bytes) triples."""
        key = str(len(self.records))
        shape = tuple(latents[1])
        if len(shape) != 3 or shape[0] != LATENT_CHANNELS:
            raise ValueError(f"latent shape {shape} is not [4, h, w]")
        if tuple(prompt_embeds[1]) != (self.text_dims["sequence_length"], self.text_dims["width"]):
            raise ValueError(f"prompt_embeds shape {prompt_embeds[1]} differs from {self.text_dims}")
        if tuple(pooled[1]) != (self.text_dims["pooled_width"],):
            raise ValueError(f"pooled shape {pooled[1]} differs from {self.text_dims}")
        self.records.append(SampleRecord(key, len(self.shards), shape, tuple(original_size),
                                         tuple(crop_top_left), tuple(target_size), caption))
        self.pending.append((f"{key}.latents", latents[0], shape, latents[2]))
        self.pending.append((f"{key}.prompt_embeds", prompt_embeds[0], tuple(prompt_embeds[1]), prompt_embeds[2]))
        self.pending.append((f"{key}.pooled_prompt_embeds", pooled[0], tuple(pooled[1]), pooled[2]))
        self.pending_samples += 1
        if self.pending_samples == self.samples_per_shard:
            self.flush()

    def set_empty_prompt(self, prompt_embeds, pooled):
        """The conditioning of the empty prompt "" (for the trainer's caption
        dropout): (dtype, shape, bytes) triples in the dataset's text dims,
        written at once as empty_prompt.safetensors (named by finish())."""
        if tuple(prompt_embeds[1]) != (self.text_dims["sequence_length"], self.text_dims["width"]):
            raise ValueError(f"empty prompt_embeds shape {prompt_embeds[1]} differs from {self.text_dims}")
        if tuple(pooled[1]) != (self.text_dims["pooled_width"],):
            raise ValueError(f"empty pooled shape {pooled[1]} differs from {self.text_dims}")
        path = self.directory / EMPTY_PROMPT_FILE
        tensors = [("prompt_embeds", prompt_embeds[0], tuple(prompt_embeds[1]), prompt_embeds[2]),
                   ("pooled_prompt_embeds", pooled[0], tuple(pooled[1]), pooled[2])]
        sha256 = write_atomically(path, safetensors_chunks(tensors, {"format": FORMAT_NAME}))
        self.empty_prompt = {"file": EMPTY_PROMPT_FILE, "size": path.stat().st_size, "sha256": sha256}

    def flush(self):
        if not self.pending_samples:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        path = self.directory / name
        sha256 = write_atomically(path, safetensors_chunks(self.pending, {"format": FORMAT_NAME}))
        self.shards.append({"file": name, "num_samples": self.pending_samples,
                            "size": path.stat().st_size, "sha256": sha256})
        self.pending, self.pending_samples = [], 0

    def finish(self) -> int:
        if not self.records:
            sys.exit("no samples were encoded; nothing written")
        self.flush()
        lines = [
            "{",
            f'  "format": {json.dumps(FORMAT_NAME)},',
            f'  "version": {FORMAT_VERSION_EMPTY_PROMPT if self.empty_prompt else FORMAT_VERSION},',
            f'  "latent_channels": {LATENT_CHANNELS},',
            f'  "vae_scaling_factor": {json.dumps(self.vae_scaling_factor)},',
            f'  "text": {json.dumps(self.text_dims)},',
        ]
        if self.empty_prompt:
            lines.append(f'  "empty_prompt": {json.dumps(self.empty_prompt)},')
        lines += [
            f'  "num_samples": {len(self.records)},',
            '  "shards": [',
            ",\n".join("    " + json.dumps(s) for s in self.shards),
            "  ],",
            '  "samples": [',
        ]
        entries = []
        for r in self.records:
            entry = {"shard": r.shard, "key": r.key, "latent_shape": list(r.latent_shape),
                     "original_size": list(r.original_size), "crop_top_left": list(r.crop_top_left),
                     "target_size": list(r.target_size)}
            if r.caption:
                entry["caption"] = r.caption
            entries.append("    " + json.dumps(entry, ensure_ascii=False))
        lines += [",\n".join(entries), "  ]", "}", ""]
        write_atomically(self.directory / "index.json", ["\n".join(lines).encode("utf-8")])
        return len(self.records)


# ---------------------------------------------------------------- buckets and cropping


def make_buckets(resolution: int, step: int, min_side: int, max_side: int):
    """Every (height, width), sides multiples of `step` within [min_side,
    max_side], whose area is at most resolution², keeping for each height only
    the widest width (the largest bucket of that aspect ratio)."""
    buckets = set()
    max_area = resolution * resolution
    for height in range(min_side, max_side + 1, step):
        width = min(max_side, (max_area // height) // step * step)
        if width >= min_side:
            buckets.add((height, width))
    return sorted(buckets)


def nearest_bucket(height: int, width: int, buckets):
    """The bucket whose aspect ratio is closest in log scale (a 2:1 image is as
    far from 1:1 as from 4:1); ties go to the larger bucket."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[1] / b[0]) - ratio), -b[0] * b[1]))


def oriented_size(image):
    """(height, width) as displayed: EXIF orientations 5-8 rotate by 90 degrees."""
    orientation = image.getexif().get(0x0112, 1)
    return (image.width, image.height) if orientation in (5, 6, 7, 8) else (image.height, image.width)


def resize_and_crop(image, bucket, crop: str, rng: random.Random):
    """Resizes `image` (PIL) to cover `bucket` and crops it to the bucket.
    Returns the crop and (top, left) of the crop in the resized image."""
    from PIL import Image

    target_h, target_w = bucket
    scale = max(target_h / image.height, target_w / image.width)
    resized_h = max(target_h, round(image.height * scale))
    resized_w = max(target_w, round(image.width * scale))
    image = image.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    if crop == "center":
        top, left = (resized_h - target_h) // 2, (resized_w - target_w) // 2
    else:
        top, left = rng.randint(0, resized_h - target_h), rng.randint(0, resized_w - target_w)
    return image.crop((left, top, left + target_w, top + target_h)), (top, left)


# ---------------------------------------------------------------- encoding (torch)


def tensor_entry(tensor, dtype_name: str):
    """(safetensors dtype, shape, little-endian bytes) of a CPU copy of tensor
    in the storage dtype."""
    import torch

    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype_name]
    t = tensor.detach().to("cpu", torch_dtype).contiguous()
    # numpy has no bfloat16: move 16-bit types as raw int16 bits.
    raw = t.view(torch.int16) if t.element_size() == 2 else t
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this script assumes a little-endian host")
    return dtype_name, tuple(t.shape), raw.numpy().tobytes()


class Encoders:
    def __init__(self, args):
        import torch
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.torch = torch
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # The stock SDXL VAE overflows in fp16; run it in fp32 unless it is the
        # fp16-fixed one (madebyollin/sdxl-vae-fp16-fix) and --vae-fp16 is set.
        self.vae_dtype = torch.float16 if args.vae_fp16 else torch.float32
        text_dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        if args.vae:
            self.vae = AutoencoderKL.from_pretrained(args.vae, torch_dtype=self.vae_dtype)
        else:
            self.vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae", torch_dtype=self.vae_dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        self.scaling_factor = float(self.vae.config.scaling_factor)
        if abs(self.scaling_factor - SDXL_VAE_SCALING_FACTOR) > 1e-6:
            print(f"warning: VAE scaling factor {self.scaling_factor} is not SDXL's {SDXL_VAE_SCALING_FACTOR}",
                  file=sys.stderr)
        self.tokenizers = [
            CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer"),
            CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer_2"),
        ]
        self.text_encoders = [
            CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder", torch_dtype=text_dtype),
            CLIPTextModelWithProjection.from_pretrained(args.model, subfolder="text_encoder_2",
                                                        torch_dtype=text_dtype),
        ]
        for encoder in self.text_encoders:
            encoder.to(self.device).eval().requires_grad_(False)
        self.latent_mode = args.latent_mode
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)

    def encode_images(self, images):
        """PIL images of one bucket -> scaled latents [n, 4, h/8, w/8] (float32)."""
        import numpy as np

        torch = self.torch
        pixels = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images])
        pixels = torch.from_numpy(pixels).permute(0, 3, 1, 2) / 127.5 - 1.0  # [0, 255] -> [-1, 1]
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, self.vae_dtype)).latent_dist
            latents = dist.sample(generator=self.generator) if self.latent_mode == "sample" else dist.mean
        return latents.float() * self.scaling_factor

    def encode_captions(self, captions):
        """-> prompt_embeds [n, 77, 2048], pooled [n, 1280] (float32), as
        diffusers' SDXL pipelines and training scripts compute them."""
        torch = self.torch
        hidden = []
        with torch.no_grad():
            for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
                ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                                truncation=True, return_tensors="pt").input_ids.to(self.device)
                out = encoder(ids, output_hidden_states=True)
                hidden.append(out.hidden_states[-2])  # penultimate layer, as SDXL was trained
        # The pooled vector comes from encoder 2 only: its projected output.
        return torch.cat(hidden, dim=-1).float(), out.text_embeds.float()


# ---------------------------------------------------------------- main


def find_images(folder: Path, require_captions: bool):
    items = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file():
            continue
        caption_path = path.with_suffix(".txt")
        if caption_path.exists():
            caption = caption_path.read_text(encoding="utf-8").strip()
        elif require_captions:
            sys.exit(f"{path}: no caption file {caption_path.name} (--require-captions)")
        else:
            caption = ""
        items.append((path, caption))
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="folder of images with .txt captions (searched recursively)")
    p.add_argument("--output", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--model", default="stabilityai/stable-diffusion-xl-base-1.0",
                   help="diffusers SDXL model (hub id or folder) for the tokenizers and text encoders (and the VAE unless --vae)")
    p.add_argument("--vae", default=None, help="separate VAE (e.g. madebyollin/sdxl-vae-fp16-fix)")
    p.add_argument("--vae-fp16", action="store_true", help="run the VAE in fp16 (only with an fp16-safe VAE)")
    p.add_argument("--resolution", type=int, default=1024, help="bucket area is at most resolution^2 pixels")
    p.add_argument("--bucket-step", type=int, default=64, help="bucket sides are multiples of this (>= 8)")
    p.add_argument("--min-side", type=int, default=512)
    p.add_argument("--max-side", type=int, default=2048)
    p.add_argument("--crop", choices=["center", "random"], default="center")
    p.add_argument("--latent-mode", choices=["sample", "mean"], default="sample",
                   help="store a sample of the VAE posterior (as diffusers' training script) or its mean")
    p.add_argument("--latent-dtype", choices=["F16", "BF16", "F32"], default="F16")
    p.add_argument("--text-dtype", choices=["F16", "BF16", "F32"], default="F16")
    p.add_argument("--samples-per-shard", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="images per VAE / text-encoder call")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seeds random crops and posterior samples")
    p.add_argument("--require-captions", action="store_true", help="fail on images without a .txt caption")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --output")
    args = p.parse_args(argv)
    if args.bucket_step % VAE_DOWNSAMPLE:
        p.error(f"--bucket-step must be a multiple of {VAE_DOWNSAMPLE} (the VAE downsamples by 8)")
    if args.samples_per_shard < 1 or args.batch_size < 1:
        p.error("--samples-per-shard and --batch-size must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from PIL import Image, ImageOps

    items = find_images(args.images, args.require_captions)
    if not items:
        sys.exit(f"no images found in {args.images}")
    buckets = make_buckets(args.resolution, args.bucket_step, args.min_side, args.max_side)
    if not buckets:
        sys.exit("no bucket satisfies --resolution, --min-side and --max-side")
    rng = random.Random(args.seed)

    # Assign buckets from the image headers only, then encode bucket by bucket
    # so that every VAE call stacks images of one size.
    by_bucket = {}
    for path, caption in items:
        with Image.open(path) as image:
            height, width = oriented_size(image)
        by_bucket.setdefault(nearest_bucket(height, width, buckets), []).append((path, caption))

    encoders = Encoders(args)
    writer = DatasetWriter(args.output, {"sequence_length": 77, "width": 2048, "pooled_width": 1280},
                           args.samples_per_shard, encoders.scaling_factor, args.overwrite)
    # What the encoders give for "": the trainer's caption dropout
    # ([data] caption_dropout) trains on it in place of a sample's caption.
    empty_embeds, empty_pooled = encoders.encode_captions([""])
    writer.set_empty_prompt(tensor_entry(empty_embeds[0], args.text_dtype), tensor_entry(empty_pooled[0], args.text_dtype))
    done = 0
    for bucket in sorted(by_bucket):
        group = by_bucket[bucket]
        for start in range(0, len(group), args.batch_size):
            batch = group[start:start + args.batch_size]
            images, originals, crops = [], [], []
            for path, _ in batch:
                with Image.open(path) as image:
                    image = ImageOps.exif_transpose(image).convert("RGB")
                    originals.append((image.height, image.width))
                    cropped, top_left = resize_and_crop(image, bucket, args.crop, rng)
                images.append(cropped)
                crops.append(top_left)
            captions = [caption for _, caption in batch]
            latents = encoders.encode_images(images)
            prompt_embeds, pooled = encoders.encode_captions(captions)
            if prompt_embeds.shape[1:] != (77, 2048) or pooled.shape[1:] != (1280,):
                sys.exit(f"unexpected text encoder output shapes {tuple(prompt_embeds.shape)}, {tuple(pooled.shape)}: "
                         "is --model an SDXL model?")
            for k in range(len(batch)):
                writer.add(tensor_entry(latents[k], args.latent_dtype),
                           tensor_entry(prompt_embeds[k], args.text_dtype),
                           tensor_entry(pooled[k], args.text_dtype),
                           originals[k], crops[k], bucket, captions[k])
            done += len(batch)
            print(f"\r{done}/{len(items)} images", end="", file=sys.stderr, flush=True)
    count = writer.finish()
    print(f"\nwrote {count} samples in {len(writer.shards)} shards, {len(by_bucket)} buckets, to {args.output}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
