"""Runtime: device, rank and world size of this process; process group, seeds and backend flags."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from torchsprint.errors import UsageError


@dataclass(frozen=True)
class Runtime:
    """Where this process runs. Travels explicitly to every builder that needs it (no globals)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.distributed:
            torch.distributed.barrier()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is present, else cpu; validates explicit names."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"run.device '{name}' is not a device. Use auto, cpu, cuda or cuda:N.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"run.device={name} but this machine has no CUDA device. Use run.device=cpu (or auto).")
        if dev.index is None:
            dev = torch.device(f"cuda:{local_rank}")
    return dev


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup(run_cfg, strategy_cfg, speed_cfg=None) -> Runtime:
    """Create the Runtime: read torchrun's environment, init the process group, seed, set backend flags.

    Args:
        run_cfg: the `run` section (device, seed, deterministic).
        strategy_cfg: the `strategy` section (name, backend, timeout_s).
        speed_cfg: the `speed` section (cudnn_benchmark, tf32), optional.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(run_cfg.device, local_rank)
    if world_size > 1 and strategy_cfg.name != "ddp":
        raise UsageError(
            f"launched with WORLD_SIZE={world_size} (torchrun) but strategy.name={strategy_cfg.name}. "
            "Set strategy=ddp, or launch one process."
        )
    if strategy_cfg.name == "ddp" and world_size > 1 and not torch.distributed.is_initialized():
        backend = strategy_cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise UsageError("strategy.backend=nccl needs CUDA devices; on CPU use strategy.backend=gloo (or auto).")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(
            backend=backend, timeout=timedelta(seconds=strategy_cfg.timeout_s), device_id=device if backend == "nccl" else None
        )
    seed_everything(run_cfg.seed + rank)
    if run_cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif speed_cfg is not None and device.type == "cuda":
        torch.backends.cudnn.benchmark = speed_cfg.cudnn_benchmark
    if speed_cfg is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = speed_cfg.tf32
        torch.backends.cudnn.allow_tf32 = speed_cfg.tf32
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=local_rank)


def teardown(rt: Runtime) -> None:
    """Destroy the process group if this process made one."""
    if rt.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
