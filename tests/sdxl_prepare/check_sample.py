"""examples/sdxl/sample end to end (stdlib only) on the tiny pipeline
(tiny_pipeline.py) and a tiny UNet exported by the trainer after one step:

1. a PNG of the asked size (parsed and decoded here: signature, IHDR, zlib,
   row filters), not a constant image, and the latents it came from;
2. the same seed gives the same bytes; another seed, a negative prompt, no
   guidance or another sampler each give another image;
3. --num_images 2: x-0.png is seed S's image, x-1.png seed S+1's;
4. bad input (missing pipeline folder, missing UNet, unknown sampler) exits
   non-zero naming what is wrong, without C++ frames;
5. an original single file (make_single_file: the pipeline's VAE and text
   encoders and the trained UNet under Stability AI's names, no config
   metadata, as A1111 and ComfyUI load): --single_file with
   --single_file_config (the architectures, tokenizers and scheduler from a
   pipeline folder) gives the same PNG bytes as --pipeline --unet, with its
   own UNet and with --unet; without --single_file_config the tiny models
   are refused naming the mismatch and the option; --single_file_config
   without --single_file, and a config folder without unet/config.json, are
   refused naming them.

  check_sample.py SAMPLE TRAIN MAKE_SINGLE_FILE MPIEXEC SOURCE_DIR WORKDIR [mpiexec flags...]
"""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import tiny_pipeline  # noqa: E402
from e2e_harness import check, finish, run  # noqa: E402
from png_reader import read_png  # noqa: E402

SAMPLE, TRAIN, MAKE_SINGLE_FILE, MPIEXEC, SOURCE, WORK = sys.argv[1:7]
MPI_FLAGS = sys.argv[7:]

PIPELINE, unet_config = tiny_pipeline.fresh_workdir(WORK, SOURCE)
runs = os.path.join(WORK, "train")
run([MPIEXEC, "-np", "1", *MPI_FLAGS, TRAIN, "--config", os.path.join(SOURCE, "examples", "sdxl", "configs", "tiny.toml"),
     "--model_config", unet_config, "--output_dir", runs, "--steps", "1", "--warmup_steps", "0",
     "--checkpoint_every", "0", "--save_final", "false", "--export_unet", "true"])
UNET = os.path.join(runs, "unet")
check(os.path.isfile(os.path.join(UNET, "config.json")), "the trainer exported a diffusers UNet folder")


def sample(output, *extra, expect_ok=True):
    return run([SAMPLE, "--pipeline", PIPELINE, "--unet", UNET, "--prompt", "a red fox in snow", "--steps", "4",
                "--height", "32", "--width", "48", "--output", output, *extra], expect_ok=expect_ok)


def png(name):
    return os.path.join(WORK, name)


# 1. One image.
result = sample(png("a.png"), "--seed", "3", "--save_latents", png("a.safetensors"))
width, height, rows = read_png(png("a.png"))
check((width, height) == (48, 32), f"the PNG is 48x32 RGB: {width}x{height}")
check(len(set(b"".join(rows))) > 16, "the image is not constant")
check(os.path.getsize(png("a.safetensors")) > 4 * 4 * 6 * 4, "the latents were saved")
check("wrote" in result.stdout and " s\n" in result.stdout, "prints the seconds per image")
check(not [f for f in os.listdir(WORK) if ".tmp" in f], "no temporary file is left")

# 2. Determinism and what changes the image.
sample(png("a2.png"), "--seed", "3")
check(open(png("a.png"), "rb").read() == open(png("a2.png"), "rb").read(), "the same seed gives the same bytes")
for name, extra in (("seed4.png", ["--seed", "4"]), ("negative.png", ["--seed", "3", "--negative_prompt", "blurry"]),
                    ("noguidance.png", ["--seed", "3", "--guidance", "1"]),
                    ("dpm.png", ["--seed", "3", "--sampler", "dpmpp_2m_karras"])):
    sample(png(name), *extra)
    check(read_png(png(name))[2] != rows, f"{' '.join(extra)} gives another image")

