"""Do the recipe techniques pay off? A plain run against the same run with the recipe switches, on generated JPEGs.

Both train small_cnn on the same `synthetic_jpeg` folder (10 classes) with the same schedule and seeds;
the recipe adds label smoothing 0.1, Mixup 0.2 / CutMix 1.0, TrivialAugmentWide and an EMA of the
weights (the switches of configs/recipes/torchvision_resnet50.yaml). Reports the final validation top-1
of each (the EMA's for the recipe) per seed.

    python -m benchmarks.recipes.recipe_vs_plain [--epochs 15] [--seeds 0,1] [--root /tmp/recipe_vs_plain]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from torchsprint import config
from torchsprint.train.run import train

DATA = [
    "data.dataset=synthetic_jpeg",
    "data.options={num_images: 1000, val_images: 300, size: [40, 40], classes: 10}",
    "data.batch_size=64",
    "model.args={width: 16}",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "checkpoint.every_epochs=null",
    "data.backend=cpu",
    "data.eval.transforms=[center_crop: 32, normalize: imagenet]",
]
PLAIN = ["data.train.transforms=[random_resized_crop: 32, hflip, normalize: imagenet]"]
RECIPE = [
    "data.train.transforms=[random_resized_crop: 32, hflip, trivial_augment_wide, normalize: imagenet]",
    "loss.label_smoothing=0.1",
    "mix.mixup_alpha=0.2",
    "mix.cutmix_alpha=1.0",
    "ema.enabled=true",
    "ema.decay=0.99",
    "ema.warmup=true",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--root", default="/tmp/recipe_vs_plain")
    args = ap.parse_args()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        out = {}
        for name, extra in (("plain", PLAIN), ("recipe", RECIPE)):
            with tempfile.TemporaryDirectory() as d:
                cfg = config.load(
                    None,
                    [
                        *DATA,
                        f"data.root={args.root}",
                        f"run.epochs={args.epochs}",
                        f"run.seed={seed}",
                        *extra,
                        f"run.dir={d}/run",
                    ],
                )
                s = train(cfg, quiet=True)
            out[name] = s["final"].get("ema/val/top1", s["final"]["val/top1"])
            out[name + "_raw"] = s["final"]["val/top1"]
        rows.append((seed, out))
        print(
            f"seed {seed}: plain {out['plain']:.4f}, recipe (EMA) {out['recipe']:.4f} (its raw weights "
            f"{out['recipe_raw']:.4f})",
            flush=True,
        )
    print(
        f"median: plain {statistics.median(o['plain'] for _, o in rows):.4f}, recipe "
        f"{statistics.median(o['recipe'] for _, o in rows):.4f} ({args.epochs} epochs, {len(rows)} seeds)"
    )


if __name__ == "__main__":
    main()
