"""wrap_model(model, strategy, rt): single device, nn.DataParallel or DistributedDataParallel."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from torchsprint.errors import UsageError


def wrap_model(model: nn.Module, strategy_cfg, rt) -> nn.Module:
    """Move the model to rt.device and wrap it for the configured strategy.

    Args:
        model: the initialised, unwrapped model.
        strategy_cfg: the `strategy` section.
        rt: the Runtime.
    """
    model = model.to(rt.device)
    name = strategy_cfg.name
    if name == "single":
        return model
    if name == "dp":
        if rt.device.type != "cuda":
            raise UsageError("strategy=dp (nn.DataParallel) needs CUDA GPUs; on CPU use strategy=single or ddp.")
        # DataParallel replicates the model every step from one process and gathers outputs on
        # GPU 0; DDP (one process per GPU, overlapped all-reduce) is faster and scales better.
        return nn.DataParallel(model)
    if not rt.distributed:
        return model  # ddp in one process is the single-device case: nothing to synchronise
    if strategy_cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        find_unused_parameters=strategy_cfg.find_unused_parameters,
        static_graph=strategy_cfg.static_graph,
        bucket_cap_mb=strategy_cfg.bucket_cap_mb,
    )


def no_sync(model: nn.Module):
    """DDP's no_sync() (skip the gradient all-reduce on accumulation micro-steps); a null context otherwise."""
    return model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) else nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DataParallel / DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t
