"""The LOSSES registry and `build_loss(cfg.loss, targets, num_classes)`: single losses and weighted sums."""

from __future__ import annotations

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

LOSSES = Registry("loss", listed="losses")


# ---------------------------------------------------------------- losses
# Each built-in loss says which targets it compares outputs with (a task's Task.targets): "class_index"
# (N,) integers, "multi_hot" (N, K) 0/1, "image" (same shape as the output); and whether it has labels
# to smooth. build_loss refuses a loss for targets it cannot take, and label smoothing where there are
# no labels, instead of failing on the first batch with a shape error or ignoring the setting.


def loss(name: str, targets: tuple[str, ...], smoothing: bool):
    """Register a loss builder with the targets it takes and whether it honours label_smoothing."""

    def deco(fn):
        fn.targets, fn.smoothing = targets, smoothing
        return LOSSES.register(name)(fn)

    return deco


@loss("cross_entropy", targets=("class_index",), smoothing=True)
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


@loss("bce_with_logits", targets=("class_index", "multi_hot"), smoothing=True)
def bce_with_logits(label_smoothing: float = 0.0, **args):
    return BCEWithLogits(label_smoothing, **args)


@loss("mse", targets=("image",), smoothing=False)
def mse(**args):
    return nn.MSELoss(**args)


@loss("l1", targets=("image",), smoothing=False)
def l1(**args):
    return nn.L1Loss(**args)


@loss("smooth_l1", targets=("image",), smoothing=False)
def smooth_l1(**args):
    return nn.SmoothL1Loss(**args)


class LogitAdjusted(nn.Module):
    """loss(logits + tau * log(prior), target): Menon et al. 2021's logit-adjusted loss (loss.logit_adjust), written
    here because torch has none. `prior` (K,) is each class's share of the training images; the shift is a
    constant per class, so it moves the decision boundary during training only: the model's plain logits predict.
    """

    def __init__(self, loss: nn.Module, prior: torch.Tensor, tau: float):
        super().__init__()
        self.loss = loss
        self.register_buffer("shift", tau * torch.log(prior.double()).float(), persistent=False)  # (K,)

    def forward(self, logits, target):
        return self.loss(logits + self.shift.to(logits.dtype), target)


class WeightedSum(nn.Module):
    """sum_i w_i * loss_i(output, target): the seeds' list of criteria, as one loss."""

    def __init__(self, losses: list[nn.Module], weights: list[float]):
        super().__init__()
        self.losses = nn.ModuleList(losses)
        self.weights = weights

    def forward(self, output, target):
        return sum(w * f(output, target) for f, w in zip(self.losses, self.weights))


TENSOR_ARGS = ("weight", "pos_weight")  # per-class weights: YAML lists become float tensors of num_classes values


def _make_loss(
    name: str, label_smoothing: float, args: dict, where: str, targets: str | None, num_classes: int | None
) -> nn.Module:
    import inspect

    builder = LOSSES.get(name)
    known = getattr(builder, "targets", None)
    if targets is not None and known is not None and targets not in known:
        hint = {
            "class_index": "cross_entropy (or bce_with_logits)",
            "multi_hot": "bce_with_logits",
            "image": "mse, l1 or smooth_l1",
        }.get(targets, "another loss")
        raise UsageError(
            f"{where}: loss {name} compares outputs with {' or '.join(known)} targets, but this task's targets "
            f"are {targets}. Use {hint}."
        )
    smooths = getattr(builder, "smoothing", None)
    if smooths is None:  # a user's loss: it smooths if it takes the argument
        smooths = "label_smoothing" in inspect.signature(builder).parameters
    if label_smoothing and not smooths:
        raise UsageError(
            f"loss.label_smoothing={label_smoothing}: loss {name} has no class labels to smooth (it applies "
            "to cross_entropy and bce_with_logits). Set loss.label_smoothing=0."
        )
    args = dict(args)
    for key in TENSOR_ARGS:
        if key in args and not torch.is_tensor(args[key]):
            try:
                args[key] = torch.as_tensor(args[key], dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"{where}.args.{key}: expected a list of numbers, got {args[key]!r}.") from None
            if num_classes is not None and args[key].ndim == 1 and len(args[key]) != num_classes:
                raise UsageError(
                    f"{where}.args.{key}: {len(args[key])} values for {num_classes} classes; give one per class "
                    "(in the order of the dataset's classes)."
                )
    try:
        return builder(label_smoothing=label_smoothing, **args) if smooths else builder(**args)
    except TypeError as e:
        raise UsageError(f"{where}: bad arguments {args}: {e}") from None


def build_loss(loss_cfg, targets: str | None = None, num_classes: int | None = None) -> nn.Module:
    """The loss named in `loss_cfg.name`, or the weighted sum of `loss_cfg.terms`.

    Args:
        loss_cfg: the `loss` section.
        targets: the task's kind of targets (Task.targets); a loss that cannot take them is refused.
        num_classes: checks per-class weights (loss.args.weight / pos_weight) have one value per class.
    """
    if loss_cfg.terms:
        losses = [
            _make_loss(t.name, loss_cfg.label_smoothing, t.args, f"loss.terms[{i}]", targets, num_classes)
            for i, t in enumerate(loss_cfg.terms)
        ]
        return WeightedSum(losses, [t.weight for t in loss_cfg.terms])
    return _make_loss(loss_cfg.name, loss_cfg.label_smoothing, loss_cfg.args, "loss", targets, num_classes)
