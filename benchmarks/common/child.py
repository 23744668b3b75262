"""Running a benchmark module in a child process (`python -m benchmarks.<kind>.<name>`) from any working folder."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: where `benchmarks` is a package


def child_env(extra: dict | None = None) -> dict:
    """This process's environment plus `extra`, with the repository root first on PYTHONPATH, so that a child
    started as `python -m benchmarks.<kind>.<name>` finds the package whatever its working folder."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **(extra or {}), "PYTHONPATH": path}
