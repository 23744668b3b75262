"""Optimizers, schedules and losses: one registry and one builder per family (one config section each),
and parameter groups. This face re-exports; the code lives in optimizers.py, schedulers.py, losses.py,
groups.py."""

from __future__ import annotations

from torchsprint.optim.groups import name_matcher, param_groups
from torchsprint.optim.losses import LOSSES, build_loss
from torchsprint.optim.optimizers import OPTIMIZERS, build_optimizer
from torchsprint.optim.schedulers import SCHEDULERS, FixedLR, build_scheduler

__all__ = [
    "OPTIMIZERS",
    "SCHEDULERS",
    "LOSSES",
    "build_optimizer",
    "build_scheduler",
    "build_loss",
    "param_groups",
    "name_matcher",
    "FixedLR",
]
