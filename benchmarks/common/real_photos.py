"""A folder of real photographs: crops of the photos scikit-image ships in its wheel (astronaut, coffee, chelsea the
cat, a rocket launch, a motorcycle pair, brick, grass and gravel textures...), taken straight from the wheel file
(`pip download scikit-image --no-deps`; nothing installed). Real pixel statistics (what a PNG or JPEG decoder and a
model meet in users' photos) in any number, size and class balance: each class is a group of source photos, each
image a random crop of one of them (scale, position, flip), resized to side x side.
"""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "scikit-image==0.26.0"
# Four classes of real photos; the fourth the smallest by default (COUNTS: 14x between the largest and the smallest,
# the imbalance of the user's folder in BENCHMARKS.md "Imbalanced classes").
GROUPS = {
    "people_and_food": ["astronaut.png", "coffee.png"],
    "animals_and_sky": ["chelsea.png", "rocket.jpg"],
    "vehicles": ["motorcycle_left.png", "motorcycle_right.png"],
    "textures": ["brick.png", "grass.png", "gravel.png"],
}
COUNTS = (1400, 700, 424, 100)  # 2,624 images, as the user's folder


def wheel(folder: Path) -> Path:
    """The scikit-image wheel in `folder`, downloaded from the package registry if absent."""
    found = sorted(folder.glob("scikit_image-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", WHEEL, "--no-deps", "-d", str(folder)], check=True
        )
        found = sorted(folder.glob("scikit_image-*.whl"))
    return found[-1]


def sources(folder: Path) -> dict[str, list[np.ndarray]]:
    """Each group's photos as uint8 RGB arrays, read from the wheel."""
    from PIL import Image

    out: dict[str, list[np.ndarray]] = {}
    with zipfile.ZipFile(wheel(folder)) as z:
        for group, names in GROUPS.items():
            out[group] = [np.asarray(Image.open(io.BytesIO(z.read(f"skimage/data/{n}"))).convert("RGB")) for n in names]
    return out


def make_real_photos(
    root: Path, cache: Path, side: int = 300, counts=COUNTS, mode: str = "L", fmt: str = "png", seed: int = 0
) -> dict[str, int]:
    """counts[i] crops of group i's photos, side x side, in `mode` ("L" grey or "RGB"), as `fmt` files in class
    folders under `root` (no split folders: data.val_fraction splits them); returns the count per class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = sources(cache)
    made = {}
    for (group, pics), n in zip(photos.items(), counts, strict=True):
        (root / group).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pic = pics[int(rng.integers(len(pics)))]
            h, w = pic.shape[:2]
            s = int(min(h, w) * rng.uniform(0.35, 1.0))
            y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
            im = Image.fromarray(pic[y : y + s, x : x + s]).resize((side, side), Image.BICUBIC)
            if rng.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            im.convert(mode).save(root / group / f"{i:05d}.{fmt}", **({"quality": 90} if fmt == "jpg" else {}))
        made[group] = n
    return made
