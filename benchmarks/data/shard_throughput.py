"""Epoch throughput of the same generated JPEGs as an image folder and as WebDataset shards (cpu backend),
on a fast local disk and on a simulated slow path.

    .venv/bin/python -m benchmarks.data.shard_throughput --images 1024 --repeats 5

Workload: the `synthetic_jpeg` set (500x375, quality 90, ~70 KB), `torchsprint data shard` into ~8 MB
shards, decode + RandomResizedCrop(224) + flip + normalize, batch 64, --workers DataLoader workers,
the consumer on the CPU. One epoch = every training image once; images/s = images / epoch wall time
(worker start excluded: the loaders are built once and their workers persist; one warm-up epoch each).

The slow path (no FUSE, no root): every open costs --latency-ms and bytes arrive at --mb-per-s per open
stream, the profile of a network filesystem or object store where each request has a fixed cost.
- image_folder: each file read sleeps latency + size / rate before it is read (a wrapper around the
  dataset in the worker processes);
- webdataset: each shard streams through a `pipe:` URL running benchmarks/tools/throttled_cat.py, which waits
  the latency once and then copies the shard at that rate.
Variants alternate within each repeat (A B C D E, A B C D E, ...); medians and min-max are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

THROTTLED_CAT = Path(__file__).resolve().parents[1] / "tools" / "throttled_cat.py"  # run by path: it imports nothing


class ThrottledFiles:
    """An ImageFiles whose every file read first waits latency + size / rate (the slow-path image folder)."""

    def __init__(self, files, latency_s: float, bytes_per_s: float):
        self.files, self.latency_s, self.bytes_per_s = files, latency_s, bytes_per_s
        self.samples = files.samples

    def __len__(self):
        return len(self.files)

    def with_min_size(self, hint):
        return ThrottledFiles(self.files.with_min_size(hint), self.latency_s, self.bytes_per_s)

    def __getitem__(self, i):
        time.sleep(self.latency_s + os.path.getsize(self.samples[i][0]) / self.bytes_per_s)
        return self.files[i]


def build(variant: str, root: Path, shards: Path, args):
    import torch

    from torchsprint import config
    from torchsprint.data.core import DATASETS, LOADERS
    from torchsprint.runtime.core import Runtime

    common = [
        f"data.batch_size={args.batch_size}",
        f"data.num_workers={args.workers}",
        "data.drop_last=false",
        "data.train.transforms=[{random_resized_crop: {size: 224}}, hflip, {normalize: imagenet}]",
        "data.eval.transforms=[{resize: 256}, {center_crop: 224}, {normalize: imagenet}]",
    ]
    throttle = f"{sys.executable} {THROTTLED_CAT} --latency-ms {args.latency_ms} --mb-per-s {args.mb_per_s}"
    names = sorted(p.name for p in shards.glob("train-*.tar"))
    span = f"{{{names[0][6:12]}..{names[-1][6:12]}}}"
    over = {
        "image_folder": ["data.dataset=image_folder", f"data.root={root}"],
        "webdataset": ["data.dataset=webdataset", f"data.root={shards}"],
        "webdataset pipe:cat": [
            "data.dataset=webdataset",
            f"data.root={shards}",
            f"data.options.train=pipe:cat {shards}/train-{span}.tar",
        ],
        "image_folder, slow path": ["data.dataset=image_folder", f"data.root={root}"],
        "webdataset, slow path": [
            "data.dataset=webdataset",
            f"data.root={shards}",
            f"data.options.train=pipe:{throttle} {shards}/train-{span}.tar",
        ],
    }[variant]
    cfg = config.load(None, [*over, *common])
    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    if variant == "image_folder, slow path":
        splits.train = ThrottledFiles(splits.train, args.latency_ms / 1e3, args.mb_per_s * 1e6)
    return LOADERS.get("cpu")(cfg.data, splits, Runtime(torch.device("cpu")), seed=0).train


def epoch_rate(loader, epoch: int) -> float:
    loader.set_epoch(epoch)
    n, t0 = 0, time.perf_counter()
    for x, _ in loader:
        x.sum()  # touch the batch, as a training step would
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=10.0, help="slow path: cost of each open (file or shard)")
    ap.add_argument("--mb-per-s", type=float, default=50.0, help="slow path: bytes per second of each open stream")
    ap.add_argument("--shard-size", default="8MB")
    ap.add_argument("--root", default="/tmp/torchsprint-shard-bench")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from torchsprint.commands.data.shard import shard
    from torchsprint.data.sources.synthetic import generate_synthetic_jpeg

    torch.set_num_threads(1)
    base = Path(args.root)
    folder = generate_synthetic_jpeg(
        base / f"jpeg-{args.images}",
        num_images=args.images,
        val_images=20,
        size=(500, 375),
        classes=10,
        quality=90,
        seed=0,
    )
    shards = base / f"shards-{args.images}-{args.shard_size}"
    info = shard(str(folder), str(shards), args.shard_size, progress=False)
    variants = ["image_folder", "webdataset", "webdataset pipe:cat", "image_folder, slow path", "webdataset, slow path"]
    loaders = {v: build(v, folder, shards, args) for v in variants}
    for v in variants:
        epoch_rate(loaders[v], 0)  # warm-up: workers started, page cache filled
    rates: dict[str, list[float]] = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        for v in variants:
            rates[v].append(epoch_rate(loaders[v], r + 1))
            load.append(os.getloadavg()[0])
    import importlib.metadata as md

    out = {
        "images": args.images,
        "shards": info["shards"],
        "shard_mb": info["bytes"] / info["shards"] / 1e6,
        "workers": args.workers,
        "latency_ms": args.latency_ms,
        "mb_per_s": args.mb_per_s,
        "load": [min(load), statistics.median(load), max(load)],
        "versions": {p: md.version(p) for p in ("torch", "torchvision", "webdataset", "simplejpeg")},
        "rates": {v: {"median": statistics.median(x), "min": min(x), "max": max(x)} for v, x in rates.items()},
    }
    ref = out["rates"]["image_folder"]["median"]
    print(
        f"{args.images} images, {info['shards']} shards of ~{out['shard_mb']:.1f} MB, {args.workers} workers, "
        f"slow path {args.latency_ms} ms per open + {args.mb_per_s} MB/s; load {out['load']}"
    )
    for v, s in out["rates"].items():
        print(f"  {v:<26} {s['median']:7.0f} images/s  ({s['min']:.0f}-{s['max']:.0f})  {s['median'] / ref:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
