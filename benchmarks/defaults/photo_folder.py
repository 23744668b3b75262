"""A new user's own photos through the real CLI: feedback times, speed and accuracy, new defaults vs old.

Generates a folder of class folders (common/photos.py; no split folders: the detected default, split by
data.val_fraction) of photo-sized JPEGs: a disc, square, triangle or cross of random colour, place and scale on a
blurred noise background, 4 classes with a 10x spread (10:5:2:1), RGB or grey ("L"), 300x300 or 500x375. Then runs
`python -m torchsprint train data.root=DIR ...` as a subprocess with stdout a pipe (as a CI log or `| tee` gets it)
and timestamps each line as it arrives, from which it takes:

- first_line_s: process start to the first printed line;
- epoch_start_s: when epoch 1 started (the first heartbeat's arrival less its `elapsed`);
- first_progress_after_start_s: epoch 1's start to the first progress line (heartbeat or estimate): the goal is
  within 10 s of the first step;
- first_estimate_after_start_s: epoch 1's start to the estimate line;
- epoch1_train_end_s / epoch1_end_s: process start to `epoch 1: train ...` and to epoch 1's validation line;
- wall_s: process start to exit; from summary.json: train images/s, final val top-1, balanced accuracy, macro-F1,
  the weakest class's recall.

Cases: `new` (the defaults: nothing but data.root, run.epochs=10; with --max-time, run.max_time too), `old` (the old
defaults: model.name=small_cnn and no resize, data.train.transforms=[] / data.eval.transforms=[], under run.max_time =
the new run's wall time), `full` (the new default model, resnet18, at the native size with the same augmentation scale,
lr and warm-up, same max_time).

    nice -n 5 python -m benchmarks.defaults.photo_folder --cases rgb300 --max-time 15m \
        --out benchmarks/results/photo_folder_<device>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.photos import SHARES, make_folder

FOLDERS = {"rgb300": (300, 300, "RGB"), "grey300": (300, 300, "L"), "rgb500": (500, 375, "RGB")}

HEARTBEAT = re.compile(r"^epoch 1/\d+: step \d+/\d+ .*elapsed ([\d.:]+)( s)?, ETA")
ESTIMATE = re.compile(r"^estimate: epoch 1 takes")
EPOCH1_TRAIN = re.compile(r"^epoch 1: train ")
EPOCH1_VAL = re.compile(r"^epoch 1/\d+  ")


def seconds(text: str) -> float:
    """The logger's clock ('12.3' with ' s' after it, 'M:SS' or 'H:MM:SS') in seconds."""
    parts = [float(p) for p in text.split(":")]
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


def parse_lines(lines: list[tuple[float, str]]) -> dict:
    """The feedback times from (seconds since process start, line) pairs, as the module docstring lists them."""
    out: dict = {"first_line_s": lines[0][0] if lines else None}
    start = None
    for t, line in lines:
        m = HEARTBEAT.match(line)
        if m and start is None:
            start = t - seconds(m.group(1))
            out["first_heartbeat_s"] = t
        if ESTIMATE.match(line) and "first_estimate_s" not in out:
            out["first_estimate_s"] = t
        if EPOCH1_TRAIN.match(line) and "epoch1_train_end_s" not in out:
            out["epoch1_train_end_s"] = t
        if EPOCH1_VAL.match(line) and "epoch1_end_s" not in out:
            out["epoch1_end_s"] = t
    out["epoch_start_s"] = start
    if start is not None:
        firsts = [out[k] for k in ("first_heartbeat_s", "first_estimate_s") if k in out]
        out["first_progress_after_start_s"] = min(firsts) - start
        if "first_estimate_s" in out:
            out["first_estimate_after_start_s"] = out["first_estimate_s"] - start
    return {k: None if v is None else round(v, 1) for k, v in out.items()}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_cli(root: Path, run_dir: Path, overrides: list[str], log: Path) -> dict:
    """One `torchsprint train` run as a subprocess (stdout a pipe): the parsed times, summary.json's figures."""
    cmd = [sys.executable, "-m", "torchsprint", "train", f"data.root={root}", f"run.dir={run_dir}", *overrides]
    before = load()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    with open(log, "w") as f:
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))
            f.write(f"{lines[-1][0]:8.1f} {line}")
            f.flush()  # the log shows how far a long run has got
    rc = proc.wait()
    wall = time.monotonic() - t0
    row = {
        "cmd": " ".join(["python -m torchsprint train", "data.root=DIR", *overrides]),
        "rc": rc,
        "wall_s": round(wall, 1),
        "load_before": before,
        "load_after": load(),
        **parse_lines(lines),
    }
    summaries = sorted(run_dir.rglob("summary.json"))
    if summaries:
        s = json.loads(summaries[-1].read_text())
        final = s.get("final", {})
        row |= {
            "summary_keys": sorted(s),
            "train_images_per_s": s.get("train_images_per_s"),
            "final": {k: v for k, v in final.items() if not isinstance(v, list | dict)},
        }
        if s.get("paused"):  # stopped by run.max_time: its last evaluation may be epochs old; evaluate where it stopped
            row["at_stop"] = eval_at_stop(run_dir)
    return row


