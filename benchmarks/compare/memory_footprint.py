"""Peak memory of a whole training process tree: torchsprint train vs torchvision's reference script, same job.

Each command runs in its own subprocess; a thread here samples every process of its tree (the trainer,
its DataLoader workers) from /proc and keeps the peaks of
  - the tree's summed RSS (VmRSS: what `top` shows; a page shared by several processes counts once per process),
  - the tree's summed PSS (/proc/<pid>/smaps_rollup: a shared page counts 1/n in each of the n processes
    sharing it, so the sum counts it once: the memory the job really holds, copy-on-write copies included),
and the per-process RSS split (anonymous / file / shmem) at the RSS peak, which says where a difference lives.

The job: ResNet-18 at 112 px, batch 32, 2 DataLoader workers, 3 epochs, on an image folder
(train/ and val/, e.g. 2,000 + 200 JPEGs from torchsprint's synthetic_jpeg generator), CPU.

    python -m benchmarks.compare.memory_footprint --data /tmp/memdata/jpeg2000 --tv-reference /tmp/tv_reference \
        [--epochs 3] [--repeats 1] [--variants cpu,memory,torchvision]

--tv-reference is a folder holding torchvision's references/classification/{train,presets,utils,transforms}.py
(from github.com/pytorch/vision; not shipped with torchsprint). Variants run interleaved, `--repeats` times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchsprint.commands.bench.measure import TreeRss


class TreeMemory(TreeRss):
    """TreeRss plus the tree's peak PSS and the per-process RSS split at the RSS peak."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        super().__init__(pid, interval_s)
        self.peak_pss_kb = 0
        self.at_peak: list[dict] = []

    @staticmethod
    def _status(pid: int) -> dict:
        out = {}
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0])
            out["cmd"] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:60].decode(errors="replace")
        except OSError:
            pass
        return out

    @staticmethod
    def _rollup(pid: int) -> dict:
        """Pss and Private (= Private_Clean + Private_Dirty: pages no other process maps) in kB."""
        out = {"Pss": 0, "Private": 0}
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key == "Pss":
                    out["Pss"] = int(rest.split()[0])
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["Private"] += int(rest.split()[0])
        except OSError:
            pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = self._tree(self.pid)
            status = [self._status(p) | self._rollup(p) for p in pids]
            rss = sum(s.get("VmRSS", 0) for s in status)
            if rss > (self.peak_kb or 0):
                self.peak_kb, self.at_peak = rss, [s for s in status if s.get("VmRSS")]
            self.peak_pss_kb = max(self.peak_pss_kb, sum(s["Pss"] for s in status))
            self._stop.wait(self.interval_s)


def run_measured(cmd: list[str], env: dict, log: Path) -> dict:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        with TreeMemory(proc.pid) as mem:
            rc = proc.wait()
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {rc}; see {log}")
    return {
        "peak_rss_mb": mem.peak_kb / 1024,
        "peak_pss_mb": mem.peak_pss_kb / 1024,
        "wall_s": seconds,
        "at_peak": mem.at_peak,
    }


def torchsprint_cmd(args, backend: str, run_dir: Path) -> list[str]:
    size, resize = args.size, round(args.size * 256 / 224)
    return [
        sys.executable,
        "-m",
        "torchsprint",
        "train",
        "data.dataset=image_folder",
        f"data.root={args.data}",
        f"data.backend={backend}",
        "model.name=resnet18",
        f"data.batch_size={args.batch_size}",
        f"data.eval_batch_size={args.batch_size}",
        f"data.num_workers={args.workers}",
        f"run.epochs={args.epochs}",
        "run.device=cpu",
        f"run.dir={run_dir}",
        "log.progress=false",
        "log.tensorboard=false",
        f"data.train.transforms=[random_resized_crop: {size}, hflip, normalize: imagenet]",
        f"data.eval.transforms=[resize: {resize}, center_crop: {size}, normalize: imagenet]",
    ]


def torchsprint_train_ips(run_dir: Path) -> float | None:
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()).get("train_images_per_s") if summary.is_file() else None


