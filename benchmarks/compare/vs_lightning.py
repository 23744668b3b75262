"""torchsprint vs PyTorch Lightning's Trainer on the same jobs, alternating runs in one process.

Lightning is not a dependency: `pip install lightning` first (the script says so when it is missing).
Both sides train the same model on the same in-memory uint8 data with the same batch size and optimizer
(SGD, Nesterov momentum, constant LR) for one epoch; Lightning gets its fastest honest settings
(no logger, no checkpointing, no progress bar, no model summary, no sanity check) and the same
DataLoader the plain loop uses. torchsprint runs with its own defaults for such data (`memory` backend,
`speed.channels_last: auto`) and also with a DataLoader (`cpu` backend, NCHW like Lightning's side).
Reported: median images/s and the median per-repeat ratio.

    python -m benchmarks.compare.vs_lightning [--repeats 5] [--cases linear32,linear128,small_cnn,resnet18]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.engine_cases import CASES, SHAPES, make_data, register, torchsprint_run
from torchsprint import config
from torchsprint.models import build_model


def lightning_epoch(model_name: str, x, y, batch_size: int, lr: float) -> float:
    import lightning as L

    torch.manual_seed(0)
    net = build_model(config.load(None, [f"model.name={model_name}"]).model, 10, x.shape[1])
    net(x[:2].float())

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net
            self.criterion = nn.CrossEntropyLoss()

        def training_step(self, batch, _):
            img, labels = batch
            return self.criterion(self.net(img), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    data = torch.utils.data.TensorDataset(x.float() * (1 / 255.0), y)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True)

    class EpochTimer(L.Callback):  # time the epoch itself, like torchsprint's epoch timer (setup excluded)
        def on_train_epoch_start(self, *_):
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, *_):
            self.seconds = time.perf_counter() - self.t0

    timer = EpochTimer()
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(Module(), loader)
    return len(loader) * batch_size / timer.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--cases",
        default="linear32,linear128,small_cnn,resnet18",
        help="cases of common/engine_cases.py's CASES on generated data",
    )
    args = ap.parse_args()
    try:
        import lightning
    except ImportError:
        raise SystemExit(
            "PyTorch Lightning is not installed: `pip install lightning` (benchmark only, not a dependency)"
        ) from None
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    log_dir = Path(tempfile.mkdtemp(prefix="vs-lightning-"))
    print(
        f"torch {torch.__version__}, lightning {lightning.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} repeats, one epoch each (epoch time only, setup excluded on both sides)"
    )
    print(
        "| case | Lightning img/s | torchsprint cpu loader img/s | "
        "ratio | torchsprint own defaults (memory) img/s | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        model, n, bs, lr = CASES[name]
        x, y = make_data(n, SHAPES[model])
        register(x, y)
        lightning_epoch(model, x, y, bs, lr)  # warm-up
        torchsprint_run(model, "bench_tensors", bs, lr, "memory", 1, log_dir)
        lt, sc, sm = [], [], []
        sides = [
            (lt, partial(lightning_epoch, model, x, y, bs, lr)),
            (sc, partial(torchsprint_run, model, "bench_tensors", bs, lr, "cpu", 1, log_dir, "false")),
            (sm, partial(torchsprint_run, model, "bench_tensors", bs, lr, "memory", 1, log_dir)),
        ]
        for r in range(args.repeats):
            for out, fn in sides[r % 3 :] + sides[: r % 3]:  # rotate the order: no side always runs first
                out.append(fn())
        rc = statistics.median(a / b for a, b in zip(sc, lt))
        rm = statistics.median(a / b for a, b in zip(sm, lt))
        print(
            f"| {name} (n={n}, bs={bs}) | {statistics.median(lt):.0f} | {statistics.median(sc):.0f} | {rc:.2f}x | "
            f"{statistics.median(sm):.0f} | {rm:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
