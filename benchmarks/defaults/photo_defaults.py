"""Defaults for a user's own photos: which model trains a folder of photo-sized images best per CPU minute.

Generates a folder of 300x300 JPEG "photos" (4 classes of shapes on textured backgrounds, 25% kept apart for
validation), then trains each candidate model with the default preprocessing torchsprint chooses for such a
folder (data/detect.py: random resized crop + flip at the rule's size, resize + centre crop for eval) for a few
epochs on the CPU, and prints train images/s, the final val top-1 and the wall time per candidate as JSON.
The old default (small_cnn at the native size) is measured for speed only (a few steps: a full run takes hours).

    nice -n 10 python -m benchmarks.defaults.photo_defaults --images 2000 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def make_photos(root: Path, n: int, size: int = 300, seed: int = 0) -> Path:
    """n JPEGs of `size`x`size`: a disc, square, triangle or cross of random colour, place and scale on noise."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    classes = ("disc", "square", "triangle", "cross")
    for i in range(n):
        c = i % len(classes)
        split = "val" if (i // 4) % 4 == 3 else "train"
        bg = rng.integers(0, 120, (size // 10, size // 10, 3), dtype=np.uint8)
        im = Image.fromarray(bg).resize((size, size), Image.BILINEAR)
        d = ImageDraw.Draw(im)
        r = int(rng.integers(size // 8, size // 3))
        x, y = (int(v) for v in rng.integers(r, size - r, 2))
        col = tuple(int(v) for v in rng.integers(130, 256, 3))
        if classes[c] == "disc":
            d.ellipse([x - r, y - r, x + r, y + r], fill=col)
        elif classes[c] == "square":
            d.rectangle([x - r, y - r, x + r, y + r], fill=col)
        elif classes[c] == "triangle":
            d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=col)
        else:
            d.rectangle([x - r, y - r // 4, x + r, y + r // 4], fill=col)
            d.rectangle([x - r // 4, y - r, x + r // 4, y + r], fill=col)
        out = root / split / classes[c] / f"{i:05d}.jpg"
        out.parent.mkdir(parents=True, exist_ok=True)
        im.save(out, quality=90)
    return root


def train_one(root: Path, out: Path, overrides: list[str]) -> dict:
    from torchsprint import config
    from torchsprint.train.run import train

    cfg = config.load(
        None,
        [
            f"data.root={root}",
            f"run.dir={out}",
            "log.progress=false",
            "log.tensorboard=false",
            "eval.per_class=false",
            "data.backend=cpu",
            *overrides,
        ],
    )
    t0 = time.perf_counter()
    s = train(cfg, quiet=True)
    return {
        "model": cfg.model.name,
        "transforms": cfg.data.train.transforms,
        "lr": cfg.optim.lr,
        "warmup_epochs": cfg.sched.warmup_epochs,
        "train_images_per_s": round(s["train_images_per_s"], 1),
        "val_top1": round(s["final"]["val/top1"], 4),
        "val_balanced_acc": round(s["final"].get("val/balanced_acc", float("nan")), 4),
        "wall_s": round(time.perf_counter() - t0, 1),
        "epochs": cfg.run.epochs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument(
        "--models",
        default="resnet18,mobilenet_v3_small",
        help="comma-separated; a model may carry its own overrides after '+', applied after the photo lr "
        "and warm-up, e.g. mobilenet_v3_small+optim.name=adamw+optim.lr=0.002",
    )
    ap.add_argument(
        "--old-default-steps", type=int, default=5, help="steps of small_cnn at the native 300x300 (speed only)"
    )
    args = ap.parse_args()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = make_photos(Path(tmp) / "photos", args.images)
        from torchsprint.data.detect import PHOTO_LR_PER_256, PHOTO_WARMUP_EPOCHS

        # Every candidate with the lr and warm-up the photo defaults choose for the default batch of 64 (naming a
        # model turns the defaults' choice of them off).
        sched = [f"optim.lr={PHOTO_LR_PER_256 * 64 / 256}", f"sched.warmup_epochs={PHOTO_WARMUP_EPOCHS}"]
        for i, entry in enumerate(args.models.split(",")):
            name, *own = entry.split("+")
            rows.append(
                train_one(
                    root, Path(tmp) / f"run{i}", [f"model.name={name}", f"run.epochs={args.epochs}", *sched, *own]
                )
            )
            rows[-1]["overrides"] = own
            print(json.dumps(rows[-1]), flush=True)
        if not args.old_default_steps:
            print(
                json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "images": args.images, "rows": rows})
            )
            return
        old = train_one(
            root,
            Path(tmp) / "old",
            [
                "model.name=small_cnn",
                "data.train.transforms=[]",
                "data.eval.transforms=[]",
                f"run.max_steps={args.old_default_steps}",
                "run.epochs=1",
            ],
        )
        old["note"] = f"old default, native 300x300, {args.old_default_steps} steps: speed only"
        rows.append(old)
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": "cpu", "threads": torch.get_num_threads(), "images": args.images, "rows": rows}))


if __name__ == "__main__":
    main()
