"""The SCHEDULERS registry and `build_scheduler(cfg.sched, opt, ...)`: one LambdaLR, per step or per epoch,
with linear warm-up."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch

from torchsprint.config.fields import default_of
from torchsprint.errors import UsageError
from torchsprint.registry import Registry

SCHEDULERS = Registry("scheduler", listed="schedulers")


# ---------------------------------------------------------------- schedulers
# Each entry maps (sched config, total epochs) to f(epoch: float) -> lr multiplier; one LambdaLR
# evaluates it either per step (epoch = step / steps_per_epoch) or per epoch. Warm-up multiplies in.


@SCHEDULERS.register("cosine")
def cosine(c, total_epochs: float) -> Callable[[float], float]:
    span = max(total_epochs - c.warmup_epochs, 1e-8)

    def f(e):
        t = min(max(e - c.warmup_epochs, 0.0) / span, 1.0)
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


@SCHEDULERS.register("step")
def step(c, total_epochs: float):
    return lambda e: c.gamma ** math.floor(e / c.step_size)


@SCHEDULERS.register("multistep")
def multistep(c, total_epochs: float):
    ms = sorted(c.milestones)
    return lambda e: c.gamma ** bisect.bisect_right(ms, e)


@SCHEDULERS.register("exponential")
def exponential(c, total_epochs: float):
    return lambda e: c.gamma**e


@SCHEDULERS.register("constant")
def constant(c, total_epochs: float):
    return None  # no shape: with no warm-up either, build_scheduler returns a scheduler whose step() does nothing


class FixedLR:
    """The scheduler of a constant learning rate: step() is a no-op, so a tiny model's step pays nothing for it."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.optimizer = opt

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@SCHEDULERS.register("onecycle")
def onecycle(c, total_epochs: float):
    """Cosine up from lr/25 to lr over pct_start, then cosine down to lr/1e4 (Smith 2018; torch's defaults)."""
    up = c.pct_start * total_epochs
    start, end = 1 / 25, 1 / 25 / 1e4

    def f(e):
        if e < up:
            return start + (1 - start) * 0.5 * (1 - math.cos(math.pi * e / up))
        t = min((e - up) / max(total_epochs - up, 1e-8), 1.0)
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def _one(e: float) -> float:
    return 1.0


# The sched fields each schedule reads besides interval and warm-up (same rule as OPTIMIZER_FIELDS).
SCHEDULE_FIELDS = {
    "cosine": ("min_lr_ratio",),
    "step": ("step_size", "gamma"),
    "multistep": ("milestones", "gamma"),
    "exponential": ("gamma",),
    "onecycle": ("pct_start",),
    "constant": (),
}


def check_sched_fields(sched_cfg) -> None:
    """Refuse schedule-specific settings the chosen schedule does not read, and warm-up settings without warm-up."""
    if sched_cfg.name not in SCHEDULE_FIELDS:
        return  # a user's schedule reads what it reads
    uses = SCHEDULE_FIELDS[sched_cfg.name]
    for field in ("min_lr_ratio", "step_size", "milestones", "gamma", "pct_start"):
        value = getattr(sched_cfg, field)
        if field not in uses and value != default_of(sched_cfg, field):
            reads = ", ".join("sched." + u for u in uses) or "no schedule-specific field"
            raise UsageError(
                f"sched.{field}={value} does not apply to sched.name={sched_cfg.name} (it reads {reads}); "
                "remove it or pick the schedule it belongs to."
            )
    if sched_cfg.warmup_epochs == 0 and sched_cfg.warmup_start != default_of(sched_cfg, "warmup_start"):
        raise UsageError(
            f"sched.warmup_start={sched_cfg.warmup_start} has no effect with sched.warmup_epochs=0; set "
            "sched.warmup_epochs too, or remove it."
        )


def build_scheduler(sched_cfg, opt: torch.optim.Optimizer, *, epochs: float, steps_per_epoch: int):
    """A LambdaLR following `sched_cfg.name` with optional linear warm-up.

    Args:
        sched_cfg: the `sched` section.
        opt: the optimizer.
        epochs: training length in epochs (fractional when run.max_steps ends it early).
        steps_per_epoch: optimizer steps per epoch (after gradient accumulation).
    The engine calls `sched.step()` every optimizer step (interval=step) or every epoch.
    """
    check_sched_fields(sched_cfg)
    lam = schedule_lambda(sched_cfg, epochs=epochs, steps_per_epoch=steps_per_epoch)
    if lam is None:
        return FixedLR(opt)
    return torch.optim.lr_scheduler.LambdaLR(opt, lam)


def schedule_lambda(sched_cfg, *, epochs: float, steps_per_epoch: int) -> Callable[[int], float] | None:
    """The LambdaLR multiplier of step (or epoch) i for a run of `epochs`; None: a constant rate (FixedLR)."""
    shape = SCHEDULERS.get(sched_cfg.name)(sched_cfg, epochs)
    warm, start = sched_cfg.warmup_epochs, sched_cfg.warmup_start
    if shape is None:
        if warm == 0:
            return None
        shape = _one

    def factor(e: float) -> float:
        w = start + (1 - start) * min(e / warm, 1.0) if warm > 0 else 1.0
        return w * shape(e)

    per_step = sched_cfg.interval == "step"
    spe = max(steps_per_epoch, 1)
    return lambda i: factor(i / spe if per_step else float(i))


def refit_schedule(sched, sched_cfg, *, steps: int, steps_per_epoch: int) -> None:
    """Give a LambdaLR built by build_scheduler a new length (`steps` optimizer steps; run.train_time's fit): the
    next sched.step() follows the schedule of that length. A constant rate (FixedLR) has nothing to change."""
    lam = schedule_lambda(sched_cfg, epochs=steps / max(steps_per_epoch, 1), steps_per_epoch=steps_per_epoch)
    if lam is not None and isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        sched.lr_lambdas = [lam] * len(sched.optimizer.param_groups)
