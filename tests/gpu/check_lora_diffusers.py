#!/usr/bin/env python3
"""zero's LoRA files, loaded by diffusers into the same base, against zero.

  check_lora_diffusers.py RUN_DIR BASE_WEIGHTS UNET_CONFIG_JSON [--device cpu|cuda]

RUN_DIR is a trainer output_dir of a LoRA run with merge_lora (fp32):
lora/pytorch_lora_weights.safetensors (diffusers/PEFT naming),
lora/lora_kohya.safetensors (kohya naming), unet/ (merged) and
export_check.safetensors (inputs and zero's output with the adapters).
Needs torch, safetensors, peft, transformers and diffusers (its source on
PYTHONPATH is enough). Prints one JSON line; exit 1 if a bound is missed:
diffusers + either file within 1e-5 rel. L2 of zero's output; diffusers'
merged UNet within 1e-6 of diffusers + the PEFT file.
"""
import json
import sys

import torch
from safetensors.torch import load_file

run_dir, base_weights, config_json = sys.argv[1:4]
device = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--device" else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel  # noqa: E402


def base_unet():
    unet = UNet2DConditionModel.from_config(json.load(open(config_json)))
    missing, unexpected = unet.load_state_dict(load_file(base_weights), strict=True), None
    return unet.to(device, torch.float32).eval()


io = load_file(f"{run_dir}/export_check.safetensors")
want = io["expected"].double()


def forward(unet):
    with torch.no_grad():
        out = unet(io["sample"].to(device), io["timestep"].to(device), io["encoder_hidden_states"].to(device),
                   added_cond_kwargs={"text_embeds": io["text_embeds"].to(device), "time_ids": io["time_ids"].to(device)}
                   ).sample
    return out.double().cpu()


def rel(a, b):
    return float((a - b).norm() / b.norm())


result = {"device": device, "torch": torch.__version__}
# diffusers/PEFT naming, through the loader StableDiffusionXLPipeline.load_lora_weights uses for the UNet.
unet = base_unet()
state, alphas, metadata = StableDiffusionXLPipeline.lora_state_dict(
    f"{run_dir}/lora/pytorch_lora_weights.safetensors", unet_config=unet.config, return_lora_metadata=True)
StableDiffusionXLPipeline.load_lora_into_unet(state, alphas, unet, adapter_name="zero_peft", metadata=metadata)
peft_out = forward(unet)
result["peft_vs_zero_rel_l2"] = rel(peft_out, want)
result["peft_layers"] = len([k for k in state if k.endswith("lora_A.weight")])
# kohya naming (lora_unet_input_blocks_…): converted by diffusers' own kohya path.
unet = base_unet()
state, alphas = StableDiffusionXLPipeline.lora_state_dict(f"{run_dir}/lora/lora_kohya.safetensors",
                                                          unet_config=unet.config)
StableDiffusionXLPipeline.load_lora_into_unet(state, alphas, unet, adapter_name="zero_kohya")
kohya_out = forward(unet)
result["kohya_vs_zero_rel_l2"] = rel(kohya_out, want)
# The merged export, a plain diffusers UNet folder.
merged = UNet2DConditionModel.from_pretrained(f"{run_dir}/unet").to(device, torch.float32).eval()
merged_out = forward(merged)
result["merged_vs_peft_rel_l2"] = rel(merged_out, peft_out)
result["merged_vs_zero_rel_l2"] = rel(merged_out, want)
result["base_vs_zero_rel_l2"] = rel(forward(base_unet()), want)  # how much the adapters change the output
ok = (result["peft_vs_zero_rel_l2"] <= 1e-5 and result["kohya_vs_zero_rel_l2"] <= 1e-5
      and result["merged_vs_peft_rel_l2"] <= 1e-6 and result["base_vs_zero_rel_l2"] > 1e-4)
result["passed"] = ok
print(json.dumps(result))
sys.exit(0 if ok else 1)
