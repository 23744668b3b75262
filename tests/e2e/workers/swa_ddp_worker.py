"""DDP worker for tests/e2e/train/test_recipes_swa.py:
`torchrun --nproc-per-node 2 tests/e2e/workers/swa_ddp_worker.py OUT RUN_DIR`.

Every rank trains the same SWA run (strategy ddp, gloo) and, after run.finish_swa, saves its own averaged
model's state (weights and the recomputed BatchNorm statistics) as OUT/rank<r>.pt, so the test can compare
the ranks with each other and with the swa.safetensors rank 0 wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from torchsprint import config
from torchsprint.train import run as run_mod

OVERRIDES = [
    "model.args={width: 8}",
    "data.batch_size=64",
    "data.val_fraction=0.5",
    "optim.lr=0.05",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "run.device=cpu",
    "strategy.name=ddp",
    "run.epochs=3",
    "swa.enabled=true",
    "swa.lr=0.02",
    "swa.start=2",
    "swa.anneal_epochs=1",
]


def main(out: Path, run_dir: Path) -> None:
    finish = run_mod.finish_swa

    def finish_and_save(cfg, b, ctx, summary):
        finish(cfg, b, ctx, summary)
        torch.save({k: v.cpu() for k, v in b.swa.module.state_dict().items()}, out / f"rank{ctx.rt.rank}.pt")

    run_mod.finish_swa = finish_and_save  # train() calls it by its module-level name
    run_mod.train(config.load(None, [*OVERRIDES, f"run.dir={run_dir}"]), quiet=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
