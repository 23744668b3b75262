"""The engine cases torchsprint is timed on beside another loop (compare/vs_plain_pytorch.py, compare/vs_lightning.py):
generated in-memory data, its registration as a data set, and `epochs` epochs of torchsprint's real engine on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchsprint import config, runtime
from torchsprint.data import DATASETS
from torchsprint.data.core import Splits, TensorImages
from torchsprint.observe.logging import RunLogger
from torchsprint.state.checkpoint import TrainState
from torchsprint.train.build import build_training
from torchsprint.train.context import RunContext
from torchsprint.train.engine import set_train_mode, train_one_epoch

SHAPES = {"linear": (3, 8, 8), "small_cnn": (3, 16, 16), "resnet18": (3, 32, 32)}  # per model: CHW of its data
CASES = {  # name: (model, data: a data set's name or a count of generated samples, batch size, lr)
    "digits": ("small_cnn", "digits", 64, 0.1),
    "linear32": ("linear", 10_000, 32, 0.05),
    "linear128": ("linear", 10_000, 128, 0.05),
    "small_cnn": ("small_cnn", 4_000, 64, 0.05),
    "resnet18": ("resnet18", 1_024, 32, 0.01),
}


def make_data(n: int, shape: tuple[int, int, int], classes: int = 10):
    """n seeded random uint8 images of `shape` (CHW) and their labels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def register(x, y) -> None:
    """`data.dataset=bench_tensors`: x, y for training, their first 256 for validation."""

    @DATASETS.register("bench_tensors", override=True)
    def bench_tensors(data_cfg) -> Splits:
        return Splits(TensorImages(x, y), TensorImages(x[:256], y[:256]), [str(i) for i in range(10)], x.shape[1])


def torchsprint_run(
    model_name: str,
    dataset: str,
    batch_size: int,
    lr: float,
    backend: str,
    epochs: int,
    log_dir: Path,
    channels_last: str = "auto",
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """`epochs` epochs of the real engine (train_one_epoch: logging, counters, accuracy) on torchsprint's loader:
    training images/s by `clock` (wall time by default; the caller's plain side uses the same clock)."""
    cfg = config.load(
        None,
        [
            f"model.name={model_name}",
            f"data.dataset={dataset}",
            f"data.backend={backend}",
            "data.num_workers=0",
            f"data.batch_size={batch_size}",
            f"optim.lr={lr}",
            "optim.no_decay_norm_bias=false",
            "sched.name=cosine",
            "sched.interval=epoch",
            f"run.epochs={epochs}",
            "log.tensorboard=false",
            "log.progress=false",
            "checkpoint.every_epochs=null",
            "run.device=cpu",
            f"speed.channels_last={channels_last}",
        ],
    )
    rt = runtime.Runtime(device=torch.device("cpu"))
    torch.manual_seed(0)
    b = build_training(cfg, rt, log=lambda *_: None)
    logger = RunLogger(log_dir, cfg.log, enabled=True, console=False)
    set_train_mode(b.model, b.frozen_norms)
    state, images = TrainState(), 0
    t = clock()  # around the whole loop, as on the plain side (the engine's own clock is wall time)
    for epoch in range(epochs):
        state.epoch, state.step_in_epoch = epoch, 0
        ep = train_one_epoch(b, state, b.plan, RunContext(rt, log_dir, logger))
        b.sched.step()
        images += ep["images"]
    seconds = clock() - t
    logger.close()
    return images / seconds
