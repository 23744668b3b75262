"""`torchsprint tune` given 4x the default run's wall time, against the defaults, on an imbalanced photo set.

For each seed: `torchsprint train data.root=DIR run.seed=S` (the photo defaults, nothing else set) is timed, its best
weights evaluated on the set's test/ split (`torchsprint eval --split test`, images neither the run nor the search
ever saw); then `torchsprint tune data.root=DIR run.seed=S tune.seed=S --budget 4W --trial-time T` (W the default
run's wall time; T = W x --trial-share, 1 by default: each trial as long as the default run, as 0.5 left ResNet-18
at 0.25-0.30 balanced accuracy on midhard) searches the space chosen from the data,
and the best trial (by the validation metric the search optimised, balanced accuracy on imbalanced classes) is
evaluated on the same test split by tune itself (tune.json's best.test). The figures compared: top-1, balanced
accuracy, macro-F1 and the weakest class's recall on test.

Sets: `midhard` (benchmarks/defaults/imbalance.py's generated 80x80 grey shapes, 14x imbalance, train 1,400 / 500 /
200 / 100, val and test 420 / 150 / 60 / 30) and `real` (crops of scikit-image's real photographs,
benchmarks/common/real_photos.py, 14x: 1,400 / 700 / 424 / 100, here at --real-side px with a test/ split cut off).

    python -m benchmarks.defaults.tune_vs_defaults --set midhard --seeds 0,1,2 \\
        --out benchmarks/results/tune_vs_defaults_cpu-epyc_2026-12-02.json
    python -m benchmarks.defaults.tune_vs_defaults --out benchmarks/results/tune_vs_defaults_cpu-epyc_2026-12-02.json \\
        --table
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.defaults.imbalance import CLASSES, TRAIN, VAL, make_folder

KEYS = ("top1", "balanced_acc", "f1_macro", "min_recall")


def make_set(name: str, root: Path, cache: Path, real_side: int) -> None:
    if (root / "train").is_dir():
        return
    if name == "midhard":
        make_folder(root, CLASSES, {"train": TRAIN, "val": VAL, "test": VAL}, 80, 0, "midhard")
        return
    from benchmarks.common.real_photos import make_real_photos

    flat = root.parent / (root.name + "_flat")
    make_real_photos(flat, cache, side=real_side, counts=(2000, 1000, 606, 143), mode="L", fmt="png", seed=0)
    # train / val / test at 70 / 15 / 15 per class (the train part 1,400 / 700 / 424 / 100: 14x)
    for cls in sorted(p.name for p in flat.iterdir()):
        files = sorted((flat / cls).iterdir())
        n = len(files)
        cut = [0, round(n * 0.7), round(n * 0.85), n]
        for split, (a, b) in zip(("train", "val", "test"), zip(cut, cut[1:])):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for f in files[a:b]:
                shutil.move(str(f), root / split / cls / f.name)
    shutil.rmtree(flat)


def sh(cmd: list[str], log: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, round(time.monotonic() - t0, 1)


def test_metrics(run_dir: Path, log: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "torchsprint", "eval", "-r", str(run_dir), "--split", "test", "--json"],
        capture_output=True,
        text=True,
    )
    log.write_text(r.stdout + r.stderr)
    m = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: m.get(k) for k in (*KEYS, "min_recall_class")}


def one_seed(name: str, root: Path, work: Path, seed: int, share: float) -> dict:
    tm = sys.executable, "-m", "torchsprint"
    d = work / f"{name}_defaults_{seed}"
    shutil.rmtree(d, ignore_errors=True)
    rc, wall = sh([*tm, "train", f"data.root={root}", f"run.seed={seed}", f"run.dir={d}"], work / f"{d.name}.log")
    assert rc == 0, f"defaults seed {seed}: exit {rc}, see {work / d.name}.log"
    out = {"defaults": {"wall_s": wall, "test": test_metrics(d, work / f"{d.name}_eval.log")}}
    budget, trial = round(4 * wall), max(10, round(share * wall))
    t = work / f"{name}_tune_{seed}"
    shutil.rmtree(t, ignore_errors=True)
    cmd = [*tm, "tune", f"data.root={root}", f"run.seed={seed}", f"tune.seed={seed}", "--out", str(t)]
    rc, twall = sh([*cmd, "--budget", f"{budget}s", "--trial-time", f"{trial}s"], work / f"{t.name}.log")
    assert rc == 0, f"tune seed {seed}: exit {rc}, see {work / t.name}.log"
    summary = json.loads((t / "tune.json").read_text())
    best = summary["best"]
    out["tune"] = {
        "wall_s": twall,
        "budget_s": budget,
        "trial_time_s": trial,
        "trials": summary["trials"],
        "space": summary["space"],
        "best": {"trial": best["trial"], "val": best["values"], "params": best["params"]},
        "test": {k: best["test"].get(k) for k in (*KEYS, "min_recall_class")},
        "trials_md": (t / "trials.md").read_text(),
        "folder": str(t),
    }
    return out


def table(results: dict) -> str:
    rows = ["| set | seed | run | wall s | trials (complete / pruned / failed) | " + " | ".join(KEYS) + " |"]
    rows.append("|" + "---|" * (5 + len(KEYS)))
    for name, seeds in results.items():
        for seed, r in sorted(seeds.items()):
            for run in ("defaults", "tune"):
                x = r[run]
                tr = x.get("trials")
                trials = f"{tr['complete']} / {tr['pruned']} / {tr['fail']}" if tr else ""
                vals = " | ".join(f"{x['test'][k]:.3f}" for k in KEYS)
                rows.append(f"| {name} | {seed} | {run} | {x['wall_s']:.0f} | {trials} | {vals} |")
            diff = " | ".join(f"{100 * (r['tune']['test'][k] - r['defaults']['test'][k]):+.1f}" for k in KEYS)
            rows.append(f"| {name} | {seed} | tune - defaults (points) | | | {diff} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="midhard", choices=("midhard", "real"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trial-share", type=float, default=1.0, help="each trial's time as a share of the default run's")
    ap.add_argument("--real-side", type=int, default=160)
    ap.add_argument("--work", default="/tmp/tune_vs_defaults")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", action="store_true", help="print the table of --out and stop")
    a = ap.parse_args()
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if a.table:
        print(table(results.get("results", {})))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    root = work / f"data_{a.set}"
    make_set(a.set, root, work, a.real_side)
    res = results.setdefault("results", {}).setdefault(a.set, {})
    for seed in (int(s) for s in a.seeds.split(",")):
        res[str(seed)] = one_seed(a.set, root, work, seed, a.trial_share)
        results["machine"] = {"cpu": cpu(), "torch": torch_version(), "revision": revision()}
        out.write_text(json.dumps(results, indent=1))
        print(table({a.set: {str(seed): res[str(seed)]}}), flush=True)


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def torch_version() -> str:
    import torch

    return torch.__version__


def revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
