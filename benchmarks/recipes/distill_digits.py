"""Does distillation pay off? A small student on 10 digits per class, alone and distilled from a bigger teacher.

The teacher (small_cnn width 8, 3 epochs) trains on digits' whole training split (1,437 images); the student
(the same net, its own random start) on the first 10 training images of each class (`digits_few_10`, 100
images, random crops), for 40 epochs, alone and with distill (T=4, alpha=0.5, the defaults). Both evaluate on
digits' validation split (360 images), which neither trained on. Prints one JSON line per seed and the mean.

    python -m benchmarks.recipes.distill_digits --seeds 0,1,2,3,4 --out /tmp/distill
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

FEW = 10  # training images per class of the student's data set
TEACHER = ["model.args={width: 8}", "run.epochs=3", "optim.lr=0.05", "data.batch_size=32"]
STUDENT = [
    f"data.dataset=digits_few_{FEW}",
    "model.args={width: 8}",
    "run.epochs=40",
    "optim.lr=0.05",
    "data.batch_size=25",
    "data.train.transforms=[random_crop: {size: 8, padding: 1}]",
]
QUIET = [
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "checkpoint.every_epochs=null",
    "eval.every_epochs=100",
]


def register_digits_few(n: int = FEW) -> str:
    """Register `digits_few_<n>`: digits' validation split unchanged, the first n training images of each class."""
    from torchsprint.data import DATASETS
    from torchsprint.data.core import TensorImages

    def build(data_cfg):
        splits = DATASETS.get("digits")(data_cfg)
        tr, keep, seen = splits.train, [], {}
        for i, c in enumerate(tr.labels.tolist()):
            if seen.get(c, 0) < n:
                keep.append(i)
                seen[c] = seen.get(c, 0) + 1
        splits.train = TensorImages(tr.images[keep], tr.labels[keep], [tr.ids[i] for i in keep])
        return splits

    name = f"digits_few_{n}"
    DATASETS.register(name, override=True)(build)
    return name


def top1(run_dir: Path, *over: str) -> float:
    from torchsprint import config
    from torchsprint.train.run import train

    summary = train(config.load(None, [*QUIET, f"run.dir={run_dir}", *over]), quiet=True, overwrite=True)
    return summary["final"]["val/top1"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4", help="student seeds, comma-separated")
    p.add_argument("--out", default="/tmp/distill_digits", help="folder for the runs")
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.5)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    register_digits_few()
    out = Path(args.out)
    t0 = time.time()
    teacher = top1(out / "teacher", *TEACHER)
    print(json.dumps({"teacher_top1": round(teacher, 4), "seconds": round(time.time() - t0, 1)}), flush=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        alone = top1(out / "alone", *STUDENT, f"run.seed={seed}")
        kd = top1(
            out / "kd",
            *STUDENT,
            f"run.seed={seed}",
            f"distill.teacher.run={out / 'teacher'}",
            f"distill.temperature={args.temperature}",
            f"distill.alpha={args.alpha}",
        )
        rows.append((alone, kd))
        print(json.dumps({"seed": seed, "alone": round(alone, 4), "distilled": round(kd, 4)}), flush=True)
    n = len(rows)
    print(
        json.dumps(
            {
                "mean_alone": round(sum(a for a, _ in rows) / n, 4),
                "mean_distilled": round(sum(k for _, k in rows) / n, 4),
                "min_gain": round(min(k - a for a, k in rows), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
