"""A diffusers SDXL pipeline folder at full size with random weights (no real
checkpoint can be downloaded on the GPU machine): vae/, text_encoder/,
text_encoder_2/, unet/ with SDXL 1.0's configs, bf16 safetensors, and tokenizer/ +
tokenizer_2/ copied from the repo's CLIP-format test vocabularies (their ids
fit the 49408-entry embedding). For speed measurements of prepare and the
trainer's validation sampling, not for image quality.

    PYTHONPATH=.deps/diffusers/src python3 bench/gpu/make_full_pipeline.py OUTDIR
"""
import json, os, shutil, sys

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(1)
dev = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(dev):
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
                        block_out_channels=(128, 256, 512, 512), sample_size=1024, scaling_factor=0.13025,
                        force_upcast=True, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4)
    te1 = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                                       projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=49408, hidden_size=1280, intermediate_size=5120,
                                                     num_hidden_layers=32, num_attention_heads=20,
                                                     max_position_embeddings=77, hidden_act="gelu",
                                                     projection_dim=1280, bos_token_id=0, eos_token_id=2,
                                                     pad_token_id=1))
    unet = UNet2DConditionModel(  # SDXL 1.0's unet/config.json
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32)
for name, model in (("vae", vae), ("text_encoder", te1), ("text_encoder_2", te2), ("unet", unet)):
    model.to(torch.bfloat16).save_pretrained(os.path.join(out, name), safe_serialization=True)
for name in ("tokenizer", "tokenizer_2"):
    shutil.copytree(os.path.join("tests/fixtures/clip_tokenizer", name), os.path.join(out, name), dirs_exist_ok=True)
json.dump({"_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.36.0",
           "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
           "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
           "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
           "force_zeros_for_empty_prompt": True}, open(os.path.join(out, "model_index.json"), "w"), indent=2)
print("pipeline written to", out, {n: sum(p.numel() for p in m.parameters()) for n, m in
                                    (("vae", vae), ("te1", te1), ("te2", te2))})
