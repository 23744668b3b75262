"""The job torchsprint is compared with timm's train.py on (compare/vs_timm.py, compare/probe_memory.py): its data
and timm's side of it.

ResNet-18 from scratch on 2,000 train / 500 val generated 160x160 JPEGs of 10 classes, RandomResizedCrop 112 +
hflip, eval resize 128 + centre crop 112, batch 32, SGD (Nesterov, momentum 0.9, weight decay 5e-4) lr 0.1, cosine,
no warm-up, on the CPU.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from benchmarks.common.gnu_time import timed

RATE = re.compile(r"^Train: (\d+) .*\(\s*[\d.]+s,\s*([\d.]+)/s\)")  # timm's per-batch line: its running rate


def make_data(root: Path, train: int, val: int) -> Path:
    """The job's JPEGs (torchsprint's synthetic_jpeg generator), generated once under `root` and reused."""
    from torchsprint.data.sources.synthetic import generate_synthetic_jpeg

    return generate_synthetic_jpeg(
        root / f"jpeg-n{train}-v{val}-160",
        num_images=train,
        val_images=val,
        size=(160, 160),
        classes=10,
        quality=90,
        seed=0,
    )


def timm_run(args, data: Path, seed: int, workers: int, native_bf16: bool, out: Path) -> dict:
    """timm's train.py (`args.timm_train`, `args.epochs`) on the job with its fastest CPU switches: own training rate,
    wall time, peak RSS (GNU time), final val top-1."""
    flags = (["--amp", "--amp-dtype", "bfloat16"] if native_bf16 else []) + ["--channels-last"]
    cmd = [
        sys.executable,
        str(Path(args.timm_train).resolve()),
        "--data-dir",
        str(data),
        "--train-split",
        "train",
        "--val-split",
        "val",
        "--model",
        "resnet18",
        "--num-classes",
        "10",
        "--img-size",
        "112",
        "--crop-pct",
        "0.875",
        "-b",
        "32",
        "--opt",
        "sgd",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--weight-decay",
        "5e-4",
        "--sched",
        "cosine",
        "--epochs",
        str(args.epochs),
        "--warmup-epochs",
        "0",
        "--cooldown-epochs",
        "0",
        "--train-interpolation",
        "bilinear",
        "--scale",
        "0.08",
        "1.0",
        "--hflip",
        "0.5",
        "--reprob",
        "0",
        "--color-jitter",
        "0",
        "--smoothing",
        "0",
        "--device",
        "cpu",
        "-j",
        str(workers),
        "--seed",
        str(seed),
        "--log-interval",
        "1",
        "--output",
        str(out),
        "--experiment",
        f"seed{seed}-j{workers}",
        *flags,
    ]
    text, wall, rss = timed(cmd, out)
    rates = {}
    for line in text.splitlines():
        m = RATE.match(line.strip())
        if m:
            rates[int(m.group(1))] = float(m.group(2))  # the last line of an epoch holds its average
    summary = (out / f"seed{seed}-j{workers}" / "summary.csv").read_text().splitlines()
    head, last = summary[0].split(","), summary[-1].split(",")
    top1 = float(last[head.index("eval_top1")]) / 100
    return {
        "side": "timm",
        "flags": flags + ["-j", str(workers)],
        "own_rate": statistics.fmean(rates.values()),
        "wall_s": wall,
        "peak_mib": rss,
        "top1": top1,
    }