def torchvision_cmd(args, out_dir: Path) -> list[str]:
    size, resize = args.size, round(args.size * 256 / 224)
    return [
        sys.executable,
        str(Path(args.tv_reference) / "train.py"),
        "--data-path",
        str(args.data),
        "--model",
        "resnet18",
        "--device",
        "cpu",
        "-b",
        str(args.batch_size),
        "-j",
        str(args.workers),
        "--epochs",
        str(args.epochs),
        "--train-crop-size",
        str(size),
        "--val-resize-size",
        str(resize),
        "--val-crop-size",
        str(size),
        "--lr",
        "0.1",
        "--wd",
        "5e-4",
        "--print-freq",
        "1000",
        "--output-dir",
        str(out_dir),
    ]


def torchvision_train_ips(log: Path, images_per_epoch: int) -> float | None:
    """Training images/s from the script's per-epoch 'Epoch: [e] Total time: H:MM:SS' lines (1 s resolution)."""
    secs = []
    for h, m, s in re.findall(r"Epoch: \[\d+\] Total time: (\d+):(\d+):(\d+)", log.read_text()):
        secs.append(int(h) * 3600 + int(m) * 60 + int(s))
    return len(secs) * images_per_epoch / sum(secs) if secs and sum(secs) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, type=Path, help="image folder with train/ and val/")
    ap.add_argument("--tv-reference", type=Path, help="folder with torchvision's references/classification scripts")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", default="cpu,memory,torchvision")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "torchvision" in variants and args.tv_reference is None:
        ap.error("--tv-reference is needed for the torchvision variant")
    n_train = sum(1 for p in (args.data / "train").rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    work = Path(tempfile.mkdtemp(prefix="memfoot-"))
    env = dict(os.environ)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotate: no variant always first
        for v in order:
            run = work / f"{v}-{r}"
            if v == "torchvision":
                run.mkdir()
                res = run_measured(torchvision_cmd(args, run), env, run.with_suffix(".log"))
                res["train_ips"] = torchvision_train_ips(
                    run.with_suffix(".log"), n_train // args.batch_size * args.batch_size
                )
            else:
                res = run_measured(torchsprint_cmd(args, v, run), env, run.with_suffix(".log"))
                res["train_ips"] = torchsprint_train_ips(run)
            results[v].append(res)
            print(
                f"{v} repeat {r}: peak tree RSS {res['peak_rss_mb']:.0f} MB, PSS {res['peak_pss_mb']:.0f} MB, "
                f"train {res['train_ips'] or float('nan'):.1f} img/s, wall {res['wall_s']:.0f} s",
                flush=True,
            )
            for p in res["at_peak"]:
                print(
                    f"    {p.get('VmRSS', 0) / 1024:6.0f} MB rss (anon {p.get('RssAnon', 0) / 1024:.0f}, "
                    f"file {p.get('RssFile', 0) / 1024:.0f}, shmem {p.get('RssShmem', 0) / 1024:.0f}), pss "
                    f"{p['Pss'] / 1024:.0f}, private {p['Private'] / 1024:.0f}  {p.get('cmd', '')[:40]}"
                )
    ref = results.get("torchvision")
    ref_rss = statistics.median(x["peak_rss_mb"] for x in ref) if ref else None
    ref_pss = statistics.median(x["peak_pss_mb"] for x in ref) if ref else None
    print(
        f"\nload average {os.getloadavg()[0]:.2f}; {args.epochs} epochs, batch {args.batch_size}, {args.workers} "
        f"workers, {args.size} px, {n_train} training images; medians of {args.repeats} run(s)"
    )
    print("| variant | peak tree RSS MB | vs torchvision | peak tree PSS MB | vs torchvision | train img/s |")
    print("|---|---|---|---|---|---|")
    for v, rs in results.items():
        rss = statistics.median(x["peak_rss_mb"] for x in rs)
        pss = statistics.median(x["peak_pss_mb"] for x in rs)
        ips = [x["train_ips"] for x in rs if x["train_ips"]]
        print(
            f"| {v} | {rss:.0f} | {rss / ref_rss:.2f}x | {pss:.0f} | {pss / ref_pss:.2f}x | "
            f"{statistics.median(ips) if ips else float('nan'):.1f} |"
            if ref
            else f"| {v} | {rss:.0f} | - | {pss:.0f} | - | {statistics.median(ips) if ips else float('nan'):.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
