"""zero's `sample` against diffusers' StableDiffusionXLPipeline on the same
tiny models (the tests' tiny pipeline, a UNet the trainer exported), CPU,
fp32: the same prompt, seed, steps, guidance and size must give the same
8-bit image (at most 1 step of rounding apart, from float summation order).

  PYTHONPATH=.deps/diffusers/src python3 bench/gpu/check_sample_vs_diffusers.py BUILD WORKDIR
"""
import json, os, subprocess, sys

import numpy as np
import torch
from PIL import Image

BUILD, WORK = sys.argv[1:3]
sys.path.insert(0, "tests/sdxl_prepare")
import tiny_pipeline  # noqa: E402
from diffusers import AutoencoderKL, EulerDiscreteScheduler, DPMSolverMultistepScheduler, StableDiffusionXLPipeline, UNet2DConditionModel  # noqa: E402
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
os.makedirs(WORK, exist_ok=True)
P = os.path.join(WORK, "pipeline")
if not os.path.exists(P):
    tiny_pipeline.make_pipeline(P, os.path.abspath("tests/fixtures"))
unet_cfg = os.path.join(WORK, "unet.json")
tiny_pipeline.write_tiny_unet_config(unet_cfg)
runs = os.path.join(WORK, "train")
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
subprocess.run(["mpirun", "-np", "1", f"{BUILD}/examples/sdxl/train", "--config", "examples/sdxl/configs/tiny.toml",
                "--model_config", unet_cfg, "--output_dir", runs, "--overwrite", "--steps", "1", "--warmup_steps", "0",
                "--checkpoint_every", "0", "--save_final", "false", "--export_unet", "true", "--device", "cpu"],
               check=True, env=env, capture_output=True)
pipe = StableDiffusionXLPipeline(
    vae=AutoencoderKL.from_pretrained(os.path.join(P, "vae")),
    text_encoder=CLIPTextModel.from_pretrained(os.path.join(P, "text_encoder")),
    text_encoder_2=CLIPTextModelWithProjection.from_pretrained(os.path.join(P, "text_encoder_2")),
    tokenizer=CLIPTokenizer.from_pretrained(os.path.join(P, "tokenizer")),
    tokenizer_2=CLIPTokenizer.from_pretrained(os.path.join(P, "tokenizer_2")),
    unet=UNet2DConditionModel.from_pretrained(os.path.join(runs, "unet")),
    scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                     timestep_spacing="leading", steps_offset=1),
    force_zeros_for_empty_prompt=True)
pipe.to(torch.float32)
euler = pipe.scheduler
results = []
for sampler, negative, guidance in (("euler", "", 5.0), ("euler", "blurry", 5.0), ("dpmpp_2m_karras", "", 5.0),
                                    ("euler", "", 1.0)):
    pipe.scheduler = euler  # each row sets its sampler (the pipeline keeps the last one it was given)
    if sampler == "dpmpp_2m_karras":
        pipe.scheduler = DPMSolverMultistepScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                     timestep_spacing="leading", steps_offset=1,
                                                     use_karras_sigmas=True, algorithm_type="dpmsolver++",
                                                     solver_order=2)
    out = os.path.join(WORK, f"zero-{sampler}-{negative or 'none'}-{guidance}.png")
    cmd = [f"{BUILD}/examples/sdxl/sample", "--pipeline", P, "--unet", os.path.join(runs, "unet"), "--prompt",
           "a red fox in snow", "--steps", "6", "--guidance", str(guidance), "--seed", "3", "--height", "32",
           "--width", "48", "--sampler", sampler, "--output", out]
    if negative:
        cmd += ["--negative_prompt", negative]
    subprocess.run(cmd, check=True, capture_output=True)
    ours = np.asarray(Image.open(out).convert("RGB")).astype(int)
    ref = pipe("a red fox in snow", negative_prompt=negative or None, num_inference_steps=6, guidance_scale=guidance,
               height=32, width=48, generator=torch.Generator("cpu").manual_seed(3), output_type="np").images[0]
    ref8 = (ref * 255).round().astype(int)
    diff = np.abs(ours - ref8)
    row = {"sampler": sampler, "negative_prompt": negative, "guidance": guidance, "max_abs_diff_uint8": int(diff.max()),
           "pixels_differing": int((diff > 0).sum()), "pixels": int(diff.size), "ok": bool(diff.max() <= 1)}
    print(json.dumps(row), flush=True)
    results.append(row)
json.dump(results, open(os.path.join(WORK, "sample_vs_diffusers.json"), "w"), indent=1)
sys.exit(0 if all(r["ok"] for r in results) else 1)
