"""DDP worker for tests/e2e/models/test_weights_download.py (torch.multiprocessing.spawn): a module of its own, so that
each spawned rank imports torch and torchsprint's download module only, not the test module's torchvision and run."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchsprint.errors import UsageError
from torchsprint.models.download import fetch_for_run
from torchsprint.runtime.core import Runtime


def rank(r: int, pg: str, good: str, bad: str, out: str) -> None:
    """One gloo rank on this machine (local rank = rank): fetch_for_run a good URL, then one the server has not."""
    dist.init_process_group("gloo", init_method=f"file://{pg}", rank=r, world_size=2)
    rt = Runtime(torch.device("cpu"), rank=r, world_size=2, local_rank=r)
    result = {"path": str(fetch_for_run(good, None, rt, lambda _: None))}
    try:
        fetch_for_run(bad, None, rt, lambda _: None)
    except UsageError as e:
        result["error"] = str(e)
    Path(out, f"{r}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def rank_waits(r: int, pg: str, url: str, timeout_s: float, out: str) -> None:
    """One gloo rank whose process group times out after `timeout_s` (strategy.timeout_s): fetch_for_run a URL the
    server sends more slowly than that; each rank's path, or its error, in out/<rank>.json."""
    dist.init_process_group(
        "gloo", init_method=f"file://{pg}", rank=r, world_size=2, timeout=timedelta(seconds=timeout_s)
    )
    rt = Runtime(torch.device("cpu"), rank=r, world_size=2, local_rank=r)
    try:
        result = {"path": str(fetch_for_run(url, None, rt, lambda _: None))}
    except Exception as e:  # the test reads it (a timeout on the waiting rank was the bug)
        result = {"error": f"{type(e).__name__}: {e}"[:500]}
    Path(out, f"{r}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
