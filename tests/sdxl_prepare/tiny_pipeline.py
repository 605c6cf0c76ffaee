"""The tiny SDXL pipeline folder the prepare and sample tests run on: the
tiny VAE / text encoders of tests/fixtures/sdxl_vae_clip plus tokenizers cut
down to their 1000-token vocabulary, and a tiny UNet config for their text
dims (80-wide prompt embeddings, 40-wide pooled)."""
import json
import os
import shutil


def make_pipeline(root, fixtures):
    """The fixture's models plus tokenizers whose ids fit their 1000-token
    vocabulary: the fixture tokenizer's 512 byte tokens and first merges,
    <|startoftext|> 998 (both encoders' bos), <|endoftext|> 999 for the first
    (its pooled row is the argmax, as SDXL's config says) and 997 for the
    second (its config's eos_token_id)."""
    os.makedirs(root)
    models = os.path.join(fixtures, "sdxl_vae_clip", "pipeline")
    for name in ("vae", "text_encoder", "text_encoder_2"):
        os.symlink(os.path.join(models, name), os.path.join(root, name))
    index = json.load(open(os.path.join(models, "model_index.json")))
    index["tokenizer"] = index["tokenizer_2"] = ["transformers", "CLIPTokenizer"]
    json.dump(index, open(os.path.join(root, "model_index.json"), "w"))
    for name, eos, merge_count in (("tokenizer", 999, 486), ("tokenizer_2", 997, 485)):
        source = os.path.join(fixtures, "clip_tokenizer", name)
        target = os.path.join(root, name)
        os.makedirs(target)
        for f in ("tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(source, f), target)
        vocab = json.load(open(os.path.join(source, "vocab.json")))
        merges = open(os.path.join(source, "merges.txt"), encoding="utf-8").read().splitlines()
        kept_merges = merges[1:1 + merge_count]
        small = {token: i for token, i in vocab.items() if i < 512 + merge_count}
        small["<|startoftext|>"] = 998
        small["<|endoftext|>"] = eos
        if name == "tokenizer_2":
            small["<|padding-unused|>"] = 999  # keeps the ids dense up to 999
        json.dump(small, open(os.path.join(target, "vocab.json"), "w", encoding="utf-8"), ensure_ascii=False)
        with open(os.path.join(target, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join([merges[0], *kept_merges]) + "\n")


def write_tiny_unet_config(path):
    json.dump({"sample_size": 32, "in_channels": 4, "out_channels": 4,
               "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
               "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
               "block_out_channels": [32, 64], "layers_per_block": 1, "cross_attention_dim": 80,
               "attention_head_dim": [2, 4], "use_linear_projection": True, "addition_embed_type": "text_time",
               "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 88,
               "transformer_layers_per_block": [1, 1], "norm_num_groups": 32}, open(path, "w"))


def fresh_workdir(work, source):
    """An empty WORK holding the tiny pipeline (WORK/pipeline) and the tiny
    UNet config of its text widths (WORK/unet.json); returns both paths."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    pipeline = os.path.join(work, "pipeline")
    make_pipeline(pipeline, os.path.join(source, "tests", "fixtures"))
    unet_config = os.path.join(work, "unet.json")
    write_tiny_unet_config(unet_config)
    return pipeline, unet_config
