"""The trainer's [validation] images end to end (stdlib only), on the tiny
pipeline (tiny_pipeline.py) and a tiny UNet of its text widths:

1. np 2, EMA, every 2 steps of 4, three prompts: step-2 and step-4 folders
   each hold three decodable PNGs (prompt i drawn by rank i mod 2) and an
   index.json; the images change as the weights train; TensorBoard holds
   them (tools/check_tfevents.py --expect-images) at steps 2 and 4;
2. training is untouched: the same run without validation logs the same
   losses and exports the same UNet and EMA UNet, byte for byte;
3. the image is what the sample tool draws from the exported EMA UNet with
   the same prompt, seed and settings, byte for byte;
4. with offload_optimizer and offload_delayed_update (the update running on
   a host thread while validation reads the weights) training is untouched too;
5. prompts cached in the dataset (prepare --validation_prompts) are drawn
   without the pipeline's text encoders;
6. [validation] single_file (the pipeline's VAE and text encoders in an
   original single file, make_single_file) with single_file_config draws the
   pipeline's images byte for byte;
7. bad settings stop the run before training, naming the key.

  check_validation.py TRAIN SAMPLE MAKE_SINGLE_FILE MPIEXEC SOURCE_DIR WORKDIR [mpiexec flags...]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tiny_pipeline  # noqa: E402
from e2e_harness import check, finish, load_dataset_writer, pattern_values, run  # noqa: E402
from png_reader import read_png  # noqa: E402

TRAIN, SAMPLE, MAKE_SINGLE_FILE, MPIEXEC, SOURCE, WORK = sys.argv[1:7]
MPI_FLAGS = sys.argv[7:]
PROMPTS = ["a red fox in snow", "a blue house", "a green tree"]


def train(out, ranks, *extra, steps=4, expect_ok=True):
    return run([MPIEXEC, "-np", str(ranks), *MPI_FLAGS, TRAIN, "--config",
                os.path.join(SOURCE, "examples", "sdxl", "configs", "tiny.toml"), "--model_config", UNET_CONFIG,
                "--output_dir", out, "--steps", str(steps), "--warmup_steps", "0", "--batch_size", "2", "--log_every", "1",
                "--checkpoint_every", "0", "--save_final", "false", "--ema_decay", "0.5", "--synthetic_samples", "32",
                *extra], expect_ok=expect_ok)


def validation(every, *prompts, height=32):
    args = ["--validation_every", str(every), "--validation_pipeline", PIPELINE, "--validation_steps", "4",
            "--validation_height", str(height), "--validation_width", "48", "--validation_seed", "5"]
    for p in prompts:
        args += ["--validation_prompt", p]
    return args


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def exports_equal(a, b):
    name = os.path.join("{}", "diffusion_pytorch_model.safetensors")
    return all(read(os.path.join(a, name.format(u))) == read(os.path.join(b, name.format(u))) for u in ("unet", "unet_ema"))


PIPELINE, UNET_CONFIG = tiny_pipeline.fresh_workdir(WORK, SOURCE)

# 1. Images every 2 steps and at the end, sharded over 2 ranks.
a = os.path.join(WORK, "a")
result = train(a, 2, *validation(2, *PROMPTS))
names = [f"{i:02d}-{p.replace(' ', '-')}.png" for i, p in enumerate(PROMPTS)]
images = {}
for step in (2, 4):
    folder = os.path.join(a, "samples", f"step-{step:08d}")
    present = sorted(f for f in os.listdir(folder)) if os.path.isdir(folder) else []
    check(present == sorted(names + ["index.json"]), f"step {step}: three PNGs and index.json ({present})")
    for name in names:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            width, height, rows = read_png(path)
            check((width, height) == (48, 32) and len(set(b"".join(rows))) > 16, f"step {step}: {name} is a 48x32 image")
            images[(step, name)] = read(path)
    if os.path.exists(os.path.join(folder, "index.json")):
        index = json.load(open(os.path.join(folder, "index.json")))
        check(index["step"] == step and index["weights"] == "ema"
              and [(e["prompt"], e["seed"], e["rank"]) for e in index["images"]] ==
              [(p, 5 + i, i % 2) for i, p in enumerate(PROMPTS)], f"step {step}: index.json lists prompts, seeds, ranks")
check(not [f for _, _, fs in os.walk(os.path.join(a, "samples")) for f in fs if ".tmp" in f], "no temporary file is left")
check(all(images.get((2, n)) != images.get((4, n)) for n in names), "the images change as the weights train")
check("validation: 3 image(s)" in result.stdout, "rank 0 reports each validation")
tb = run([sys.executable, os.path.join(SOURCE, "tools", "check_tfevents.py"), "--pure", "--json",
          "--expect-images", "validation/00,validation/01,validation/02", os.path.join(a, "tensorboard")],
         expect_ok=False)
check(tb.returncode == 0, "TensorBoard holds the three images (check_tfevents.py --expect-images)")
points = next(iter(json.loads(tb.stdout).values()), {}) if tb.returncode == 0 else {}
check([p[0] for p in points.get("validation/seconds", [])] == [2, 4], "validation/seconds is logged at steps 2 and 4")

# 2. The same run without validation trains the same.
b = os.path.join(WORK, "b")
train(b, 2)
check(losses(a) == losses(b), "validation leaves the losses bit for bit")
check(exports_equal(a, b), "validation leaves the exported UNet and EMA UNet byte for byte")

# 3. The step-4 image of prompt 1 (drawn by rank 1) is the sample tool's from the exported EMA UNet.
png = os.path.join(WORK, "sampled.png")
run([SAMPLE, "--pipeline", PIPELINE, "--unet", os.path.join(a, "unet_ema"), "--prompt", PROMPTS[1], "--seed", "6",
     "--steps", "4", "--height", "32", "--width", "48", "--guidance", "5", "--output", png])
check(os.path.exists(png) and read(png) == images.get((4, names[1])),
      "the last validation image equals sample's from unet_ema, byte for byte")

# 4. Offloaded, with the delayed update: still untouched.
offload = ["--offload_optimizer", "true", "--offload_delayed_update", "true"]
c = os.path.join(WORK, "c")
d = os.path.join(WORK, "d")
train(c, 2, *offload, *validation(1, PROMPTS[0]))
train(d, 2, *offload)
check(losses(c) == losses(d) and exports_equal(c, d),
      "offload_delayed_update: validation after every step leaves losses and exports bit for bit")
check(len(os.listdir(os.path.join(c, "samples"))) == 4, "offload_delayed_update: images after each of the 4 steps")

# 5. Prompts cached in the dataset, drawn with a pipeline that has no text encoders.
writer_module = load_dataset_writer()


text = {"sequence_length": 7, "width": 80, "pooled_width": 40}
dataset = os.path.join(WORK, "dataset")
writer = writer_module.DatasetWriter(directory=writer_module.Path(dataset), text_dims=text, samples_per_shard=8,
                                     vae_scaling_factor=writer_module.SDXL_VAE_SCALING_FACTOR)
for i in range(8):
    writer.add(("F32", (4, 16, 16), pattern_values(4 * 16 * 16, i)), ("F32", (7, 80), pattern_values(7 * 80, i + 100)),
               ("F32", (40,), pattern_values(40, i + 200)), (128, 128), (0, 0), (128, 128), f"sample {i}")
cached = ["a cached castle", "a cached river"]
writer.set_validation_prompts(cached, ("F32", (2, 7, 80), pattern_values(2 * 7 * 80, 300)), ("F32", (2, 40), pattern_values(2 * 40, 301)))
writer.finish()
no_text = os.path.join(WORK, "pipeline-without-text-encoders")
os.makedirs(no_text)
os.symlink(os.path.join(PIPELINE, "vae"), os.path.join(no_text, "vae"))
shutil.copy(os.path.join(PIPELINE, "model_index.json"), no_text)
e = os.path.join(WORK, "e")
train(e, 1, "--synthetic", "false", "--dataset", dataset, *[x if x != PIPELINE else no_text for x in validation(2)],
      steps=2)
index_file = os.path.join(e, "samples", "step-00000002", "index.json")
check(os.path.exists(index_file) and [x["prompt"] for x in json.load(open(index_file))["images"]] == cached,
      "the dataset's cached prompts are drawn without text encoders")

# 6. The same models from an original single file: the same images.
single = os.path.join(WORK, "original.safetensors")
run([MAKE_SINGLE_FILE, PIPELINE, single])
from_file = ["--validation_single_file", single, "--validation_single_file_config", PIPELINE]
f = os.path.join(WORK, "f")
train(f, 2, *[x for x in validation(2, *PROMPTS) if x not in ("--validation_pipeline", PIPELINE)], *from_file)
check(all(os.path.exists(os.path.join(f, "samples", f"step-{step:08d}", n)) and
          read(os.path.join(f, "samples", f"step-{step:08d}", n)) == images.get((step, n))
          for step in (2, 4) for n in names),
      "[validation] single_file + single_file_config: the pipeline's images, byte for byte")

# 7. Refusals before training.
for what, extra, fragment in (
        ("no pipeline", ["--validation_every", "2", "--validation_prompt", "x"], "[validation] pipeline"),
        ("no prompts", validation(2), "no prompts"),
        ("a pipeline that is not a folder", validation(2, "x")[:3] + [os.path.join(WORK, "nowhere")] +
         validation(2, "x")[4:], "nowhere"),
        ("an unknown sampler", validation(2, "x") + ["--validation_sampler", "ddim"], "[validation] sampler"),
        ("a height not a multiple of 8", validation(2, "x", height=36), "[validation] height"),
        ("pipeline and single_file", validation(2, "x") + ["--validation_single_file", single],
         "[validation] pipeline and single_file exclude each other"),
        ("single_file without tokenizers for an uncached prompt",
         [x for x in validation(2, "x") if x not in ("--validation_pipeline", PIPELINE)] +
         ["--validation_single_file", single, "--validation_single_file_config", no_text],
         "holds no tokenizers: give [validation] tokenizer and tokenizer_2")):
    out = os.path.join(WORK, "refused")
    r = train(out, 1, *extra, expect_ok=False)
    text_out = r.stdout + r.stderr
    if not check(r.returncode != 0 and fragment in text_out and "Exception raised from" not in text_out
                 and not os.path.exists(os.path.join(out, "metrics.jsonl")),
                 f"{what}: refused before training, naming '{fragment}'"):
        print(text_out[-3000:])
    shutil.rmtree(out, ignore_errors=True)

finish()
