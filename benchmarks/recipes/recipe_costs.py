"""What each recipe switch costs in training throughput, per data backend, side by side.

For every backend (cpu, memory) the plain config and the config with one switch on are timed with
`torchsprint.commands.bench.main.measure` (the real engine step, the same code `torchsprint bench` runs), the
variants interleaved in rotating order inside every repeat so machine load hits all alike. Reports the
median images/s and the median per-repeat ratio to the plain run of the same backend.

    python -m benchmarks.recipes.recipe_costs [--repeats 5] [--steps 30] [--root /tmp/recipe_costs_data]
"""

from __future__ import annotations

import argparse
import statistics
import time

from torchsprint import config
from torchsprint.commands.bench.measure import measure

# 40x40 RGB JPEGs (generated once), small_cnn (width 8) on 32-pixel crops: a step of a few ms on 2 CPU cores,
# so what a switch adds per step shows.
BASE = [
    "data.dataset=synthetic_jpeg",
    "data.options={num_images: 512, val_images: 64, size: [40, 40], classes: 10}",
    "data.batch_size=64",
    "model.args={width: 8}",
    "log.tensorboard=false",
    "log.progress=false",
    "data.train.transforms=[random_resized_crop: 32, hflip, normalize: imagenet]",
    "data.eval.transforms=[center_crop: 32, normalize: imagenet]",
]

SWITCHES = {  # name -> overrides (the recipe switches of docs/recipes.md)
    "plain": [],
    "ema": ["ema.enabled=true"],
    "ema every 4 steps": ["ema.enabled=true", "ema.every_steps=4"],
    "repeated_aug 3": ["data.repeated_aug=3"],
    "label_smoothing 0.1": ["loss.label_smoothing=0.1"],
}
EXTRA: dict[str, list[str]] = {}  # filled by the augmentation switches when they exist (see main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--root", default="/tmp/recipe_costs_data")
    ap.add_argument("--backends", default="cpu,memory")
    ap.add_argument("--switches", default=None, help="comma-separated names (default: all)")
    args = ap.parse_args()
    switches = dict(SWITCHES, **EXTRA)
    names = args.switches.split(",") if args.switches else list(switches)
    cfgs = {
        (be, n): config.load(None, [*BASE, f"data.root={args.root}", f"data.backend={be}", *switches[n]])
        for be in args.backends.split(",")
        for n in names
    }
    backends = args.backends.split(",")
    for key, c in list(cfgs.items()):  # generate the JPEGs and warm every code path once
        if key[0] not in backends:
            continue
        try:
            measure(c, 2, 1)
        except Exception as e:  # a backend this machine cannot run (gpu without CUDA): say so, measure the others
            print(f"backend {key[0]}: {type(e).__name__}: {str(e).splitlines()[0][:200]}; left out", flush=True)
            backends.remove(key[0])
    cfgs = {k: c for k, c in cfgs.items() if k[0] in backends}
    args.backends = ",".join(backends)
    keys = list(cfgs)
    ips: dict = {k: [] for k in keys}
    for r in range(args.repeats):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            ips[k].append(measure(cfgs[k], args.steps, args.warmup)["images_per_s"])
            print(f"repeat {r + 1}: {k[0]} {k[1]}: {ips[k][-1]:.0f} images/s", flush=True)  # kept if stopped
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {args.repeats} repeats x {args.steps} steps, median images/s "
        "(ratio: median of per-repeat ratios to 'plain' on the same backend)"
    )
    print("| switch | " + " | ".join(f"{be} images/s | {be} ratio" for be in args.backends.split(",")) + " |")
    print("|---|" + "---|---|" * len(args.backends.split(",")))
    for n in names:
        cells = []
        for be in args.backends.split(","):
            v, p = ips[(be, n)], ips[(be, "plain")] if (be, "plain") in ips else None
            ratio = statistics.median(a / b for a, b in zip(v, p)) if p else float("nan")
            cells.append(f"{statistics.median(v):.0f} | {ratio:.2f}x")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
