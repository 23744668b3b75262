"""Where the speed probe's extra peak memory comes from (the goal: "peak memory no higher than timm's").

torchsprint's side of compare/vs_timm.py's job (ResNet-18 from scratch, 2,000 generated 160x160 JPEGs, batch 32,
RandomResizedCrop 112, 3 epochs) run by the CLI under GNU time, in variants that differ in one thing each:

  named          precision=amp_bf16 speed.channels_last=true: what the probe chooses on a native-bf16 CPU, no probe
  auto           the defaults: the probe times fp32/amp_bf16 x NHWC/NCHW on half a batch, then the run trains
  auto_mmap128k  the same under MALLOC_MMAP_THRESHOLD_=131072 (glibc: every block above 128 KiB its own mmap, given
                 back to the system when freed; a fixed threshold also stops glibc raising it as blocks are freed)
  auto_arena1    the same under MALLOC_ARENA_MAX=1 (one malloc arena for every thread)
  timm           timm's train.py with its fastest CPU switches (only with --timm-train; as compare/vs_timm.py)

and two in-process measurements:

  --heap         glibc's heap after the probe (mallinfo2: the heap's size, its bytes in use and free), with the probe
                 run as the CLI runs it and with the probe off (TORCHSPRINT_SPEED_PROBE=off), in a child process that
                 stops after the probe;
  --thread       one ResNet-18 amp_bf16 NHWC training step (batch 16, 112 px) timed on the main thread and on a second
                 Python thread (whose tensors glibc serves from another arena, which could be given back whole), and
                 under fixed mmap thresholds: what keeping the probe's memory out of the main heap would cost
                 its timing.

    python -m benchmarks.compare.probe_memory --json benchmarks/results/probe_memory_<device>_<date>.json \
        [--timm-train .../train.py]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.child import REPO, child_env
from benchmarks.common.gnu_time import peak_mib
from benchmarks.common.timm_job import make_data, timm_run  # the job of compare/vs_timm.py

JOB = [
    "data.batch_size=32",
    "data.eval_batch_size=32",
    "data.train.transforms=[{random_resized_crop: 112}, hflip, {normalize: imagenet}]",
    "data.eval.transforms=[{resize: 128}, {center_crop: 112}, {normalize: imagenet}]",
    "model.name=resnet18",
    "optim.lr=0.1",
    "sched.warmup_epochs=0",
    "run.seed=0",
    "log.tensorboard=false",
    "log.progress=false",
]
VARIANTS = {
    "named": (["precision=amp_bf16", "speed.channels_last=true"], {}),
    "auto": ([], {}),
    "auto_mmap128k": ([], {"MALLOC_MMAP_THRESHOLD_": "131072"}),
    "auto_arena1": ([], {"MALLOC_ARENA_MAX": "1"}),
}


def cli_run(data: Path, out: Path, name: str, extra: list[str], env: dict, epochs: int) -> dict:
    run_dir = out / name
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "torchsprint",
        "train",
        f"data.root={data}",
        *JOB,
        f"run.epochs={epochs}",
        f"run.dir={run_dir}",
        *extra,
    ]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | env, cwd=out)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    d = json.loads((run_dir / "decisions.json").read_text())
    return {
        "variant": name,
        "env": env,
        "overrides": extra,
        "peak_mib": peak_mib(r.stderr),
        "wall_s": round(wall, 1),
        "own_rate": s["train_images_per_s"],
        "top1": s["final"]["val/top1"],
        "precision": d.get("precision"),
        "channels_last": d.get("channels_last"),
        "probe": (d.get("speed_measured") or {}).get("candidates"),
    }


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap() -> dict:
    """glibc's mallinfo2 in MiB (every arena): the heap's size, in use, free; mmapped blocks; this process's RSS."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m, mib = libc.mallinfo2(), 2**20
    rss = hwm = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            rss = int(line.split()[1]) // 1024
        if line.startswith("VmHWM"):
            hwm = int(line.split()[1]) // 1024
    return {
        "heap_mib": m.arena // mib,
        "in_use_mib": m.uordblks // mib,
        "free_mib": m.fordblks // mib,
        "mmapped_mib": m.hblkhd // mib,
        "rss_mib": rss,
        "peak_mib": hwm,
    }


