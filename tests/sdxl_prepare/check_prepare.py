#!/usr/bin/env python3
"""examples/sdxl/prepare end to end (stdlib only), on the tiny VAE and text
encoders of tests/fixtures/sdxl_vae_clip with tokenizers cut from
tests/fixtures/clip_tokenizer to the encoders' 1000-token vocabulary:

1. make_images writes ~45 mixed images (PNG, JPEG, WebP, grey, alpha, 24-100
   px, many aspect ratios; some without caption) and 9 broken files.
2. prepare under mpirun -np 3 (--flip, --validation_prompts): the dataset is
   written, each broken file is reported by path with its reason and listed
   as skipped, missing captions are counted.
3. check_values: the reference image's latents are the VAE mean of the
   expected crop (and of its mirror image for the flipped copy) times the
   scaling factor, the text tensors and the cached empty and validation
   prompts are the encoders' (through CachedDataset's accessors).
4. -np 1 writes the same samples: index.json equal, shard files byte-equal;
   so does --single_file (the same models in an original single file) with
   --single_file_config.
5. Killed while recording shard 4 (ZERO_FAULT_KILL_DURING_WRITE) and shard 0
   damaged afterwards: the restart keeps exactly the other finished shards
   (same inode and mtime), encodes shards 0 and 4 again, and ends with the
   -np 1 dataset.
6. --bad_images refuse exits nonzero naming a bad file; no index.json.
7. The trainer trains 2 steps on the dataset (2 ranks).

  check_prepare.py PREPARE MAKE_IMAGES MAKE_SINGLE_FILE CHECK_VALUES TRAIN MPIEXEC SOURCE_DIR WORKDIR [mpiexec flags...]
"""
import hashlib
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tiny_pipeline  # noqa: E402
from e2e_harness import check, finish, run  # noqa: E402

PREPARE, MAKE_IMAGES, MAKE_SINGLE_FILE, CHECK_VALUES, TRAIN, MPIEXEC, SOURCE, WORK = sys.argv[1:9]
MPI_FLAGS = sys.argv[9:]
FIXTURES = os.path.join(SOURCE, "tests", "fixtures")
BROKEN = {"truncated.jpg": "truncated JPEG", "truncated.png": "cannot decode PNG", "empty.png": "empty file",
          "cmyk.jpg": "CMYK", "deep.png": "16 bits", "huge.png": "too large", "anim.gif": "unsupported format",
          "garbage.png": "unsupported format", "truncated.webp": "WebP"}


def prepare(ranks, output, *extra, env=None, expect_ok=True, models=None):
    models = models or ["--pipeline", PIPELINE]
    cmd = [MPIEXEC, "-np", str(ranks), *MPI_FLAGS, PREPARE, *models, "--images", IMAGES,
           "--output", output, "--resolution", "32", "--bucket_step", "16", "--flip", "--shard_size", "5",
           "--batch_size", "3", "--save_dtype", "fp32", "--threads", "1", "--validation_prompts", PROMPTS, *extra]
    return run(cmd, env=env, expect_ok=expect_ok)


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def dataset_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
IMAGES = os.path.join(WORK, "images")
PIPELINE = os.path.join(WORK, "pipeline")
PROMPTS = os.path.join(WORK, "prompts.txt")
make = run([MAKE_IMAGES, IMAGES])
good = int(make.stdout.split()[0])
total = good + len(BROKEN)
check(total >= 40, f"fixture folder: {good} good images and {len(BROKEN)} broken files")
tiny_pipeline.make_pipeline(PIPELINE, FIXTURES)
with open(PROMPTS, "w") as f:
    f.write("a photo of a cat\n\nA red FOX, in snow!\nthe empty line above is skipped\n")

# 2. Three ranks.
ds3 = os.path.join(WORK, "ds3")
result = prepare(3, ds3)
out = result.stdout + result.stderr
index = json.load(open(os.path.join(ds3, "index.json")))
check(index["num_samples"] == 2 * good, f"{index['num_samples']} samples = 2 x {good} good images (--flip)")
for name, reason in BROKEN.items():
    check(re.search(rf"skipping image '{re.escape(os.path.join(IMAGES, name))}': [^\n]*{reason}", out, re.I) is not None,
          f"{name} reported by path with its reason ({reason})")
check(f"skipped {len(BROKEN)} bad images" in out, "the summary lists the skipped images")
check("4 images have no .txt caption" in out, "images without a caption are counted (empty caption)")
check(re.search(r"prepare: \d+/\d+ images, [\d.]+ images/s, ETA", out) is not None, "a progress line")
check(index["version"] == 2 and index["empty_prompt"]["file"] == "empty_prompt.safetensors", "empty prompt cached")
check(index.get("validation_prompts", {}).get("prompts") ==
      ["a photo of a cat", "A red FOX, in snow!", "the empty line above is skipped"], "validation prompts listed")
buckets = sorted({tuple(s["target_size"]) for s in index["samples"]})
check(len(buckets) >= 3 and all(h % 16 == 0 and w % 16 == 0 and h * w <= 32 * 32 for h, w in buckets),
      f"aspect-ratio buckets {buckets}")

