"""Progressive resizing (data.progressive) against a fixed crop size: training speed and final accuracy.

Both runs train the same model on the same generated JPEG folder (`synthetic_jpeg`, 10 classes) with the same
seeds, schedule and evaluation (data.eval.transforms: resize + center_crop at the final size); the progressive run
crops smaller in the early epochs (FFCV's min_res -> max_res ramp). Runs alternate fixed / progressive per seed,
so a drift of the machine's load hits both alike. Reports per seed: validation top-1 and loss at the end, the
training images/s (train time only, as the run summary counts it) and the wall time of the whole run.

    python -m benchmarks.recipes.progressive [--seeds 0,1,2] [--epochs 8] [--model small_cnn --width 16] \\
        [--size 40 --crop 32 --start 16 --step 8 --ramp 2,6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch


def job(args, seed: int, progressive: bool, run_dir: str) -> dict:
    from torchsprint import config
    from torchsprint.train.run import train

    over = [
        "data.dataset=synthetic_jpeg",
        f"data.root={args.root}",
        f"data.backend={args.backend}",
        f"data.options={{num_images: {args.train_images}, val_images: {args.val_images}, size: [{args.size}, "
        f"{args.size}], classes: 10}}",
        f"data.batch_size={args.batch}",
        f"model.name={args.model}",
        f"model.args={{width: {args.width}}}" if args.width else "model.args={}",
        f"data.train.transforms=[random_resized_crop: {args.crop}, hflip, normalize: imagenet]",
        f"data.eval.transforms=[resize: {round(args.crop * 1.14)}, center_crop: {args.crop}, normalize: imagenet]",
        f"run.epochs={args.epochs}",
        f"run.seed={seed}",
        "optim.lr=0.1",
        "sched.warmup_epochs=1",
        "log.tensorboard=false",
        "log.progress=false",
        "eval.per_class=false",
        "checkpoint.every_epochs=null",
        f"run.dir={run_dir}",
    ]
    if progressive:
        first, last = (int(x) for x in args.ramp.split(","))
        over.append(
            f"data.progressive={{start_size: {args.start}, step: {args.step}, start_epoch: {first}, end_epoch: {last}}}"
        )
    t0 = time.perf_counter()
    s = train(config.load(None, over), quiet=True)
    wall = time.perf_counter() - t0
    sizes = json.loads((Path(run_dir) / "decisions.json").read_text()).get("train_sizes")
    return {
        "seed": seed,
        "progressive": progressive,
        "top1": s["final"]["val/top1"],
        "loss": s["final"]["val/loss"],
        "train_images_per_s": s["train_images_per_s"],
        "wall_s": wall,
        "train_sizes": sizes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--width", type=int, default=16, help="model.args.width (0: the model's default arguments)")
    ap.add_argument("--backend", default="memory")
    ap.add_argument("--size", type=int, default=40, help="side of the generated JPEGs")
    ap.add_argument("--crop", type=int, default=32, help="final training crop and evaluation size")
    ap.add_argument("--start", type=int, default=16, help="data.progressive.start_size")
    ap.add_argument("--step", type=int, default=8, help="data.progressive.step")
    ap.add_argument("--ramp", default="2,6", help="data.progressive start_epoch,end_epoch")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-images", type=int, default=800)
    ap.add_argument("--val-images", type=int, default=400)
    ap.add_argument("--root", default="/tmp/progressive_bench")
    ap.add_argument("--json", default=None, help="write the per-run figures here")
    args = ap.parse_args()
    from torchsprint import config
    from torchsprint.data import DATASETS

    # Generate the JPEG folder before any timed run (the first run would otherwise count its generation).
    DATASETS.get("synthetic_jpeg")(
        config.load(
            None,
            [
                "data.dataset=synthetic_jpeg",
                f"data.root={args.root}",
                f"data.options={{num_images: {args.train_images}, "
                f"val_images: {args.val_images}, size: [{args.size}, {args.size}], classes: 10}}",
            ],
        ).data
    )
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for progressive in (False, True):
            with tempfile.TemporaryDirectory() as d:
                r = job(args, seed, progressive, f"{d}/run")
            runs.append(r)
            print(
                f"seed {seed} {'progressive' if progressive else 'fixed':11s}: top1 {r['top1']:.4f}  loss "
                f"{r['loss']:.4f}  {r['train_images_per_s']:.0f} train img/s  "
                f"{r['wall_s']:.0f} s  sizes {r['train_sizes'] or args.crop}",
                flush=True,
            )
    print("\n| run | " + " | ".join(f"seed {r['seed']}" for r in runs if not r["progressive"]) + " | mean |")
    print("|---|" + "---|" * (len(runs) // 2 + 1))
    for prog in (False, True):
        rs = [r for r in runs if r["progressive"] == prog]
        for key, fmt in (("top1", "{:.4f}"), ("train_images_per_s", "{:.0f}"), ("wall_s", "{:.0f}")):
            xs = [r[key] for r in rs]
            print(
                f"| {'progressive' if prog else 'fixed'} {key} | "
                + " | ".join(fmt.format(x) for x in xs)
                + f" | {fmt.format(statistics.mean(xs))} |"
            )
    if args.json:
        out = {
            "command": "python -m benchmarks.recipes.progressive "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
            "date": datetime.now().isoformat(timespec="minutes"),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
