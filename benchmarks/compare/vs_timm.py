"""torchsprint beside timm's train.py on the same CPU job: ResNet-18 from scratch on generated JPEGs.

The job: 2,000 train / 500 val generated 160x160 JPEGs of 10 classes (torchsprint's
synthetic_jpeg generator; both sides read the same files), RandomResizedCrop 112 (scale 0.08-1, bilinear) + hflip,
eval resize 128 + centre crop 112, ImageNet normalisation, batch 32, SGD (Nesterov, momentum 0.9, weight decay
5e-4) lr 0.1, cosine, no warm-up, 3 epochs, evaluation after every epoch, on the CPU.

timm: its own train.py, run as it is from a checkout of https://github.com/huggingface/pytorch-image-models
(never copied into this project; pass its path with --timm-train; measured with the snapshot at commit aa4b5850
and the timm package 1.0.31 from PyPI), with its fastest CPU switches: `--amp --amp-dtype bfloat16` where the CPU
computes bf16 natively (else fp32) and `--channels-last`, `-j` data workers as --timm-workers says (both ends tried
when given as a list). torchsprint: `python -m torchsprint train` with its defaults for that config (nothing
named beyond the job: precision and memory format are its own choice).

Per run: images/s = train images x epochs / the process's wall time (start to exit: start-up, training and the
per-epoch evaluation, the same work on both sides), each tool's own training rate (timm: the epoch's average
rate in its last `Train:` line; torchsprint: summary.json train_images_per_s), final val top-1, and the peak
resident memory of the process and the children it waited for (GNU time's "Maximum resident set size").
Sides alternate per seed.

    git clone https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    python -m benchmarks.compare.vs_timm --timm-train /tmp/timm-repo/train.py --seeds 0,1,2 --json vs_timm.json
    python -m benchmarks.compare.vs_timm --timm-train ... --smoke      # 120 images, 1 epoch: does it run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.child import REPO
from benchmarks.common.gnu_time import timed
from benchmarks.common.timm_job import make_data, timm_run


def torchsprint_run(args, data: Path, seed: int, out: Path) -> dict:
    run_dir = out / f"ts-seed{seed}"
    over = [
        f"data.root={data}",
        "data.batch_size=32",
        "data.eval_batch_size=32",
        "data.train.transforms=[{random_resized_crop: 112}, hflip, {normalize: imagenet}]",
        "data.eval.transforms=[{resize: 128}, {center_crop: 112}, {normalize: imagenet}]",
        "model.name=resnet18",
        "optim.lr=0.1",
        "sched.warmup_epochs=0",
        f"run.epochs={args.epochs}",
        f"run.seed={seed}",
        f"run.dir={run_dir}",
        "log.tensorboard=false",
        "log.progress=false",
    ]
    text, wall, rss = timed([sys.executable, "-m", "torchsprint", "train", *over], out)
    s = json.loads((run_dir / "summary.json").read_text())
    d = json.loads((run_dir / "decisions.json").read_text())
    return {
        "side": "torchsprint",
        "flags": {k: d.get(k) for k in ("precision", "channels_last", "backend")},
        "precision_why": d.get("precision_why"),
        "own_rate": s["train_images_per_s"],
        "wall_s": wall,
        "peak_mib": rss,
        "top1": s["final"]["val/top1"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timm-train", required=True, help="path to timm's train.py (a checkout of pytorch-image-models)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timm-workers", default="0,2", help="timm's -j: each value runs; the faster is timm's best")
    ap.add_argument("--root", default="/tmp/vs_timm", help="where the JPEGs are generated (reused)")
    ap.add_argument("--smoke", action="store_true", help="120 train / 40 val images, 1 epoch, 1 seed, -j 0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import timm
    import torch

    from torchsprint.runtime.machine import cpu_info

    train, val = (120, 40) if args.smoke else (2000, 500)
    if args.smoke:
        args.epochs, args.seeds, args.timm_workers = 1, "0", "0"
    data = make_data(Path(args.root), train, val)
    cpu = cpu_info()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "revision": rev,
        "images": {"train": train, "val": val},
        "epochs": args.epochs,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for w in [int(x) for x in args.timm_workers.split(",")]:
                r = timm_run(args, data, seed, w, cpu["native_bf16"], out) | {"seed": seed}
                result["runs"].append(r)
                print(r, flush=True)
            r = torchsprint_run(args, data, seed, out) | {"seed": seed}
            result["runs"].append(r)
            print(r, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    job_images = train * args.epochs
    rows = {}
    for r in result["runs"]:
        r["images_per_s"] = job_images / r["wall_s"]
        rows.setdefault(r["side"] + ("" if r["side"] == "torchsprint" else " " + " ".join(r["flags"][-2:])), []).append(
            r
        )
    print(f"\n{'side':<16} {'img/s (job)':>11} {'own rate':>9} {'top-1 mean +- std':>18} {'peak MiB':>9}")
    for name, rs in rows.items():
        tops = [r["top1"] for r in rs]
        print(
            f"{name:<16} {statistics.median(r['images_per_s'] for r in rs):11.1f} "
            f"{statistics.median(r['own_rate'] for r in rs):9.1f} {statistics.fmean(tops):9.4f} +- "
            f"{statistics.stdev(tops) if len(tops) > 1 else 0:.4f} {max(r['peak_mib'] for r in rs):9d}"
        )
    ts = statistics.median(r["images_per_s"] for r in rows["torchsprint"])
    best = max((statistics.median(r["images_per_s"] for r in rs), n) for n, rs in rows.items() if n != "torchsprint")
    result["ratio_vs_timm_best"] = ts / best[0]
    print(f"torchsprint / timm's best ({best[1]}): {ts / best[0]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
