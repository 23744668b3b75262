"""Throughput cost of the recipe augmentations: Mixup/CutMix and the automatic augmentations,
each added to a CIFAR-like run (32x32 JPEGs, random_crop + hflip, small_cnn), per data backend.

Every figure is `torchsprint.commands.bench.main.measure`: the real engine step (`torchsprint bench` calls the same
function), images/s over --steps timed steps after --warmup. Variants alternate within each repeat
(A B C A B C ...) so load from other processes hits them alike; the median over repeats is reported
with the min-max range.

    .venv/bin/python -m benchmarks.recipes.aug_cost --steps 20 --warmup 3 --repeats 3 --root /tmp/aug-bench
"""

from __future__ import annotations

import argparse
import statistics

BASE_SPEC = "[random_crop: {size: 32, padding: 4}, hflip"
SWITCHES = {
    "baseline (crop + flip)": [],
    "+ mixup 0.2 / cutmix 1.0": ["mix.mixup_alpha=0.2", "mix.cutmix_alpha=1.0"],
    "+ trivial_augment_wide": ["+trivial_augment_wide"],
    "+ rand_augment (n=2, m=9)": ["+rand_augment"],
    "+ auto_augment (imagenet)": ["+auto_augment"],
    "+ augmix": ["+augmix"],
}
BATCHED = ("baseline (crop + flip)", "+ mixup 0.2 / cutmix 1.0", "+ trivial_augment_wide", "+ rand_augment (n=2, m=9)")


def overrides(root: str, backend: str, switch: list[str], batch: int, workers: int) -> list[str]:
    steps = [s[1:] for s in switch if s.startswith("+")]
    spec = BASE_SPEC + "".join(f", {s}" for s in steps) + ", normalize: cifar10]"
    return [
        "data.dataset=synthetic_jpeg",
        f"data.root={root}",
        "data.options={num_images: 2048, val_images: 64, size: [32, 32]}",
        f"data.backend={backend}",
        f"data.batch_size={batch}",
        f"data.num_workers={workers if backend == 'cpu' else 0}",
        f"data.train.transforms={spec}",
        "data.eval.transforms=[normalize: cifar10]",
        "model.args={width: 16}",
        "log.tensorboard=false",
        "log.progress=false",
        *[s for s in switch if not s.startswith("+")],
    ]


def loader_images_per_s(cfg, steps: int, warmup: int) -> float:
    """The training loader alone (the mix wrapper included): images/s of `steps` batches after `warmup`."""
    import time

    import torch

    from torchsprint import runtime
    from torchsprint.train.build import build_training

    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        b = build_training(cfg, rt, log=lambda *_: None)

        def batches():
            epoch = 0
            while True:
                b.loaders.train.set_epoch(epoch)
                yield from b.loaders.train
                epoch += 1

        def sync():  # the device backends queue their work: the clock must wait for it, not for its launch
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)

        it = batches()
        for _ in range(warmup):
            next(it)
        sync()
        t0, n = time.perf_counter(), 0
        for _ in range(steps):
            n += next(it)[0].shape[0]
        sync()
        return n / (time.perf_counter() - t0)
    finally:
        runtime.teardown(rt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=0, help="cpu backend DataLoader workers")
    ap.add_argument("--backends", default="cpu,memory")
    ap.add_argument("--root", default="/tmp/torchsprint-aug-bench")
    args = ap.parse_args()

    from torchsprint import config
    from torchsprint.commands.bench.measure import measure

    backends = args.backends.split(",")
    for b in list(backends):  # a backend this machine cannot run (gpu without CUDA): say so, measure the others
        try:
            measure(config.load(None, overrides(args.root, b, [], args.batch_size, args.workers)), 2, 1)
        except Exception as e:
            print(f"backend {b}: {type(e).__name__}: {str(e).splitlines()[0][:200]}; left out", flush=True)
            backends.remove(b)
    args.backends = ",".join(backends)
    runs = [(b, name) for b in backends for name in SWITCHES if b == "cpu" or name in BATCHED]
    results: dict = {r: [] for r in runs}
    for _ in range(args.repeats):
        for backend, name in runs:
            cfg = config.load(None, overrides(args.root, backend, SWITCHES[name], args.batch_size, args.workers))
            train = measure(cfg, args.steps, args.warmup)["images_per_s"]
            results[(backend, name)].append((train, loader_images_per_s(cfg, args.steps, args.warmup)))
            print(
                f"{backend} {name}: training {train:.0f} images/s, loader alone {results[(backend, name)][-1][1]:.0f}",
                flush=True,
            )  # each figure as it is measured: a run stopped at its time limit keeps them
    print(
        "| backend | switch | training images/s (min-max) | vs "
        "baseline | loader alone images/s | loader ms per 1000 images |"
    )
    print("|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        base = statistics.median(t for t, _ in results[(backend, "baseline (crop + flip)")])
        for b, name in runs:
            if b != backend:
                continue
            v = [t for t, _ in results[(b, name)]]
            med, lod = statistics.median(v), statistics.median(x for _, x in results[(b, name)])
            print(
                f"| {b} | {name} | {med:.0f} ({min(v):.0f}-{max(v):.0f}) "
                f"| {med / base:.2f}x | {lod:.0f} | {1e6 / lod:.0f} |"
            )
    for backend in ("memory", "gpu"):
        print(f"{backend}: auto_augment and augmix are refused (cpu backend only)")


if __name__ == "__main__":
    main()
