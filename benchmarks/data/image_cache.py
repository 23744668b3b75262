"""The decoded-image cache on a user's photos: the photo defaults with data.cache=off (every epoch decodes the files),
then data.cache=auto twice (the first run builds the cache and stores the start-up measurements, the second reuses
both), side by side on one machine, against the model alone (the run's own model, batch, precision and memory
format stepping on one batch already in memory: what no data path can beat).

Per run: training img/s of each epoch after the first (the summary's and metrics.jsonl's), the data-wait share, the
time from starting the command to the end of its first training step (its first `train` row in metrics.jsonl,
log.every_steps=1), the wall time, val top-1 and balanced accuracy; the cache's build time and size (decisions.json).

    python -m benchmarks.data.image_cache --out benchmarks/results/image_cache_<device>_<date>.json \
        [--real | --generated] [--images 2624] [--epochs 3] [--seeds 1]

--real (the default): crops of the real photographs scikit-image ships (benchmarks/common/real_photos.py), grey
300x300 PNGs in 4 classes, 14x imbalance, as the user's folder; --generated: benchmarks/common/photos.py's shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.child import REPO

MODEL_ALONE = r"""
import json, statistics, sys, time, torch
from torchsprint import config, runtime
from torchsprint.train.engine import train_step
from torchsprint.train.build import build_training
cfg = config.load(sys.argv[1], ["log.tensorboard=false", "run.dir=" + sys.argv[2]])
rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
b = build_training(cfg, rt, lambda m: None)
b.loaders.train.set_epoch(0)
x, y = next(iter(b.loaders.train))
b.model.train()
for _ in range(5):
    train_step(b, [(x, y)])
rates = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(10):
        loss = train_step(b, [(x, y)])
    loss.item()
    rates.append(10 * len(x) / (time.perf_counter() - t))
print(json.dumps({"images_per_s": statistics.median(rates), "rounds": [round(r, 2) for r in rates],
                  "batch": len(x), "shape": list(x.shape), "precision": cfg.precision.mode,
                  "channels_last": x.is_contiguous(memory_format=torch.channels_last)}))
"""


def train(root: Path, out: Path, env: dict, cache: str, epochs: int, seed: int) -> dict:
    """One `torchsprint train data.root=ROOT` run with data.cache=`cache`: its figures."""
    args = [
        sys.executable,
        "-m",
        "torchsprint",
        "train",
        f"data.root={root}",
        f"run.epochs={epochs}",
        f"data.cache={cache}",
        f"run.seed={seed}",
        f"run.dir={out}",
        "log.every_steps=1",
        "log.tensorboard=false",
    ]
    start = time.time()
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"train failed ({cache}): {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "train"]  # log.every_steps=1: a row per step
    epochs_rows = [r for r in rows if r.get("kind") == "epoch"]
    summary = json.loads((out / "summary.json").read_text())
    decisions = json.loads((out / "decisions.json").read_text())
    later = epochs_rows[1:] or epochs_rows
    return {
        "cache": cache,
        "seed": seed,
        "wall_s": round(wall, 2),
        "first_step_s": round(steps[0]["time"] - start, 2) if steps else None,
        "epoch_images_per_s": [round(r["train/epoch_images_per_s"], 2) for r in epochs_rows],
        "data_wait": [round(r["train/data_wait_share"], 4) for r in epochs_rows],
        "images_per_s_after_first": round(statistics.mean(r["train/epoch_images_per_s"] for r in later), 2),
        "data_wait_after_first": round(statistics.mean(r["train/data_wait_share"] for r in later), 4),
        "top1": summary["final"].get("val/top1"),
        "balanced_acc": summary["final"].get("val/balanced_acc"),
        "cache_record": decisions.get("cache"),
        "backend": decisions.get("backend"),
        "backend_why": decisions.get("backend_why"),
        "precision": decisions.get("precision"),
        "precision_why": decisions.get("precision_why"),
        "batch": decisions.get("batch_size"),
    }


def model_alone(run_dir: Path, env: dict) -> dict:
    """The run's own model, batch, precision and format stepping on one batch in memory (MODEL_ALONE)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", MODEL_ALONE, str(run_dir / "config.yaml"), tmp],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
        )
    if done.returncode != 0:
        raise SystemExit(f"model alone failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict:
    import platform

    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "revision": rev,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--real", action="store_true", default=True)
    kind.add_argument("--generated", action="store_true")
    p.add_argument("--images", type=int, default=2624)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--work", type=Path, default=None, help="folder for the data, caches and runs (default: a temp one)")
    p.add_argument(
        "--variants",
        default="files,cache-first,cache-second",
        help="which runs per seed (files: data.cache=off, measured again; cache-first / cache-second: "
        "data.cache=auto, the first building the cache where none is)",
    )
    p.add_argument("--first-seed", type=int, default=0)
    a = p.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="image-cache-bench-"))
    root = work / "photos"
    if not root.exists():
        if a.generated:
            from benchmarks.common.photos import make_folder

            counts = make_folder(root, a.images, 300, 300, "L")
        else:
            from benchmarks.common.real_photos import COUNTS, make_real_photos

            scale = a.images / sum(COUNTS)
            counts = make_real_photos(root, work, counts=tuple(max(1, round(c * scale)) for c in COUNTS))
    else:
        counts = {d.name: len(list(d.iterdir())) for d in sorted(root.iterdir())}
    env = dict(
        os.environ,
        TORCHSPRINT_CACHE_DIR=str(work / "cache"),
        TORCHSPRINT_MEASURED_DIR=str(work / "measured"),
        PYTHONPATH=str(REPO / "src"),
    )
    runs = []
    wanted = a.variants.split(",")
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for cache, name in (("off", "files"), ("auto", "cache-first"), ("auto", "cache-second")):
            if name not in wanted:
                continue
            print(f"seed {seed}: {name} ...", flush=True)
            # "files" is the run as before the cache: its start-up measured again (TORCHSPRINT_REMEASURE=1), as every
            # run measured before the per-machine store
            run_env = dict(env, TORCHSPRINT_REMEASURE="1") if name == "files" else env
            r = train(root, work / f"run-{name}-{seed}", run_env, cache, a.epochs, seed)
            r["name"] = name
            runs.append(r)
            print(
                json.dumps(
                    {
                        k: r[k]
                        for k in (
                            "name",
                            "wall_s",
                            "first_step_s",
                            "epoch_images_per_s",
                            "data_wait",
                            "top1",
                            "balanced_acc",
                        )
                    }
                ),
                flush=True,
            )
    last = runs[-1]
    alone = model_alone(work / f"run-{last['name']}-{last['seed']}", env)
    print(json.dumps({"model_alone": alone}), flush=True)
    out = {
        "machine": machine(),
        "data": {"kind": "generated" if a.generated else "real", "counts": counts, "root": str(root)},
        "epochs": a.epochs,
        "seeds": a.seeds,
        "runs": runs,
        "model_alone": alone,
        "ratios": {
            r["name"] + f"-{r['seed']}": round(r["images_per_s_after_first"] / alone["images_per_s"], 3) for r in runs
        },
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["ratios"]))


if __name__ == "__main__":
    main()
