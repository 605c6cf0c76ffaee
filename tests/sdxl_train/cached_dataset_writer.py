"""A stdlib-only writer of zero's cached SDXL dataset (docs/dataset.md), for
the trainer tests that need a cached dataset with chosen values (shapes,
buckets, an empty prompt) without models. Datasets from images are made by
examples/sdxl/prepare; this file writes the same format, which
examples/sdxl/data/cached_dataset.cpp validates when the trainer opens it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
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
VALIDATION_PROMPTS_FILE = "validation_prompts.safetensors"
LATENT_CHANNELS = 4
SDXL_VAE_SCALING_FACTOR = 0.13025

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
    validation_prompts: dict = None  # {"file", "size", "prompts"} once set_validation_prompts wrote it

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

    def set_validation_prompts(self, prompts, prompt_embeds, pooled):
        """The trainer's validation prompts and their conditioning: (dtype,
        shape, bytes) triples [P, T, W] and [P, pooled_width] in the dataset's
        text dims, written at once as validation_prompts.safetensors (a
        version-2 entry of index.json, as prepare --validation_prompts writes)."""
        rows = len(prompts)
        dims = self.text_dims
        if tuple(prompt_embeds[1]) != (rows, dims["sequence_length"], dims["width"]):
            raise ValueError(f"validation prompt_embeds shape {prompt_embeds[1]} differs from {rows} x {dims}")
        if tuple(pooled[1]) != (rows, dims["pooled_width"]):
            raise ValueError(f"validation pooled shape {pooled[1]} differs from {rows} x {dims}")
        path = self.directory / VALIDATION_PROMPTS_FILE
        tensors = [("prompt_embeds", prompt_embeds[0], tuple(prompt_embeds[1]), prompt_embeds[2]),
                   ("pooled_prompt_embeds", pooled[0], tuple(pooled[1]), pooled[2])]
        write_atomically(path, safetensors_chunks(tensors, {"format": FORMAT_NAME}))
        self.validation_prompts = {"file": VALIDATION_PROMPTS_FILE, "size": path.stat().st_size,
                                   "prompts": list(prompts)}

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
            f'  "version": {FORMAT_VERSION_EMPTY_PROMPT if self.empty_prompt or self.validation_prompts else FORMAT_VERSION},',
            f'  "latent_channels": {LATENT_CHANNELS},',
            f'  "vae_scaling_factor": {json.dumps(self.vae_scaling_factor)},',
            f'  "text": {json.dumps(self.text_dims)},',
        ]
        if self.empty_prompt:
            lines.append(f'  "empty_prompt": {json.dumps(self.empty_prompt)},')
        if self.validation_prompts:
            lines.append(f'  "validation_prompts": {json.dumps(self.validation_prompts, ensure_ascii=False)},')
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
