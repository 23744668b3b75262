"""torchsprint's engine vs a plain hand-written PyTorch loop (seed 004's loop), same job, interleaved runs.

Engine cases: both sides train the same model on the same in-memory data with the same batch size,
optimizer (SGD, Nesterov momentum, weight decay) and schedule (cosine, stepped per epoch) for enough
epochs to make at least --steps optimizer steps; the sides alternate inside every repeat in a rotating
order, so machine load hits all alike. "same settings" runs torchsprint's `cpu` backend (a DataLoader,
like the plain loop) with speed.channels_last=false (NCHW, like the plain loop); "own defaults" runs its
memory backend with speed.channels_last=auto (the default: a model with 2-D convolutions in NHWC). The table reports
median images/s, the median of the per-repeat ratios, and the per-step overhead in microseconds (median over repeats of
batch * (1/torchsprint - 1/plain)); a negative overhead means torchsprint's step is cheaper.

"digits_default": `torchsprint train` with its defaults (digits, small_cnn, batch 64, 10 epochs, cosine per
step, data.backend auto = memory, an evaluation and a checkpoint every epoch) vs the same job in a plain
loop (evaluated every epoch too); the ratio compares training images/s (evaluation and checkpoints are
timed apart on both sides; torchsprint's from its summary.json, whole-run seconds shown beside).

Threads: torch's default (all cores: two on a 2-core machine) unless --threads. Under machine load, wall
times of the two-thread case are noisy; --threads 1 and more --repeats tighten them.

    python -m benchmarks.compare.vs_plain_pytorch [--repeats 5] [--steps 600] [--threads N] [--clock wall|process]
        [--cases digits,linear32,linear128,small_cnn,resnet18,digits_default]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.engine_cases import CASES, SHAPES, make_data, register, torchsprint_run
from torchsprint import config
from torchsprint.data import DATASETS
from torchsprint.models import build_model

CLOCK = time.perf_counter  # --clock process: time.process_time (CPU seconds of this process: steadier under load);
# both sides read it: plain_run here, torchsprint_run (common/engine_cases.py) as its `clock`


def digits_data():
    sp = DATASETS.get("digits")(config.load(None, []).data)
    return sp.train.images, torch.as_tensor(sp.train.labels), sp.val.images, torch.as_tensor(sp.val.labels)


def sgd(model, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)


def plain_run(model_name: str, x, y, batch_size: int, lr: float, epochs: int) -> float:
    """Seed 004's loop: DataLoader over a TensorDataset, zero_grad / forward / loss / backward / step; cosine per
    epoch."""
    torch.manual_seed(0)
    model = build_model(config.load(None, [f"model.name={model_name}"]).model, 10, x.shape[1])
    model(x[:2].float())  # materialise lazy layers, as torchsprint does
    data = torch.utils.data.TensorDataset(x.float() * (1 / 255.0), y)  # preprocessing done once, up front
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True)
    opt = sgd(model, lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    criterion = nn.CrossEntropyLoss()
    model.train()
    t = CLOCK()
    for _ in range(epochs):
        for img, labels in loader:
            opt.zero_grad()
            loss = criterion(model(img), labels)
            loss.backward()
            opt.step()
        sched.step()
    return epochs * len(loader) * batch_size / (CLOCK() - t)


def plain_default_run(x, y, xv, yv) -> tuple[float, float]:
    """The default digits job in a plain loop: small_cnn, batch 64, SGD, cosine per step, 10 epochs, evaluated
    every epoch. Returns (training images/s, whole-run seconds)."""
    cfg = config.load(None, [])
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, 10, x.shape[1])
    mean, std = 0.5, 0.5  # any fixed normalisation: done once, up front
    data = torch.utils.data.TensorDataset((x.float() / 255 - mean) / std, y)
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True, drop_last=True)
    xv = (xv.float() / 255 - mean) / std
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.run.epochs * len(loader))
    criterion = nn.CrossEntropyLoss()
    train_s, t_all = 0.0, time.perf_counter()
    for _ in range(cfg.run.epochs):
        model.train()
        t = time.perf_counter()
        for img, labels in loader:
            opt.zero_grad()
            criterion(model(img), labels).backward()
            opt.step()
            sched.step()
        train_s += time.perf_counter() - t
        model.eval()
        with torch.inference_mode():
            (model(xv).argmax(1) == yv).float().mean().item()
    return cfg.run.epochs * len(loader) * 64 / train_s, time.perf_counter() - t_all


def torchsprint_default_run(work: Path) -> tuple[float, float]:
    """`torchsprint train` with its defaults (console quiet, files written). Returns (train images/s, seconds)."""
    from torchsprint.train.run import train

    run_dir = Path(tempfile.mkdtemp(dir=work))
    t = time.perf_counter()
    summary = train(config.load(None, [f"run.dir={run_dir}"]), quiet=True)
    return summary["train_images_per_s"], time.perf_counter() - t


def overhead_us(ts: float, plain: float, batch_size: int) -> float:
    return batch_size * (1 / ts - 1 / plain) * 1e6


def engine_case(name: str, args, log_dir: Path) -> None:
    model, data, bs, lr = CASES[name]
    if data == "digits":
        x, y, _, _ = digits_data()
        dataset = "digits"
    else:
        x, y = make_data(data, SHAPES[model])
        register(x, y)
        dataset = "bench_tensors"
    epochs = max(1, math.ceil(args.steps / (len(x) // bs)))
    plain = partial(plain_run, model, x, y, bs, lr, epochs)
    plain_run(model, x, y, bs, lr, 1)  # warm-up: allocator, first-call kernels
    torchsprint_run(model, dataset, bs, lr, "cpu", 1, log_dir, "false", CLOCK)
    torchsprint_run(model, dataset, bs, lr, "memory", 1, log_dir, clock=CLOCK)
    p, s, m = [], [], []
    sides = [
        (p, plain),
        (s, partial(torchsprint_run, model, dataset, bs, lr, "cpu", epochs, log_dir, "false", CLOCK)),
        (m, partial(torchsprint_run, model, dataset, bs, lr, "memory", epochs, log_dir, clock=CLOCK)),
    ]
    for r in range(args.repeats):
        for out, fn in sides[r % 3 :] + sides[: r % 3]:  # rotate the order: no side always runs first
            out.append(fn())
    cols = []
    for side in (s, m):
        cols.append(
            f"{statistics.median(side):.0f} | {statistics.median(a / b for a, b in zip(side, p)):.2f}x | "
            f"{statistics.median(overhead_us(a, b, bs) for a, b in zip(side, p)):+.0f}"
        )
    print(
        f"| {name} (n={len(x)}, bs={bs}, {epochs} ep) | {statistics.median(p):.0f} | {cols[0]} | {cols[1]} |",
        flush=True,
    )


def default_case(args, work: Path) -> None:
    x, y, xv, yv = digits_data()
    torchsprint_default_run(work)  # warm-up
    p, s = [], []
    for r in range(args.repeats):
        sides = [(p, lambda: plain_default_run(x, y, xv, yv)), (s, lambda: torchsprint_default_run(work))]
        for out, fn in sides[r % 2 :] + sides[: r % 2]:
            out.append(fn())
    ratio = statistics.median(a[0] / b[0] for a, b in zip(s, p))
    over = statistics.median(overhead_us(a[0], b[0], 64) for a, b in zip(s, p))
    print(
        f"\ndigits default run ({args.repeats} interleaved pairs): plain loop {statistics.median(a for a, _ in p):.0f} "
        f"train img/s ({statistics.median(b for _, b in p):.2f} s whole run), torchsprint train defaults "
        f"{statistics.median(a for a, _ in s):.0f} train img/s ({statistics.median(b for _, b in s):.2f} s whole run, "
        f"evaluation, checkpoints and files included): {ratio:.2f}x, {over:+.0f} us/step",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=600, help="at least this many optimizer steps per measurement")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--cases", default="digits,linear32,linear128,small_cnn,resnet18,digits_default")
    ap.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="process: CPU seconds (time.process_time) instead of wall seconds; engine cases only",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "process":
        global CLOCK
        CLOCK = time.process_time
    import os

    work = Path(tempfile.mkdtemp(prefix="vs-plain-"))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, {args.repeats} interleaved "
        f"repeats, >= {args.steps} steps each, load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        "| case | plain loop img/s | torchsprint, same settings (cpu backend, NCHW) img/s | ratio | overhead us/step "
        "| torchsprint, own defaults (memory backend, channels_last auto) img/s | ratio | overhead us/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        if name == "digits_default":
            default_case(args, work)
        else:
            engine_case(name, args, work)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
