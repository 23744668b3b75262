"""A generated folder of photo-sized JPEGs in class folders: the photo benchmarks' data (defaults/photo_folder.py,
numerics/bf16_parity.py, data/auto_backend_case.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = ("disc", "square", "triangle", "cross")
SHARES = (10, 5, 2, 1)  # images per class in this ratio: a 10x spread between the largest and the smallest class


def make_folder(root: Path, n: int, width: int, height: int, mode: str, seed: int = 0) -> dict[str, int]:
    """n JPEGs of width x height in class folders, counts in SHARES' ratio; returns the count per class.

    Each image: a disc, square, triangle or cross of random colour, place and scale on a blurred noise background,
    in `mode` ("RGB" or grey "L"), quality 90; no split folders (the detected default: data.val_fraction splits).
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    counts = [n * s // sum(SHARES) for s in SHARES]
    counts[0] += n - sum(counts)
    short = min(width, height)
    for c, (name, k) in enumerate(zip(CLASSES, counts, strict=True)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(k):
            bg = rng.integers(0, 120, (height // 10, width // 10, 3), dtype=np.uint8)
            im = Image.fromarray(bg).resize((width, height), Image.BILINEAR)
            d = ImageDraw.Draw(im)
            r = int(rng.integers(short // 8, short // 3))
            x, y = int(rng.integers(r, width - r)), int(rng.integers(r, height - r))
            col = tuple(int(v) for v in rng.integers(130, 256, 3))
            if c == 0:
                d.ellipse([x - r, y - r, x + r, y + r], fill=col)
            elif c == 1:
                d.rectangle([x - r, y - r, x + r, y + r], fill=col)
            elif c == 2:
                d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=col)
            else:
                d.rectangle([x - r, y - r // 4, x + r, y + r // 4], fill=col)
                d.rectangle([x - r // 4, y - r, x + r // 4, y + r], fill=col)
            im.convert(mode).save(root / name / f"{i:05d}.jpg", quality=90)
    return dict(zip(CLASSES, counts, strict=True))
