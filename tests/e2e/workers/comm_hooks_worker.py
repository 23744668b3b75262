"""2-process worker for tests/e2e/ddp/test_comm_hooks.py: `torchrun --nproc-per-node 2 comm_hooks_worker.py OUT`.

Trains the same short run once per strategy.comm_hook (each a real DDP run over gloo) into OUT/<hook>.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchsprint import config
from torchsprint.train.run import train

RUN = [
    "model.name=linear",
    "data.batch_size=16",
    "run.max_steps=8",
    "checkpoint.every_epochs=null",
    "log.tensorboard=false",
    "log.every_steps=4",
    "strategy=ddp",
    "run.seed=3",
]
HOOKS = {
    "none": [],
    "fp16": ["strategy.comm_hook=fp16"],
    "bf16": ["strategy.comm_hook=bf16"],
    "powersgd": ["strategy.comm_hook=powersgd", "strategy.powersgd_start_step=2"],
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name, extra in HOOKS.items():
        train(config.load(None, [*RUN, *extra, f"run.dir={out / name}"]), quiet=True)
    from torchsprint.runtime.core import exit_process

    exit_process(0)  # as torchsprint's own workers do: no interpreter shutdown after the process group
