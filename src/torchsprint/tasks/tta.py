"""Test-time augmentation (eval.tta): views of an eval batch, one model call per view, outputs combined.

One implementation for every path: validation during training and `torchsprint eval` (validation.evaluate
gets the wrapped model), `torchsprint predict` (Predictor wraps its forward) and `torchsprint export`
(the wrapper is exported, so the ONNX / TorchScript graph holds the views and the combination, and
ONNX Runtime's output is the torch path's).

The names follow torchvision's transforms: `hflip` (the image and its mirror), `five_crop` (FiveCrop: four
corners and the centre) and `ten_crop` (TenCrop: the five crops and their mirrors). Multi-crop takes crops of
the eval size S (the eval spec's final `center_crop: S`) from the centre R x R square of the image as the eval
spec's resize leaves it (R: the resize's short side, usually S / 0.875): the eval spec's `center_crop: S` is
loaded as `center_crop: R` (`loading_spec`) and the wrapper cuts the crops, as torchvision's ImageNet ten-crop
evaluation does (Resize(256), TenCrop(224); 224 / 256 = 0.875, timm's default crop_pct).

How views are combined (`combine`): class scores average the views' probabilities (softmax; sigmoid per
label for multilabel), as fastai's `tta` and the ten-crop evaluations of the ImageNet papers do, rather
than their logits: the average of probabilities is the ensemble's predictive distribution, one
overconfident view cannot outvote the others by the scale of its logits, and the loss reported at
eval is the negative log-likelihood of that average. The wrapper returns it as logits of the averaged
probabilities (log p for softmax, log p - log(1 - p) for sigmoid, computed with logsumexp so it stays finite),
so softmax/sigmoid downstream (metrics, predict's probabilities, the loss) read exactly the averaged
probabilities. Image outputs (image_to_image) are flipped back and averaged pixel for pixel (the
"self-ensemble" of restoration models); multi-crop does not apply to them (refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from torchsprint.errors import UsageError

TTA_NAMES = ("none", "hflip", "five_crop", "ten_crop")
CROP_PCT = 0.875  # crop size / loaded size for multi-crop: torchvision's Resize(256) + TenCrop(224), timm's crop_pct


@dataclass(frozen=True)
class TtaPlan:
    """eval.tta resolved for one run: which views, and how outputs are combined (by the task's targets)."""

    name: str
    flip: bool  # add each view's mirror (hflip, ten_crop)
    crop: tuple[int, int] | None  # (h, w) of the five crops (five_crop, ten_crop); None: the whole image
    targets: str  # the task's targets: class_index (softmax), multi_hot (sigmoid) or image (pixels)

    @property
    def views(self) -> int:
        return (5 if self.crop else 1) * (2 if self.flip else 1)


def _steps(spec: list) -> list[tuple[str, object]]:
    """A transforms spec as (name, argument) pairs (a step is a name or a one-key mapping)."""
    return [(s, None) if isinstance(s, str) else next(iter(s.items())) for s in spec]


def _size_arg(arg) -> object:
    """The size of a resize / center_crop step (its argument, or its mapping's `size`)."""
    return arg.get("size") if isinstance(arg, dict) else arg


def _hw(size) -> tuple[int, int] | None:
    if isinstance(size, int):
        return size, size
    if isinstance(size, list | tuple) and len(size) in (1, 2) and all(isinstance(v, int) for v in size):
        return (size[0], size[-1])
    return None


def _crop_plan(spec: list, name: str) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(index of the final center_crop step, crop (h, w), loaded (h, w)) for multi-crop, or a UsageError naming
    what the eval spec lacks. Loaded: the centre square of the image as the spec's last resize leaves it (its
    short side; both sides for resize: [h, w])."""
    steps = _steps(spec)
    geometric = [i for i, (n, _) in enumerate(steps) if n != "normalize"]
    example = "e.g. data.eval.transforms=[resize: 146, center_crop: 128, normalize: imagenet]"
    if not geometric or steps[geometric[-1]][0] != "center_crop" or _hw(_size_arg(steps[geometric[-1]][1])) is None:
        raise UsageError(
            f"eval.tta={name} takes crops of the eval size from a larger image, so data.eval.transforms must "
            f"end with center_crop: SIZE after a larger resize (SIZE/{CROP_PCT} is usual: {example}); it "
            f"is {spec}. Set it so, or use eval.tta=hflip."
        )
    i = geometric[-1]
    crop = _hw(_size_arg(steps[i][1]))
    resized = [_size_arg(a) for n, a in steps[:i] if n == "resize"]
    loaded = _hw(resized[-1]) if resized else None
    if loaded is None or loaded[0] < crop[0] or loaded[1] < crop[1] or loaded == crop:
        need = round(max(crop) / CROP_PCT)
        raise UsageError(
            f"eval.tta={name} cuts {crop[0]}x{crop[1]} crops (data.eval.transforms' center_crop) from the "
            f"centre square of the resized image, but data.eval.transforms={spec} has no resize larger than "
            f"the crop before its center_crop: put resize: {need} (= {max(crop)}/{CROP_PCT}) before it "
            f"({example}), or use eval.tta=hflip."
        )
    return i, crop, loaded


def plan_tta(name: str, task, eval_transforms: list) -> TtaPlan | None:
    """eval.tta checked against the task and the eval spec; None for `none` (no wrapper: off is the model itself).

    `task`: a tasks.Task (its name, targets and unsupported features). Raises UsageError where TTA has no
    meaning: a task that refuses it, multi-crop of an image-to-image task, multi-crop without a center_crop
    of a known size after a large enough resize.
    """
    if name not in TTA_NAMES:
        raise UsageError(f"eval.tta={name}: unknown; choose one of {', '.join(TTA_NAMES)}.")
    if name == "none":
        return None
    if "tta" in task.unsupported:
        raise UsageError(
            f"eval.tta={name}: task={task.name} does not support test-time augmentation: "
            f"{task.unsupported['tta']} Set eval.tta=none."
        )
    crop = None
    if name in ("five_crop", "ten_crop"):
        if task.targets == "image":
            raise UsageError(
                f"eval.tta={name}: task={task.name} outputs images, and crops of the input give crops of the "
                "output, not one image to average; use eval.tta=hflip (outputs flipped back and averaged) "
                "or none."
            )
        crop = _crop_plan(eval_transforms, name)[1]
    return TtaPlan(name, name in ("hflip", "ten_crop"), crop, task.targets)


def loading_spec(eval_transforms: list, name: str) -> list:
    """The eval spec that loads images for eval.tta=`name`: the eval spec itself, except for multi-crop, whose
    final `center_crop: S` becomes `center_crop: R` (R: the preceding resize's size): the wrapper cuts the S crops.
    Call plan_tta first (it refuses a spec this cannot apply to)."""
    if name not in ("five_crop", "ten_crop"):
        return eval_transforms
    i, _, loaded = _crop_plan(eval_transforms, name)
    step = eval_transforms[i]
    arg = step["center_crop"]
    size = list(loaded) if isinstance(_size_arg(arg), list | tuple) else loaded[0]
    new = {"center_crop": arg | {"size": size} if isinstance(arg, dict) else size}
    return [*eval_transforms[:i], new, *eval_transforms[i + 1 :]]


def with_loading_spec(data_cfg, name: str):
    """`data_cfg` (config.DataConfig) whose eval spec loads images for eval.tta=`name` (a copy where it changes)."""
    spec = loading_spec(data_cfg.eval.transforms, name)
    if spec is data_cfg.eval.transforms:
        return data_cfg
    out = data_cfg.model_copy(deep=True)
    out.eval.transforms = spec
    return out


def five_crops(x: torch.Tensor, size: tuple[int, int]) -> list[torch.Tensor]:
    """Top-left, top-right, bottom-left, bottom-right and centre crops of (..., H, W), in torchvision's order and
    with its centre (top = round((H - h) / 2)). Slices of static sizes, so exporters see constant indices."""
    (h, w), (H, W) = size, x.shape[-2:]
    if h > H or w > W:
        raise UsageError(f"eval.tta: {h}x{w} crops do not fit {H}x{W} images; load them with tta.loading_spec.")
    top, left = int(round((H - h) / 2.0)), int(round((W - w) / 2.0))
    return [
        x[..., :h, :w],
        x[..., :h, W - w :],
        x[..., H - h :, :w],
        x[..., H - h :, W - w :],
        x[..., top : top + h, left : left + w],
    ]


def make_views(x: torch.Tensor, plan: TtaPlan) -> list[torch.Tensor]:
    """The views of a batch (..., C, H, W): the batch (its five crops), then, with flip, its mirror (the mirror's
    five crops): torchvision's TenCrop order and crops. (The mirror's centre crop is not the centre crop's mirror
    when H - h or W - w is odd: round() puts both an extra pixel from the top-left.)"""
    images = [x, x.flip(-1)] if plan.flip else [x]
    return [c for img in images for c in five_crops(img, plan.crop)] if plan.crop else images


def combine(outputs: list[torch.Tensor], plan: TtaPlan) -> torch.Tensor:
    """The views' outputs -> one output (float32), as the module docstring says: logits of the averaged
    probabilities for class scores, the average of the (flipped back) images for image outputs."""
    if plan.targets == "image":
        n = len(outputs) // 2 if plan.flip else len(outputs)  # the mirrored views' outputs are mirrored back
        outs = [o.float() if i < n else o.float().flip(-1) for i, o in enumerate(outputs)]
        return torch.stack(outs).mean(0)
    z = torch.stack([o.float() for o in outputs])  # (views, N, classes)
    if plan.targets == "multi_hot":
        # logit(mean_v sigmoid(z_v)) = log mean sigmoid(z) - log mean sigmoid(-z); the 1/views cancel
        return torch.logsumexp(nn.functional.logsigmoid(z), 0) - torch.logsumexp(nn.functional.logsigmoid(-z), 0)
    # log(mean_v softmax(z_v)): softmax of it is the averaged probabilities
    return torch.logsumexp(torch.log_softmax(z, -1), 0) - math.log(len(outputs))


class TtaModel(nn.Module):
    """model(x) with eval.tta: the model runs once per view (each the batch's size and the crop's shape, so
    compiled models and BatchNorm see what they saw without TTA), and `combine` merges the outputs."""

    def __init__(self, model: nn.Module, plan: TtaPlan):
        super().__init__()
        self.model, self.plan = model, plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return combine([self.model(v) for v in make_views(x, self.plan)], self.plan)


def wrap_tta(model, plan: TtaPlan | None):
    """`model` with eval.tta applied (a TtaModel, or the model itself when `plan` is None)."""
    return model if plan is None else TtaModel(model, plan)


def first_view(x: torch.Tensor, plan: TtaPlan | None) -> torch.Tensor:
    """One view of a loaded batch (its centre crop under multi-crop): the input shape the model itself takes."""
    return x if plan is None or plan.crop is None else five_crops(x, plan.crop)[4]


__all__ = [
    "TTA_NAMES",
    "TtaPlan",
    "TtaModel",
    "plan_tta",
    "loading_spec",
    "with_loading_spec",
    "make_views",
    "combine",
    "wrap_tta",
    "first_view",
]
