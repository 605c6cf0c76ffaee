"""N JPEG/PNG/WebP images of mixed sizes and aspect ratios (smooth random
colour fields plus noise, so that encoders do real work) with .txt captions,
for prepare's throughput at 1024 px.   python3 bench/gpu/make_images.py OUTDIR N"""
import os, random, sys

import numpy as np
from PIL import Image

out, n = sys.argv[1], int(sys.argv[2])
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(7)
random.seed(7)
sizes = [(1024, 1024), (1365, 2048), (1200, 1600), (2048, 1152), (896, 1152), (1536, 1024), (1280, 1280)]
for i in range(n):
    h, w = sizes[i % len(sizes)]
    small = rng.uniform(0, 255, size=(h // 64 + 1, w // 64 + 1, 3)).astype(np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    arr = np.asarray(img).astype(np.int16) + rng.integers(-12, 13, size=(h, w, 3))
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    ext = ("jpg", "png", "webp")[i % 3] if i % 5 else "jpg"
    img.save(os.path.join(out, f"img{i:04d}.{ext}"), quality=92)
    with open(os.path.join(out, f"img{i:04d}.txt"), "w") as f:
        f.write(f"a photo of object {i} in {random.choice(['snow', 'a forest', 'a city', 'the sea'])}")
print("images written to", out)
