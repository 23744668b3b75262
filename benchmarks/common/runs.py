"""One training run in this process, in a temporary run folder (numerics/backend_agreement.py,
numerics/bf16_parity.py)."""

from __future__ import annotations

import tempfile
import time


def train_once(overrides: list[str]) -> tuple[dict, float]:
    """Train one run (the default config plus `overrides`) in a temporary folder: (its summary, wall seconds)."""
    from torchsprint import config
    from torchsprint.train.run import train

    with tempfile.TemporaryDirectory() as d:
        cfg = config.load(None, [*overrides, f"run.dir={d}/run"])
        t = time.perf_counter()
        s = train(cfg, quiet=True)
        return s, time.perf_counter() - t