# 3. Values.
values = run([CHECK_VALUES, PIPELINE, ds3, os.path.join(IMAGES, "exact.png"), "the reference image",
              "0", "2", "16", "48"], expect_ok=False)
print(values.stdout, values.stderr)
check(values.returncode == 0, "latents, crop records and text tensors match the models")

# 4. One rank: the same dataset.
ds1 = os.path.join(WORK, "ds1")
prepare(1, ds1)
check(open(os.path.join(ds1, "index.json")).read() == open(os.path.join(ds3, "index.json")).read(),
      "index.json of -np 1 equals -np 3's (same samples, records, shards)")
check(dataset_files(ds1) == dataset_files(ds3) and
      all(digest(os.path.join(ds1, f)) == digest(os.path.join(ds3, f)) for f in dataset_files(ds1)),
      "every shard file of -np 1 is byte-equal to -np 3's")

# 4b. The same models from an original single file (make_single_file: the
# pipeline's VAE and text encoders under Stability AI's names, no config
# metadata), described by --single_file_config: the same dataset, byte for byte.
single = os.path.join(WORK, "original.safetensors")
run([MAKE_SINGLE_FILE, PIPELINE, single])
dss = os.path.join(WORK, "ds_single_file")
prepare(1, dss, models=["--single_file", single, "--single_file_config", PIPELINE])
check(open(os.path.join(dss, "index.json")).read() == open(os.path.join(ds1, "index.json")).read() and
      dataset_files(dss) == dataset_files(ds1) and
      all(digest(os.path.join(dss, f)) == digest(os.path.join(ds1, f)) for f in dataset_files(ds1)),
      "--single_file --single_file_config writes the --pipeline dataset byte for byte")

# 5. Killed while recording shard 4, then shard 0 damaged; restarted.
dsk = os.path.join(WORK, "ds_killed")
env = dict(os.environ, ZERO_FAULT_KILL_DURING_WRITE="shard-00004.json")
killed = prepare(3, dsk, env=env, expect_ok=False)
check(killed.returncode != 0, "the run killed while recording shard 4 fails")
check(not os.path.exists(os.path.join(dsk, "index.json")), "no index.json after the kill")
state = os.path.join(dsk, "prepare-state")
finished = {f: os.stat(os.path.join(state, f)) for f in os.listdir(state) if re.fullmatch(r"shard-\d{5}\.json", f)}
check("shard-00004.json" not in finished, f"shard 4 not recorded (finished: {sorted(finished)})")
damaged = "shard-00000.json" in finished
if damaged:
    with open(os.path.join(dsk, "shard-00000.safetensors"), "r+b") as f:
        f.truncate(100)
resumed = prepare(3, dsk)
match = re.search(r"shards: (\d+) kept from an earlier run, (\d+) encoded now", resumed.stdout)
expect_kept = len(finished) - (1 if damaged else 0)
check(match is not None and int(match.group(1)) == expect_kept,
      f"the restart keeps the {expect_kept} intact finished shards ({match.group(0) if match else 'no count'})")
unchanged = [f for f, st in finished.items() if f != "shard-00000.json"
             and os.stat(os.path.join(state, f)).st_ino == st.st_ino
             and os.stat(os.path.join(state, f)).st_mtime_ns == st.st_mtime_ns]
check(len(unchanged) == len(finished) - (1 if damaged else 0), "their records were not rewritten (inode, mtime)")
check(open(os.path.join(dsk, "index.json")).read() == open(os.path.join(ds1, "index.json")).read() and
      all(digest(os.path.join(dsk, f)) == digest(os.path.join(ds1, f)) for f in dataset_files(ds1)),
      "the resumed dataset equals the uninterrupted one")
check(not [f for f in os.listdir(dsk) if ".tmp." in f], "no temporary files left in the dataset")

# 6. Refusal.
dsr = os.path.join(WORK, "ds_refuse")
refused = prepare(2, dsr, "--bad_images", "refuse", expect_ok=False)
text = refused.stdout + refused.stderr
check(refused.returncode != 0 and re.search(rf"bad image '{re.escape(IMAGES)}/[^']+': ", text) is not None
      and "--bad_images refuse" in text and "Exception raised from" not in text,
      "--bad_images refuse exits nonzero naming the file, no C++ frames")
check(not os.path.exists(os.path.join(dsr, "index.json")), "no index.json after a refusal")

# 7. Two training steps on it (a tiny UNet for the fixture's text dims: 80-wide
# prompt embeddings, 40-wide pooled).
unet = os.path.join(WORK, "unet.json")
tiny_pipeline.write_tiny_unet_config(unet)
runs = os.path.join(WORK, "train")
run([MPIEXEC, "-np", "2", *MPI_FLAGS, TRAIN, "--config", os.path.join(SOURCE, "examples", "sdxl", "configs", "tiny.toml"),
     "--model_config", unet, "--synthetic", "false", "--dataset", ds3, "--output_dir", runs, "--steps", "2",
     "--batch_size", "1", "--log_every", "1", "--checkpoint_every", "0", "--save_final", "false",
     "--export_unet", "false", "--warmup_steps", "1"])
rows = [json.loads(line) for line in open(os.path.join(runs, "metrics.jsonl"))]
check(len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows), f"the trainer trained 2 steps: {[r['loss'] for r in rows]}")

finish()
