#!/usr/bin/env python3
"""Issue 19: zero's full single-file export read back by diffusers' from_single_file.

  check_full_checkpoint_diffusers.py FULL.safetensors UNET_FOLDER UNET_CONFIG.json
FULL is full_checkpoint.safetensors (original SDXL layout) written by the trainer,
UNET_FOLDER the diffusers UNet export of the same run (the UNet the full file must
hold). diffusers converts the original names itself (its own mapping, independent of
zero's); every converted tensor must equal the export bit for bit. One JSON line.
"""
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file

full, unet_folder, config = sys.argv[1:4]
from diffusers import UNet2DConditionModel

with tempfile.TemporaryDirectory() as repo:
    os.makedirs(os.path.join(repo, "unet"))
    with open(config) as f, open(os.path.join(repo, "unet", "config.json"), "w") as g:
        g.write(f.read())
    model = UNet2DConditionModel.from_single_file(full, config=repo, subfolder="unet", local_files_only=True)
state = {k: v for k, v in model.state_dict().items()}
export = load_file(os.path.join(unet_folder, "diffusion_pytorch_model.safetensors"))
missing = sorted(set(export) - set(state))
extra = sorted(set(state) - set(export))
differ = [k for k in export if k in state and not torch.equal(state[k].to(export[k].dtype), export[k])]
print(json.dumps({"what": "diffusers UNet2DConditionModel.from_single_file(full_checkpoint) vs zero's unet export",
                  "tensors": len(export), "missing": missing[:5], "extra": extra[:5], "differ": differ[:5],
                  "pass": not missing and not extra and not differ}))
