"""Fault injection for the tests (tests/faults/sitecustomize.py holds the faults): `fault_env` for a process a test
starts, `faults` for pytest's own process."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "faults"
SRC = FOLDER.parents[1] / "src"


def fault_env(base: dict | None = None, **faults: str) -> dict:
    """`base` (os.environ) with the faults (kill_at="0:6", slow_write_s="0.02", shard_pause_s="0.05",
    serve_gate=PATH) for every Python process of a command: tests/faults first on PYTHONPATH, then this tree's src/,
    FAULT_<NAME> set. A `base` of {} gives the entries to merge into another environment."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FOLDER), str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update({f"FAULT_{name.upper()}": str(value) for name, value in faults.items()})
    return env


def faults():
    """The fault functions (kill_after, slow_writes, slow_shards, serve_gate) for pytest's own process: call them with
    patch=monkeypatch.setattr."""
    spec = importlib.util.spec_from_file_location("torchsprint_test_faults", FOLDER / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs nothing: the FAULT_ variables are not set in pytest's environment
    return module