def eval_at_stop(run_dir: Path) -> dict:
    """The latest checkpoint's model weights as a .safetensors file, evaluated by `torchsprint eval --weights FILE`
    (the CLI's own evaluation of the validation split; its time is not counted in the run's wall time)."""
    import torch
    from safetensors.torch import save_file

    from torchsprint.state.checkpoint import strip_prefixes

    status = json.loads((run_dir / "checkpoints" / "status.json").read_text())
    ckpt = torch.load(run_dir / "checkpoints" / status["latest"], map_location="cpu", weights_only=False)
    state = {k: v.contiguous() for k, v in strip_prefixes(ckpt["model"]).items()}
    path = run_dir / "at_stop.safetensors"
    save_file(state, str(path))
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "torchsprint", "eval", "-r", str(run_dir), "--weights", str(path), "--json"],
        capture_output=True,
        text=True,
    )
    out = {
        "checkpoint": status["latest"],
        "step": ckpt["train_state"].get("global_step") if isinstance(ckpt["train_state"], dict) else None,
        "eval_s": round(time.monotonic() - t0, 1),
        "rc": p.returncode,
    }
    try:
        out["metrics"] = {
            k: v for k, v in json.loads(p.stdout[p.stdout.index("{") :]).items() if not isinstance(v, list | dict)
        }
    except ValueError:
        out["error"] = (p.stdout + p.stderr)[-500:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--cases", default="rgb300,grey300,rgb500", help=f"folders, from {sorted(FOLDERS)}")
    ap.add_argument(
        "--runs", default="new,old", help="new (defaults), old (small_cnn, native size), full (resnet18, native size)"
    )
    ap.add_argument("--out", type=Path, required=True, help="results JSON (rewritten after every run)")
    ap.add_argument("--logs", type=Path, default=None, help="folder for each run's timestamped output")
    ap.add_argument(
        "--max-time", default=None, help="run.max_time of the new defaults' run (e.g. 15m: the issue's goal)"
    )
    ap.add_argument(
        "--new-from",
        type=Path,
        default=None,
        help="a results JSON whose `new` runs give the old/full runs' run.max_time (when --runs has no new)",
    )
    ap.add_argument(
        "--extra", nargs="*", default=[], help="overrides added to every run (e.g. run.max_steps=5 for a try)"
    )
    args = ap.parse_args()
    import torch

    import torchsprint

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torchsprint": torchsprint.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "images": args.images,
        "shares": SHARES,
        "cases": {},
    }
    logs = args.logs or Path(tempfile.mkdtemp(prefix="photo_folder_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            w, h, mode = FOLDERS[case]
            root = Path(tmp) / case
            counts = make_folder(root, args.images, w, h, mode)
            rows = result["cases"][case] = {"size": [w, h], "mode": mode, "counts": counts}
            new_wall = None
            if args.new_from is not None:  # the new defaults' run measured before, on this machine: its wall time
                rows["new_from"] = {
                    "file": str(args.new_from),
                    **json.loads(args.new_from.read_text())["cases"][case]["new"],
                }
                new_wall = rows["new_from"]["wall_s"]
            for kind in args.runs.split(","):
                if kind == "new":
                    ov = [f"run.epochs={args.epochs}"] + ([f"run.max_time={args.max_time}"] if args.max_time else [])
                elif kind == "old":
                    ov = [
                        "model.name=small_cnn",
                        "data.train.transforms=[]",
                        "data.eval.transforms=[]",
                        f"run.epochs={args.epochs}",
                        f"run.max_time={int(new_wall)}s",
                    ]
                else:  # the new default model at the native size: the same crop scale, flip, lr and warm-up, no resize
                    from torchsprint.data.detect import PHOTO_LR_PER_256, PHOTO_WARMUP_EPOCHS

                    ov = [
                        "model.name=resnet18",
                        f"data.train.transforms=[{{random_resized_crop: {{size: [{h}, {w}], "
                        "scale: [0.35, 1.0]}}, hflip]",
                        "data.eval.transforms=[]",
                        f"optim.lr={PHOTO_LR_PER_256 * 64 / 256}",
                        f"sched.warmup_epochs={PHOTO_WARMUP_EPOCHS}",
                        f"run.epochs={args.epochs}",
                        f"run.max_time={int(new_wall)}s",
                    ]
                row = run_cli(root, Path(tmp) / f"{case}_{kind}", ov + args.extra, logs / f"{case}_{kind}.log")
                rows[kind] = row
                if kind == "new":
                    new_wall = row["wall_s"]
                print(json.dumps({case: {kind: row}}), flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"logs: {logs}", flush=True)


if __name__ == "__main__":
    main()
