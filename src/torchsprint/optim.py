"""OPTIMIZERS, SCHEDULERS and LOSSES registries and their builders (one config section each)."""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

OPTIMIZERS = Registry("optimizer")
SCHEDULERS = Registry("scheduler")
LOSSES = Registry("loss")

# ---------------------------------------------------------------- optimizers

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool) -> list[dict]:
    """Trainable parameters split into decayed and non-decayed groups.

    Biases and normalisation weights get no decay when `no_decay_norm_bias` (timm's
    `param_groups_weight_decay`; decaying them hurts accuracy, Goyal et al. 2017).
    Frozen parameters (requires_grad=False) are not given to the optimizer at all.
    """
    if not no_decay_norm_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    no_decay_ids = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1:
                no_decay_ids.add(id(p))
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if id(p) in no_decay_ids else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _impl_kwargs(cls, impl: str) -> dict:
    params = inspect.signature(cls.__init__).parameters
    if impl == "auto":
        return {}
    if impl == "fused":
        if "fused" not in params:
            raise UsageError(f"optim.impl=fused: {cls.__name__} has no fused implementation. Use foreach or auto.")
        return {"fused": True}
    if "foreach" not in params:
        return {}
    return {"foreach": impl == "foreach"}


@OPTIMIZERS.register("sgd")
def sgd(groups, c):
    return torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov and c.momentum > 0,
                           **_impl_kwargs(torch.optim.SGD, c.impl), **c.args)


@OPTIMIZERS.register("adam")
def adam(groups, c):
    return torch.optim.Adam(groups, lr=c.lr, betas=c.betas, eps=c.eps, **_impl_kwargs(torch.optim.Adam, c.impl), **c.args)


@OPTIMIZERS.register("adamw")
def adamw(groups, c):
    return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **_impl_kwargs(torch.optim.AdamW, c.impl), **c.args)


@OPTIMIZERS.register("rmsprop")
def rmsprop(groups, c):
    return torch.optim.RMSprop(groups, lr=c.lr, momentum=c.momentum, eps=c.eps,
                               **_impl_kwargs(torch.optim.RMSprop, c.impl), **c.args)


# torch.optim classes a plain `loss.backward(); opt.step()` loop cannot drive, and why.
_UNSUPPORTED = {
    "LBFGS": "needs a closure that re-evaluates the loss and a single parameter group",
    "Muon": "only takes 2-D weight matrices and must be paired with another optimizer for the rest",
    "SparseAdam": "needs sparse gradients (nn.Embedding(sparse=True)), which vision models do not produce",
}


def _torch_optim_provider():
    """Every other torch.optim optimizer by its class name (Adagrad, NAdam, RAdam, ...), lower-cased."""

    def make(cls):
        def build(groups, c):
            return cls(groups, lr=c.lr, **_impl_kwargs(cls, c.impl), **c.args)

        build.__doc__ = f"torch.optim.{cls.__name__}(lr=optim.lr, **optim.args)"
        return build

    return {
        name.lower(): make(cls)
        for name, cls in vars(torch.optim).items()
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer and name not in _UNSUPPORTED
    }


OPTIMIZERS.add_provider(_torch_optim_provider)


def build_optimizer(optim_cfg, model: nn.Module) -> torch.optim.Optimizer:
    """Build `optim_cfg.name` over the model's trainable parameters.

    Args:
        optim_cfg: the `optim` section.
        model: the (unwrapped or wrapped) model; frozen parameters are left out.
    """
    builder = OPTIMIZERS.get(optim_cfg.name.lower())
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.no_decay_norm_bias)
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise UsageError("no trainable parameters: model.freeze / model.train_only froze everything.")
    try:
        return builder(groups, optim_cfg)
    except (TypeError, ValueError) as e:
        raise UsageError(f"optimizer '{optim_cfg.name}': bad arguments (optim.args={optim_cfg.args}): {e}") from None


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


