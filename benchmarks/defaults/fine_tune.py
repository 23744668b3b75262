"""Fine-tuning against training from scratch on a small folder of photos, without the internet.

1. Pretrain: torchsprint's photo defaults (ResNet-18 from scratch, offline) on set A: generated photos of 8 kinds of
   shape (disc, triangle, square, cross, ring, star, hexagon, L) of random colour, place, size and rotation on blurred
   noise, --size px square, --pretrain-per-class per class for training, 40 for validation.
2. Serve A's best.safetensors from an HTTP server on 127.0.0.1 (this process), as a user's weights would come from
   a hub; the fine-tuning runs name it as model.pretrained=http://127.0.0.1:<port>/<file>#sha256=<hex>, so they go
   through the download path (TORCH_HOME in the work folder).
3. Fine-tune on set B: 4 kinds of shape set A does not have (pentagon, T, ellipse, diamond), drawn the same way,
   `--per-class` training images per class (e.g. 20 and 100), --val-per-class validation images per class.
   Cases per size, each the real CLI (`python -m torchsprint train data.root=B ...`):
   - fine_tune: the defaults with the weights: head alone for one epoch (model.freeze_epochs=1), then everything,
     lr 0.01 per 256 images (models/start.py);
   - fine_tune_all: the same with model.freeze_epochs=0 (everything from the start);
   - scratch: model.pretrained=null (the photo defaults from scratch: lr 0.1 per 256, a warm-up epoch) for the same
     wall time (run.max_time = fine_tune's wall time, the same run.epochs);
   - lr_<x>: fine_tune with optim.lr = x per 256 images of the batch (--lrs), the fine-tuning rate's sweep.
   Each row: val top-1, balanced accuracy, macro-F1 at the end, wall time, and for fine_tune: the time from process
   start to the first validation at or above scratch's final top-1.

    nice -n 5 python -m benchmarks.defaults.fine_tune --per-class 20,100 --epochs 12 \
        --out benchmarks/results/fine_tune_<device>_<date>.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from benchmarks.common.child import REPO

# Twelve kinds of shape: set A (pretraining) has the first eight, set B (fine-tuning) the other four, so what the
# weights learned (edges, corners, curvature) carries over, but none of B's classes was seen.
SHAPES_A = ("disc", "triangle", "square", "cross", "ring", "star", "hexagon", "ell")
SHAPES_B = ("pentagon", "tee", "ellipse", "diamond")


def polygon(x: float, y: float, r: float, n: int, turn: float = 0.0, inner: float | None = None) -> list[tuple]:
    """The corners of a regular n-gon (or an n-pointed star with `inner` x r as its inner radius) around (x, y)."""
    import math

    pts = []
    for k in range(n * (2 if inner else 1)):
        a = turn + math.pi * 2 * k / (n * (2 if inner else 1)) - math.pi / 2
        rr = r * (inner if inner and k % 2 else 1)
        pts.append((x + rr * math.cos(a), y + rr * math.sin(a)))
    return pts


def draw_shape(rng, kind: str, size: int):
    """One size x size picture: `kind` in a random colour, place, size and rotation on blurred noise."""
    from PIL import Image, ImageDraw

    bg = rng.integers(0, 140, (size // 8, size // 8, 3), dtype=np.uint8)
    im = Image.fromarray(bg).resize((size, size), Image.BILINEAR)
    d = ImageDraw.Draw(im)
    r = int(rng.integers(size // 7, size // 3))
    x, y = int(rng.integers(r, size - r)), int(rng.integers(r, size - r))
    col = tuple(int(v) for v in rng.integers(110, 256, 3))
    turn = float(rng.uniform(-0.3, 0.3))
    w = max(2, r // 3)
    if kind == "disc":
        d.ellipse([x - r, y - r, x + r, y + r], fill=col)
    elif kind == "ring":
        d.ellipse([x - r, y - r, x + r, y + r], outline=col, width=w)
    elif kind == "ellipse":
        d.ellipse([x - r, y - r // 2, x + r, y + r // 2], fill=col)
    elif kind in ("triangle", "square", "pentagon", "hexagon"):
        n = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}[kind]
        d.polygon(polygon(x, y, r, n, turn + (np.pi / 4 if n == 4 else 0)), fill=col)
    elif kind == "diamond":
        d.polygon([(x, y - r), (x + r // 2, y), (x, y + r), (x - r // 2, y)], fill=col)
    elif kind == "star":
        d.polygon(polygon(x, y, r, 5, turn, inner=0.45), fill=col)
    elif kind == "cross":
        d.rectangle([x - r, y - w // 2, x + r, y + w // 2], fill=col)
        d.rectangle([x - w // 2, y - r, x + w // 2, y + r], fill=col)
    elif kind == "tee":
        d.rectangle([x - r, y - r, x + r, y - r + w], fill=col)
        d.rectangle([x - w // 2, y - r, x + w // 2, y + r], fill=col)
    elif kind == "ell":
        d.rectangle([x - r, y - r, x - r + w, y + r], fill=col)
        d.rectangle([x - r, y + r - w, x + r, y + r], fill=col)
    return im


def make_set(root: Path, kinds: tuple[str, ...], per_class: int, val_per_class: int, size: int, seed: int) -> Path:
    """root/{train,val}/<kind>/*.jpg (class = the kind of shape alone). The validation images depend on `seed` only,
    so every --per-class size is judged on the same images."""
    for split, n, s in (("val", val_per_class, seed), ("train", per_class, seed + 1000)):
        rng = np.random.default_rng(s)
        for kind in kinds:
            (root / split / kind).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                draw_shape(rng, kind, size).save(root / split / kind / f"{i:05d}.jpg", quality=90)
    return root


def run_cli(root: Path, run_dir: Path, overrides: list[str], env: dict) -> dict:
    """One `torchsprint train` as a subprocess: wall time, the final figures and every validation's time."""
    cmd = [
        sys.executable,
        "-m",
        "torchsprint",
        "train",
        f"data.root={root}",
        f"run.dir={run_dir}",
        "log.progress=false",
        *overrides,
    ]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    (run_dir.parent / f"{run_dir.name}.log").write_text(out.stdout + out.stderr)
    row = {"overrides": overrides, "rc": out.returncode, "wall_s": round(wall, 1)}
    if out.returncode != 0:
        row["error"] = (out.stderr or out.stdout)[-2000:]
        return row
    s = json.loads((run_dir / "summary.json").read_text())
    final = s["final"]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("kind") == "eval"]
    row |= {
        "top1": round(final["val/top1"], 4),
        "balanced_acc": round(final["val/balanced_acc"], 4),
        "f1_macro": round(final["val/f1_macro"], 4),
        "epochs_run": len(evals),
        "train_images_per_s": s.get("train_images_per_s"),
        "init": s.get("init", {}).get("source"),
        "curve": [(e["epoch"], round(e["time"] - t0, 1), round(e["val/top1"], 4)) for e in evals],
    }
    decisions = json.loads((run_dir / "decisions.json").read_text())
    row["chosen"] = {
        c["setting"]: c["value"]
        for c in decisions.get("chosen", [])
        if c["setting"] in ("model.pretrained", "optim.lr", "model.freeze_epochs", "sched.warmup_epochs")
    }
    return row


def serve(folder: Path) -> tuple[ThreadingHTTPServer, str]:
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(folder)))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    return http, f"http://127.0.0.1:{http.server_port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", default="20,100")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--pretrain-epochs", type=int, default=6)
    ap.add_argument("--size", type=int, default=96, help="the images' side in pixels (the photo defaults train at it)")
    ap.add_argument("--pretrain-per-class", type=int, default=200)
    ap.add_argument("--val-per-class", type=int, default=50)
    ap.add_argument("--lr-sizes", default="100", help="the --per-class sizes that get the --lrs sweep")
    ap.add_argument("--lrs", default="", help="extra fine-tuning rates per 256 images, e.g. 0.003,0.03,0.1")
    ap.add_argument("--cases", default="fine_tune,fine_tune_all,scratch")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="run.seed of every fine-tuning and scratch run (set B's images "
        "and the pretraining stay the same): repeat with 1, 2 ... for the spread between seeds",
    )
    ap.add_argument("--work", default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="fine_tune_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_HOME": str(work / "torch"), "NO_PROXY": "127.0.0.1,localhost"}
    offline = {**env, "TORCHSPRINT_OFFLINE": "1"}
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "argv": sys.argv[1:],
        "python": platform.python_version(),
    }
    import torch

    from torchsprint.runtime.machine import cpu_info

    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result |= {"cpu": cpu_info(), "torch": torch.__version__, "revision": rev, "seed": args.seed}

    set_a = work / "set_a"
    if not (set_a / "val").is_dir():
        make_set(set_a, SHAPES_A, args.pretrain_per_class, 40, args.size, seed=0)
    pre_dir = work / "pretrain"
    if not (pre_dir / "best.safetensors").is_file():
        print("pretraining on set A ...", flush=True)
        result["pretrain"] = run_cli(set_a, pre_dir, [f"run.epochs={args.pretrain_epochs}"], offline)
        print(json.dumps({k: v for k, v in result["pretrain"].items() if k != "curve"}), flush=True)
    served = work / "served"
    served.mkdir(exist_ok=True)
    data = (pre_dir / "best.safetensors").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    name = f"resnet18-setA-{digest[:8]}.safetensors"
    (served / name).write_bytes(data)
    http, base = serve(served)
    spec = f"{base}/{name}#sha256={digest}"
    result["weights"] = {"file": name, "sha256": digest, "bytes": len(data)}

    rows = []
    cases = args.cases.split(",")
    lrs = [float(x) for x in args.lrs.split(",") if x]
    for n in [int(x) for x in args.per_class.split(",")]:
        root = make_set(work / f"set_b_{n}", SHAPES_B, n, args.val_per_class, args.size, seed=1)
        common = [
            f"run.epochs={args.epochs}",
            "model.name=resnet18",  # named: weights alone do not pick the model
            f"run.seed={args.seed}",
        ]
        ft = None

        def one(case: str, over: list[str], environ=env, n=n, root=root, common=common) -> dict:
            print(f"{n}/class {case} ...", flush=True)
            row = {"per_class": n, "case": case, **run_cli(root, work / f"b{n}_{case}", [*common, *over], environ)}
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            rows.append(row)
            return row

        if "fine_tune" in cases:
            ft = one("fine_tune", [f"model.pretrained={spec}"])
        if "fine_tune_all" in cases:
            one("fine_tune_all", [f"model.pretrained={spec}", "model.freeze_epochs=0"])
        for lr in lrs if str(n) in args.lr_sizes.split(",") else []:
            one(f"lr_{lr:g}", [f"model.pretrained={spec}", f"optim.lr={lr * 64 / 256:g}"])
        if "scratch" in cases:
            limit = [f"run.max_time={int(ft['wall_s'])}s"] if ft and ft.get("rc") == 0 else []
            sc = one("scratch", ["model.pretrained=null", *limit], offline)
            if ft and "top1" in sc and "curve" in ft:
                reach = [t for _, t, top1 in ft["curve"] if top1 >= sc["top1"]]
                ft["seconds_to_scratch_final"] = reach[0] if reach else None
    http.shutdown()
    result["rows"] = rows
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
