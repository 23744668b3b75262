"""torchsprint's engine vs a plain hand-written PyTorch loop (seed 004's loop), same job, alternating runs.

For each case both sides train the same model on the same in-memory data with the same batch size and
optimizer for one epoch; the sides alternate inside every repeat, in a rotating order, so machine load hits all alike, and
the table reports median images/s and the median of the per-repeat ratios. "same settings" runs
torchsprint's `cpu` backend (a DataLoader, like the plain loop); "own defaults" its `memory` backend.

    python benchmarks/vs_plain_pytorch.py [--repeats 5] [--cases linear32,linear128,small_cnn,resnet18]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from torchsprint import config, runtime
from torchsprint.checkpoint import TrainState
from torchsprint.data import DATASETS
from torchsprint.data.core import Splits, TensorImages
from torchsprint.engine import set_train_mode, train_one_epoch
from torchsprint.logging import RunLogger
from torchsprint.models import build_model
from torchsprint.run import build_training

SHAPES = {"linear": (3, 8, 8), "small_cnn": (3, 16, 16), "resnet18": (3, 32, 32)}


def make_data(n: int, shape: tuple[int, int, int], classes: int = 10):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def register(x, y):
    @DATASETS.register("bench_tensors", override=True)
    def bench_tensors(data_cfg) -> Splits:
        return Splits(TensorImages(x, y), TensorImages(x[:256], y[:256]), [str(i) for i in range(10)], x.shape[1])


def plain_epoch(model_name: str, x, y, batch_size: int, lr: float) -> float:
    """Seed 004's loop: DataLoader over a TensorDataset, zero_grad / forward / loss / backward / step."""
    torch.manual_seed(0)
    model = build_model(config.load(None, [f"model.name={model_name}"]).model, 10, x.shape[1])
    model(x[:2].float())  # materialise lazy layers, as torchsprint does
    data = torch.utils.data.TensorDataset(x.float() * (1 / 255.0), y)  # preprocessing done once, up front
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()
    model.train()
    t = time.perf_counter()
    for img, labels in loader:
        opt.zero_grad()
        loss = criterion(model(img), labels)
        loss.backward()
        opt.step()
    return len(loader) * batch_size / (time.perf_counter() - t)


def torchsprint_epoch(model_name: str, batch_size: int, lr: float, backend: str, log_dir: Path) -> float:
    """One epoch of the real engine (train_one_epoch: logging, progress, counters) on torchsprint's loader."""
    cfg = config.load(None, [
        f"model.name={model_name}", "data.dataset=bench_tensors", f"data.backend={backend}", "data.num_workers=0",
        f"data.batch_size={batch_size}", f"optim.lr={lr}", "optim.no_decay_norm_bias=false", "sched.name=constant",
        "log.tensorboard=false", "log.progress=false", "checkpoint.every_epochs=null", "run.device=cpu",
    ])
    rt = runtime.Runtime(device=torch.device("cpu"))
    torch.manual_seed(0)
    b = build_training(cfg, rt, log=lambda *_: None)
    logger = RunLogger(log_dir, cfg.log, enabled=True, console=False)
    set_train_mode(b.model, b.frozen_norms)
    ep = train_one_epoch(b.model, b.loaders.train, b.loss_fn, b.opt, b.sched, b.prec, TrainState(), cfg=cfg,
                         logger=logger, saver=None)
    logger.close()
    return ep["images"] / ep["seconds"]


CASES = {  # name: (model, samples, batch size, lr)
    "linear32": ("linear", 10_000, 32, 0.05),
    "linear128": ("linear", 10_000, 128, 0.05),
    "small_cnn": ("small_cnn", 4_000, 64, 0.05),
    "resnet18": ("resnet18", 1_024, 32, 0.01),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="vs-plain-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats, one epoch each")
    print("| case | plain loop img/s | torchsprint same settings img/s | ratio | torchsprint own defaults (memory) img/s | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        model, n, bs, lr = CASES[name]
        x, y = make_data(n, SHAPES[model])
        register(x, y)
        plain_epoch(model, x, y, bs, lr)  # warm-up: allocator, first-call kernels
        torchsprint_epoch(model, bs, lr, "cpu", log_dir)
        p, s, m = [], [], []
        sides = [(p, partial(plain_epoch, model, x, y, bs, lr)), (s, partial(torchsprint_epoch, model, bs, lr, "cpu", log_dir)),
                 (m, partial(torchsprint_epoch, model, bs, lr, "memory", log_dir))]
        for r in range(args.repeats):
            for out, fn in sides[r % 3:] + sides[: r % 3]:  # rotate the order: no side always runs first
                out.append(fn())
        rs = statistics.median(a / b for a, b in zip(s, p))
        rm = statistics.median(a / b for a, b in zip(m, p))
        print(f"| {name} (n={n}, bs={bs}) | {statistics.median(p):.0f} | {statistics.median(s):.0f} | {rs:.2f}x | "
              f"{statistics.median(m):.0f} | {rm:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