def build_scheduler(sched_cfg, opt: torch.optim.Optimizer, *, epochs: float, steps_per_epoch: int):
    """A LambdaLR following `sched_cfg.name` with optional linear warm-up.

    Args:
        sched_cfg: the `sched` section.
        opt: the optimizer.
        epochs: training length in epochs (fractional when run.max_steps ends it early).
        steps_per_epoch: optimizer steps per epoch (after gradient accumulation).
    The engine calls `sched.step()` every optimizer step (interval=step) or every epoch.
    """
    shape = SCHEDULERS.get(sched_cfg.name)(sched_cfg, epochs)
    warm, start = sched_cfg.warmup_epochs, sched_cfg.warmup_start
    if shape is None:
        if warm == 0:
            return FixedLR(opt)
        shape = _one

    def factor(e: float) -> float:
        w = start + (1 - start) * min(e / warm, 1.0) if warm > 0 else 1.0
        return w * shape(e)

    per_step = sched_cfg.interval == "step"
    spe = max(steps_per_epoch, 1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factor(i / spe if per_step else float(i)))


# ---------------------------------------------------------------- losses


@LOSSES.register("cross_entropy")
def cross_entropy(label_smoothing: float = 0.0, **args):
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing, **args)


class BCEWithLogits(nn.Module):
    """BCE-with-logits that also accepts integer class targets (turned into one-hot)."""

    def __init__(self, label_smoothing: float = 0.0, **args):
        super().__init__()
        self.loss = nn.BCEWithLogitsLoss(**args)
        self.smoothing = label_smoothing

    def forward(self, logits, target):
        if target.dtype in (torch.int64, torch.int32) and target.ndim == logits.ndim - 1:
            target = nn.functional.one_hot(target, logits.shape[1])
        target = target.to(logits.dtype)
        if self.smoothing:
            target = target * (1 - self.smoothing) + 0.5 * self.smoothing
        return self.loss(logits, target)


@LOSSES.register("bce_with_logits")
def bce_with_logits(label_smoothing: float = 0.0, **args):
    return BCEWithLogits(label_smoothing, **args)


@LOSSES.register("mse")
def mse(label_smoothing: float = 0.0, **args):
    return nn.MSELoss(**args)


@LOSSES.register("l1")
def l1(label_smoothing: float = 0.0, **args):
    return nn.L1Loss(**args)


@LOSSES.register("smooth_l1")
def smooth_l1(label_smoothing: float = 0.0, **args):
    return nn.SmoothL1Loss(**args)


class WeightedSum(nn.Module):
    """sum_i w_i * loss_i(output, target): the seeds' list of criteria, as one loss."""

    def __init__(self, losses: list[nn.Module], weights: list[float]):
        super().__init__()
        self.losses = nn.ModuleList(losses)
        self.weights = weights

    def forward(self, output, target):
        return sum(w * f(output, target) for f, w in zip(self.losses, self.weights))


def _make_loss(name: str, label_smoothing: float, args: dict, where: str) -> nn.Module:
    builder = LOSSES.get(name)
    try:
        return builder(label_smoothing=label_smoothing, **args)
    except TypeError as e:
        raise UsageError(f"{where}: bad arguments {args}: {e}") from None


def build_loss(loss_cfg) -> nn.Module:
    """The loss named in `loss_cfg.name`, or the weighted sum of `loss_cfg.terms`."""
    if loss_cfg.terms:
        losses = [_make_loss(t.name, loss_cfg.label_smoothing, t.args, f"loss.terms[{i}]") for i, t in enumerate(loss_cfg.terms)]
        return WeightedSum(losses, [t.weight for t in loss_cfg.terms])
    return _make_loss(loss_cfg.name, loss_cfg.label_smoothing, loss_cfg.args, "loss")


__all__ = ["OPTIMIZERS", "SCHEDULERS", "LOSSES", "build_optimizer", "build_scheduler", "build_loss"]
