"""Does amp_bf16 on a CPU reach fp32's accuracy? The same runs in both precisions over several seeds.

`precision: auto` may pick amp_bf16 on a CPU with native bf16 (AVX-512 BF16, AMX): that is only a default if it
trains as well as fp32. Two jobs, both precisions per seed, alternated, in this process:

  digits  the default run (`torchsprint train` with no config: digits, small_cnn, 10 epochs), run.seed varied.
  photos  the photo defaults (nothing but data.root) on a generated folder of 300x300 RGB photos (common/photos.py's
          generator: 4 classes, 10:5:2:1), --epochs epochs.

Reported per run: final val top-1, balanced accuracy, macro-F1, training images/s (meaningful only on a quiet
machine), wall; per job: mean and std per precision and the difference of the means against its standard error
(Welch), as backend_agreement.py does.

    python -m benchmarks.numerics.bf16_parity --jobs digits --seeds 0,1,2,3,4 --json bf16_digits.json
    python -m benchmarks.numerics.bf16_parity --jobs photos --seeds 0,1,2,3,4 --epochs 3 --json bf16_photos.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common.photos import make_folder
from benchmarks.common.runs import train_once
from benchmarks.common.stats import compare, mean_std, strict

QUIET = ["log.tensorboard=false", "log.progress=false", "checkpoint.every_epochs=null"]
PRECISIONS = ("fp32", "amp_bf16")


def run_one(overrides: list[str]) -> dict:
    s, seconds = train_once(overrides)
    final = s["final"]
    return {
        "top1": final.get("val/top1"),
        "balanced_accuracy": final.get("val/balanced_acc"),
        "macro_f1": final.get("val/f1_macro"),
        "train_images_per_s": s.get("train_images_per_s"),
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="digits,photos")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--epochs", type=int, default=3, help="photos job: run.epochs")
    ap.add_argument("--images", type=int, default=2000, help="photos job: images in the generated folder")
    ap.add_argument(
        "--root", default="/tmp/bf16_parity_photos", help="photos job: where the folder is generated (reused)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import torchvision

    from torchsprint.runtime.machine import cpu_info

    seeds = [int(s) for s in args.seeds.split(",")]
    out = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpu": cpu_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jobs": {},
    }
    for job in args.jobs.split(","):
        if job == "photos":
            root = Path(args.root)
            if not root.exists():
                make_folder(root, args.images, 300, 300, "RGB")
            base = [f"data.root={root}", f"run.epochs={args.epochs}", *QUIET]
        elif job == "digits":
            base = list(QUIET)
        else:
            raise SystemExit(f"--jobs: unknown job {job!r} (digits, photos)")
        runs = []
        for seed in seeds:
            for prec in PRECISIONS:
                r = run_one([*base, f"precision={prec}", f"run.seed={seed}"]) | {"precision": prec, "seed": seed}
                runs.append(r)
                print(
                    f"{job} {prec} seed {seed}: top-1 {r['top1']:.4f} balanced {r['balanced_accuracy']} "
                    f"{r['train_images_per_s']:.1f} img/s ({r['seconds']:.0f} s)",
                    flush=True,
                )
        results = {p: [r["top1"] for r in runs if r["precision"] == p] for p in PRECISIONS}
        rows = compare(results)
        for p, xs in results.items():
            m, s = mean_std(xs)
            print(f"{job} {p}: mean top-1 {m:.4f} +- {s:.4f}")
        for r in rows:
            print(f"{job} {r['a']} - {r['b']}: {r['diff']:+.4f} (standard error {r['se']:.4f}, t {r['t']:+.2f})")
        out["jobs"][job] = {"runs": runs, "compare": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(strict(out), indent=1))


if __name__ == "__main__":
    main()
