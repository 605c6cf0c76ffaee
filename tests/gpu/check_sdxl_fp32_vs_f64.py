#!/usr/bin/env python3
"""Issue 19, strict fp32 on CUDA: the full SDXL UNet (diffusers' UNet2DConditionModel
with SDXL base's config, random weights as diffusers initializes them) in float64
on the GPU is the reference; this script writes the weights as a diffusers folder
and the inputs, then (second call, `compare`) compares zero's fp32 output.

  check_sdxl_fp32_vs_f64.py make DIR      -> DIR/unet/{config.json,diffusion_pytorch_model.safetensors},
                                             DIR/inputs.safetensors, DIR/expected_f64.safetensors
  check_sdxl_fp32_vs_f64.py compare DIR ZERO_OUTPUT.safetensors  -> one JSON line
Needs torch, safetensors and diffusers (source on PYTHONPATH).
"""
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file

SDXL_BASE_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280], "layers_per_block": 2, "cross_attention_dim": 2048,
    "attention_head_dim": [5, 10, 20], "use_linear_projection": True, "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816,
    "transformer_layers_per_block": [1, 2, 10], "norm_num_groups": 32,
}


def make(d):
    from diffusers import UNet2DConditionModel
    torch.manual_seed(19)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    model = UNet2DConditionModel(**SDXL_BASE_UNET)
    os.makedirs(os.path.join(d, "unet"), exist_ok=True)
    model.save_pretrained(os.path.join(d, "unet"), safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    inputs = {
        "sample": torch.randn(1, 4, 128, 128, generator=g),
        "timestep": torch.tensor([417.0]),
        "encoder_hidden_states": torch.randn(1, 77, 2048, generator=g),
        "text_embeds": torch.randn(1, 1280, generator=g),
        "time_ids": torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]]),
    }
    save_file(inputs, os.path.join(d, "inputs.safetensors"))
    model = model.to("cuda", torch.float64).eval()
    x = {k: v.to("cuda", torch.float64) for k, v in inputs.items()}
    with torch.no_grad():
        out = model(x["sample"], x["timestep"], x["encoder_hidden_states"],
                    added_cond_kwargs={"text_embeds": x["text_embeds"], "time_ids": x["time_ids"]}).sample
        # diffusers itself in strict fp32, for scale
        model32 = model.to(torch.float32)
        x32 = {k: v.float() for k, v in x.items()}
        out32 = model32(x32["sample"], x32["timestep"], x32["encoder_hidden_states"],
                        added_cond_kwargs={"text_embeds": x32["text_embeds"], "time_ids": x32["time_ids"]}).sample
    save_file({"expected_f64": out.cpu().contiguous(), "diffusers_fp32": out32.cpu().contiguous()},
              os.path.join(d, "expected_f64.safetensors"))
    print(json.dumps({"made": d, "params": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - t0, 1)}))


def compare(d, zero_out):
    ref = load_file(os.path.join(d, "expected_f64.safetensors"))
    want = ref["expected_f64"].double()
    got = load_file(zero_out)["sample"].double()
    rel = lambda a: float((a - want).norm() / want.norm())
    print(json.dumps({"what": "full SDXL UNet fp32 forward, TF32 off, vs diffusers float64 (random weights, 1x4x128x128)",
                      "zero_fp32_rel_l2": rel(got), "diffusers_fp32_rel_l2": rel(ref["diffusers_fp32"].double()),
                      "bound": 1e-5, "pass": rel(got) <= 1e-5}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        compare(sys.argv[2], sys.argv[3])