# 3. Several images.
sample(png("many.png"), "--seed", "3", "--num_images", "2")
check(open(png("many-0.png"), "rb").read() == open(png("a.png"), "rb").read(), "x-0.png is seed 3's image")
check(open(png("many-1.png"), "rb").read() == open(png("seed4.png"), "rb").read(), "x-1.png is seed 4's image")

# 4. Bad input.
for what, cmd, fragment in (
        ("a missing pipeline folder", [SAMPLE, "--pipeline", os.path.join(WORK, "nowhere"), "--prompt", "x",
                                       "--output", png("x.png")], "nowhere"),
        ("a missing UNet", [SAMPLE, "--pipeline", PIPELINE, "--unet", os.path.join(WORK, "no-unet"), "--prompt", "x",
                            "--output", png("x.png")], "no-unet"),
        ("an unknown sampler", [SAMPLE, "--pipeline", PIPELINE, "--unet", UNET, "--prompt", "x", "--sampler", "ddim",
                                "--output", png("x.png")], "--sampler")):
    r = run(cmd, expect_ok=False)
    text = r.stdout + r.stderr
    check(r.returncode != 0 and fragment in text and "Exception raised from" not in text,
          f"{what} exits non-zero naming '{fragment}'")
check(not os.path.exists(png("x.png")), "no image after a refusal")

# 5. An original single file.
SINGLE = os.path.join(WORK, "original.safetensors")
run([MAKE_SINGLE_FILE, PIPELINE, SINGLE, UNET])
CONFIG = os.path.join(WORK, "single-file-config")  # a pipeline folder's configs, tokenizers and scheduler
os.makedirs(os.path.join(CONFIG, "unet"))
for name in os.listdir(PIPELINE):
    os.symlink(os.path.join(PIPELINE, name), os.path.join(CONFIG, name))
shutil.copy(os.path.join(UNET, "config.json"), os.path.join(CONFIG, "unet", "config.json"))


def sample_single(output, *extra, expect_ok=True):
    return run([SAMPLE, "--single_file", SINGLE, "--prompt", "a red fox in snow", "--steps", "4", "--height", "32",
                "--width", "48", "--seed", "3", "--output", output, *extra], expect_ok=expect_ok)


sample_single(png("single.png"), "--single_file_config", CONFIG)
check(open(png("single.png"), "rb").read() == open(png("a.png"), "rb").read(),
      "--single_file --single_file_config: the same bytes as --pipeline --unet (the file's own UNet)")
sample_single(png("single-unet.png"), "--single_file_config", CONFIG, "--unet", UNET)
check(open(png("single-unet.png"), "rb").read() == open(png("a.png"), "rb").read(),
      "--single_file with --unet: the same bytes")
tokenizers = ["--tokenizer", os.path.join(PIPELINE, "tokenizer"), "--tokenizer_2", os.path.join(PIPELINE, "tokenizer_2")]
no_unet_config = os.path.join(WORK, "config-without-unet")
os.makedirs(no_unet_config)
for name in ("vae", "text_encoder", "text_encoder_2"):
    os.symlink(os.path.join(PIPELINE, name), os.path.join(no_unet_config, name))
for what, extra, fragments in (
        ("SDXL 1.0's architectures (no --single_file_config)", tokenizers,
         ["does not match", "--single_file_config DIR"]),
        ("a config folder without unet/config.json", ["--single_file_config", no_unet_config, *tokenizers],
         [no_unet_config, "unet/config.json"]),
        ("no tokenizers", [], ["holds no tokenizers", "--tokenizer"])):
    r = sample_single(png("x.png"), *extra, expect_ok=False)
    text = r.stdout + r.stderr
    check(r.returncode != 0 and all(f in text for f in fragments) and "Exception raised from" not in text,
          f"{what}: refused naming {fragments}")
r = run([SAMPLE, "--pipeline", PIPELINE, "--single_file_config", CONFIG, "--prompt", "x", "--output", png("x.png")],
        expect_ok=False)
check(r.returncode != 0 and "--single_file_config requires --single_file" in r.stdout + r.stderr,
      "--single_file_config without --single_file is refused")
check(not os.path.exists(png("x.png")), "no image after a refusal")

finish()