def heap_child(argv: list[str]) -> None:
    """In a child: the CLI's run up to the end of the probe, then the heap as glibc sees it (JSON on stdout)."""
    import torchsprint.train.speed_probe as sp

    real = sp.decide_auto

    def decide(*a, **k):
        real(*a, **k)
        print("HEAP " + json.dumps(heap()), flush=True)
        os._exit(0)

    sp.decide_auto = decide
    from torchsprint.cli import main

    main(["train", *argv])


def heap_runs(data: Path, out: Path) -> dict:
    res = {}
    for name, env in (("probe", {}), ("probe_off", {"TORCHSPRINT_SPEED_PROBE": "off"})):
        argv = [f"data.root={data}", *JOB, "run.epochs=3", f"run.dir={out / ('heap_' + name)}"]
        r = subprocess.run(
            [sys.executable, "-m", __spec__.name, "--heap-child", *argv],
            capture_output=True,
            text=True,
            env=child_env(env),
            cwd=out,
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("HEAP ")]
        if not line:
            raise SystemExit(f"heap child {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        res[name] = json.loads(line[0][5:])
        print(name, res[name], flush=True)
    return res


THREAD_STEP = """
import statistics, threading, time, torch, torchvision
torch.manual_seed(0)
m = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(16, 3, 112, 112).contiguous(memory_format=torch.channels_last); y = torch.randint(0, 10, (16,))
def steps(n, out):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        ts.append(time.perf_counter() - t)
    out.extend(ts[2:])
main, other = [], []
for _ in range(3):
    steps(8, main)
    t = threading.Thread(target=steps, args=(8, other)); t.start(); t.join()
print(round(1000 * statistics.median(main), 1), round(1000 * statistics.median(other), 1))
"""


def thread_runs() -> dict:
    """Step ms on the main thread and on a second thread, under glibc's default and fixed mmap thresholds."""
    res = {}
    for name, env in (
        ("default", {}),
        ("mmap_32MiB", {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}),
        ("mmap_4MiB", {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)}),
        ("mmap_128KiB", {"MALLOC_MMAP_THRESHOLD_": "131072"}),
    ):
        r = subprocess.run([sys.executable, "-c", THREAD_STEP], capture_output=True, text=True, env=os.environ | env)
        main_ms, thread_ms = (float(v) for v in r.stdout.split())
        res[name] = {"main_thread_ms": main_ms, "second_thread_ms": thread_ms}
        print(name, res[name], flush=True)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--heap-child":
        heap_child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {list(VARIANTS)}")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timm-train", default=None, help="timm's train.py: its run beside (as compare/vs_timm.py)")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: runs, heap, thread")
    ap.add_argument("--root", default="/tmp/vs_timm")
    ap.add_argument("--smoke", action="store_true", help="120 train / 40 val images, 1 epoch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from torchsprint.runtime.machine import cpu_info

    train, val = (120, 40) if args.smoke else (2000, 500)
    epochs = 1 if args.smoke else args.epochs
    data = make_data(Path(args.root), train, val)
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "revision": rev,
        "epochs": epochs,
        "runs": [],
    }
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if "runs" not in skip:
            for name in args.variants.split(","):
                extra, env = VARIANTS[name]
                result["runs"].append(cli_run(data, out, name, extra, env, epochs))
                print(result["runs"][-1], flush=True)
            if args.timm_train:
                ns = argparse.Namespace(timm_train=args.timm_train, epochs=epochs)
                r = timm_run(ns, data, 0, 0, result["cpu"]["native_bf16"], out)
                result["runs"].append({"variant": "timm", **r})
                print(result["runs"][-1], flush=True)
        if "heap" not in skip:
            result["heap_after_probe"] = heap_runs(data, out)
        if "thread" not in skip:
            result["step_ms"] = thread_runs()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for r in result["runs"]:
        print(
            f"{r['variant']:<14} peak {r['peak_mib']:5d} MiB  wall {r['wall_s']:6.1f} s  own {r['own_rate']:6.1f} img/s"
            f"  top-1 {r['top1']:.3f}"
        )


if __name__ == "__main__":
    main()
