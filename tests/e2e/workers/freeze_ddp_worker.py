"""DDP worker for tests/e2e/train/test_freeze_epochs.py:
`torchrun --nproc-per-node 2 tests/e2e/workers/freeze_ddp_worker.py OUT`.

Every rank trains the same model.freeze_epochs runs under strategy=ddp (gloo, SyncBatchNorm) in one process
start-up: OUT/full uninterrupted, OUT/a paused in a head-only epoch and resumed (the resumed process crosses
the switch), OUT/b paused after the switch and resumed (its process starts after it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchsprint import config
from torchsprint.train.run import train

# digits with val_fraction 0.5: 898 training images; global batch 64 -> 14 steps per epoch. The head of small_cnn
# is its last Linear ("7."). One process uses data.batch_size=64 (tests/e2e/train/test_freeze_epochs.py).
COMMON = [
    "model.args={width: 4}",
    "data.val_fraction=0.5",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "run.device=cpu",
    "data.backend=memory",
    "run.epochs=3",
    "model.freeze_epochs=2",
    "checkpoint.keep_last=3",
    "log.every_steps=1",
]
STEPS_PER_EPOCH = 14
DDP = [*COMMON, "strategy.name=ddp", "strategy.sync_bn=true", "data.batch_size=32"]
PAUSES = {"a": STEPS_PER_EPOCH // 2, "b": 2 * STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2}


def main(out: Path) -> None:
    train(config.load(None, [*DDP, f"run.dir={out / 'full'}"]), quiet=True)
    for run, step in PAUSES.items():
        train(config.load(None, [*DDP, f"run.dir={out / run}", f"run.stop_after_steps={step}"]), quiet=True)
        train(config.load(None, [*DDP, f"run.dir={out / run}", "checkpoint.resume=auto"]), quiet=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
