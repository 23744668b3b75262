"""Atomic checkpoint save/load, resume discovery, last-K/best-K bookkeeping and safetensors weights."""

from __future__ import annotations

import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchsprint.errors import UsageError

CKPT_RE = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")


@dataclass
class TrainState:
    """The loop's position: everything besides module/optimizer states needed to continue exactly."""

    epoch: int = 0  # epoch in progress (0-based)
    step_in_epoch: int = 0  # optimizer steps already done in `epoch`
    global_step: int = 0  # optimizer steps done in total
    best_metric: float | None = None
    best_epoch: int | None = None
    skipped_steps: int = 0  # optimizer steps skipped for non-finite values


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes from parameter names.

    DataParallel/DDP store the model as `.module` and torch.compile as `._orig_mod`, so weights
    saved from a wrapped model carry `module.` / `_orig_mod.` prefixes that the plain model lacks.
    """
    out = {}
    for k, v in state.items():
        while k.startswith(("module.", "_orig_mod.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def rng_state() -> dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and every CUDA device, in weights_only-loadable types."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy(), *n[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list | tuple) else x


def atomic_write(path: Path, write) -> int:
    """Write via `write(file)` into a temp file in the same folder, fsync, then rename over `path`.

    A crash at any moment leaves either the old file or the complete new one, never a torn file.
    Returns the size in bytes.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path.stat().st_size


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with weights_only=True: tensors and plain containers only, never code."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"{path} is not a readable torchsprint checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "train_state" not in ckpt:
        raise UsageError(f"{path} is not a torchsprint checkpoint (no 'model'/'train_state' entries).")
    return ckpt


def save_weights(path: Path, model: nn.Module, metadata: dict[str, str]) -> int:
    """Write the model's weights as safetensors (loadable without torchsprint) atomically."""
    from safetensors.torch import save

    state = {k: v.detach().cpu().contiguous() for k, v in strip_prefixes(model.state_dict()).items()}
    data = save(state, metadata=metadata)
    return atomic_write(path, lambda f: f.write(data))


class Saver:
    """Saves resumable checkpoints into <run_dir>/checkpoints and keeps the last K and best K.

    Only rank 0 writes; every rank waits at a barrier so no rank races ahead of a save.
    `status.json` records every saved checkpoint (step, metric, size, time).
    """

    def __init__(self, run_dir: Path, ckpt_cfg, rt, meta: dict[str, Any]):
        self.dir = Path(run_dir) / "checkpoints"
        self.cfg, self.rt, self.meta = ckpt_cfg, rt, meta
        if rt.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.status_path = self.dir / "status.json"
        self.status = self._read_status()

    def _read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"checkpoints": []}

    def save(self, state: TrainState, model, opt, sched, prec, metric: float | None) -> Path | None:
        """Save a full checkpoint now; returns its path on rank 0."""
        path = self.dir / f"ckpt-e{state.epoch:03d}-s{state.global_step:07d}.pt"
        if self.rt.is_main:
            from torchsprint.parallel import unwrap

            ckpt = {
                "model": strip_prefixes(unwrap(model).state_dict()),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "scaler": prec.state_dict(),
                "train_state": asdict(state),
                "rng": rng_state(),
                "metric": metric,
                **self.meta,
            }
            size = atomic_write(path, lambda f: torch.save(ckpt, f))
            entries = [e for e in self.status["checkpoints"] if e["file"] != path.name]
            entries.append({"file": path.name, "epoch": state.epoch, "step": state.global_step,
                            "metric": metric, "bytes": size, "time": time.time()})
            self.status["checkpoints"] = self._prune(entries)
            atomic_write(self.status_path, lambda f: f.write(json.dumps(self.status, indent=1).encode()))
        self.rt.barrier()
        return path if self.rt.is_main else None

    def _prune(self, entries: list[dict]) -> list[dict]:
        keep = {e["file"] for e in sorted(entries, key=lambda e: e["step"])[-self.cfg.keep_last :]}
        scored = [e for e in entries if e["metric"] is not None]
        sign = -1 if self.cfg.mode == "max" else 1
        keep |= {e["file"] for e in sorted(scored, key=lambda e: sign * e["metric"])[: self.cfg.keep_best]}
        for e in entries:
            if e["file"] not in keep:
                (self.dir / e["file"]).unlink(missing_ok=True)
        return [e for e in entries if e["file"] in keep]


def find_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, newest (highest step) first."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [(int(m.group(2)), int(m.group(1)), p) for p in d.iterdir() if (m := CKPT_RE.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def find_resume(resume: str | None, run_dir: Path | None, log) -> tuple[Path | None, dict | None]:
    """Resolve `checkpoint.resume` to (path, loaded checkpoint) or (None, None).

    'auto' tries the run's checkpoints newest first; a truncated or corrupt file is reported
    and skipped, and the previous one is used.
    """
    if resume is None:
        return None, None
    if resume != "auto":
        p = Path(resume)
        if p.is_dir():
            return find_resume("auto", p, log)
        return p, load_checkpoint(p)
    if run_dir is None:
        return None, None
    for p in find_checkpoints(run_dir):
        try:
            return p, load_checkpoint(p)
        except UsageError as e:
            log(f"[yellow]skipping unreadable checkpoint[/]: {e}")
    return None, None
