"""synthetic_jpeg: a generated, learnable JPEG image-folder dataset (made once, reused), and
`generate_once`, the atomic make-once helper every generated dataset uses."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from torchsprint.data.core import DATASETS, MODE, Splits, check_options, need_root
from torchsprint.data.sources.folders import image_files, scan_class_folders

SYNTHETIC_DEFAULTS = {
    "num_images": 1000,
    "val_images": 200,
    "size": [500, 375],
    "classes": 10,
    "quality": 90,
    "seed": 0,
}
_SHAPES = ("disc", "square", "triangle", "stripes", "ring")


def render_synthetic(rng: np.random.Generator, cls: int, n_classes: int, w: int, h: int) -> np.ndarray:
    """One (h, w, 3) uint8 picture of class `cls`: a class-specific shape and hue at a random place and
    scale over a random gradient with Gaussian noise (sigma 12), so it decodes like a photo (~70 KB
    at 500x375, quality 90) and a small CNN can learn it."""
    from PIL import Image, ImageDraw

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    a, b, c = rng.uniform(-0.3, 0.3, 3)
    base = rng.uniform(60, 190, 3)[None, None, :] + (a * xx + b * yy)[..., None] * np.array([1.0, 0.6, -0.4]) + c * 40
    img = base + rng.normal(0, 12, (h, w, 3))
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    hue = cls / n_classes
    import colorsys

    colour = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(hue, 0.85, rng.uniform(0.7, 1.0)))
    s = int(min(w, h) * rng.uniform(0.3, 0.6))
    x0, y0 = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
    shape = _SHAPES[cls % len(_SHAPES)]
    if shape == "disc":
        draw.ellipse([x0, y0, x0 + s, y0 + s], fill=colour)
    elif shape == "square":
        draw.rectangle([x0, y0, x0 + s, y0 + s], fill=colour)
    elif shape == "triangle":
        draw.polygon([(x0, y0 + s), (x0 + s, y0 + s), (x0 + s // 2, y0)], fill=colour)
    elif shape == "stripes":
        for k in range(0, s, max(2, s // 6)):
            draw.rectangle([x0 + k, y0, x0 + k + max(1, s // 12), y0 + s], fill=colour)
    else:
        draw.ellipse([x0, y0, x0 + s, y0 + s], outline=colour, width=max(2, s // 8))
    return np.asarray(im)


def generate_once(folder: Path, params: dict, write) -> Path:
    """Make a generated dataset at `folder` once: `write(tmp)` fills a temporary sibling, which gets a
    done.json of `params` and is renamed into place; a complete folder is reused as it is.

    The rename is atomic, so concurrent processes (test workers, DDP ranks) never see half a dataset;
    when another process finished first, its copy is kept and ours discarded.
    """
    if (folder / "done.json").is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    (tmp / "done.json").write_text(json.dumps(params))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def generate_synthetic_jpeg(
    folder: Path, *, num_images: int, val_images: int, size, classes: int, quality: int, seed: int
) -> Path:
    """Write an image-folder tree folder/{train,val}/<class>/<i>.jpg once; reuse it when complete (generate_once)."""
    w, h = size

    def write(tmp: Path) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        names = [f"class_{c:02d}_{_SHAPES[c % len(_SHAPES)]}" for c in range(classes)]
        for split, n in (("train", num_images), ("val", val_images)):
            for c in names:
                (tmp / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                cls = i % classes
                Image.fromarray(render_synthetic(rng, cls, classes, w, h)).save(
                    tmp / split / names[cls] / f"{i:06d}.jpg", quality=quality
                )

    return generate_once(
        folder,
        {
            "num_images": num_images,
            "val_images": val_images,
            "size": [w, h],
            "classes": classes,
            "quality": quality,
            "seed": seed,
        },
        write,
    )


@DATASETS.register("synthetic_jpeg")
def synthetic_jpeg(data_cfg) -> Splits:
    """Generated JPEGs in an image-folder layout under data.root, made once and reused.

    data.options: num_images (train, default 1000), val_images (200), size [w, h] ([500, 375], about
    ImageNet's typical photo), classes (10), quality (90), seed (0). Each parameter set gets its own
    subfolder, so changing them never mixes datasets.
    """
    need_root(data_cfg, "folder to generate the JPEG files into")
    check_options(data_cfg, {**{k: f"default {v}" for k, v in SYNTHETIC_DEFAULTS.items()}, **MODE})
    p = SYNTHETIC_DEFAULTS | {k: v for k, v in data_cfg.options.items() if k != "mode"}
    w, h = p["size"]
    folder = Path(data_cfg.root).expanduser() / (
        f"synthetic_jpeg-n{p['num_images']}-v{p['val_images']}-{w}x{h}-c{p['classes']}-q{p['quality']}-s{p['seed']}"
    )
    generate_synthetic_jpeg(
        folder,
        num_images=p["num_images"],
        val_images=p["val_images"],
        size=(w, h),
        classes=p["classes"],
        quality=p["quality"],
        seed=p["seed"],
    )
    classes, train = scan_class_folders(folder / "train")
    _, val = scan_class_folders(folder / "val")
    mode = data_cfg.options.get("mode", "RGB")
    return Splits(
        image_files(train, data_cfg, mode),
        image_files(val, data_cfg, mode),
        classes,
        in_channels=1 if mode == "GRAY" else 3,
    )
