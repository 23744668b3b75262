"""The MODELS registry and `build_model`: built-in nets (nets.py), every torchvision classification and video
model, and timm models when timm is installed (name providers, loaded only when a name needs them)."""

from __future__ import annotations

import importlib.util

from torch import nn

from torchsprint.registry import Registry

MODELS = Registry("model", listed="models")


def adapt_in_channels(model: nn.Module, in_channels: int) -> nn.Module:
    """Replace the first 3-channel Conv2d so that the model takes `in_channels` inputs."""
    if in_channels == 3:
        return model
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                new = nn.Conv2d(
                    in_channels,
                    child.out_channels,
                    child.kernel_size,
                    child.stride,
                    child.padding,
                    child.dilation,
                    child.groups,
                    child.bias is not None,
                    child.padding_mode,
                )
                setattr(parent, name, new)
                return model
    raise ValueError("no 3-channel Conv2d found to adapt to the data's channel count")


class FramesFirst(nn.Module):
    """Clips arrive (N, T, C, H, W) (frames first, as collated and normalised); 3-D conv nets take (N, C, T, H, W).

    Multi-clip evaluation (the eval spec's `multi_clip` step) delivers (N, K, T, C, H, W): the K clips are
    folded into the batch, run as N*K clips, and the prediction is the mean of each video's K logits
    (the standard video-classification protocol). In eval mode every clip is independent of the others
    in its batch (BatchNorm uses running statistics), so this equals running the K clips one by one.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, clips):
        if clips.ndim == 6:  # (N, K, T, C, H, W): K clips per video
            n, k = clips.shape[:2]
            logits = self.model(clips.flatten(0, 1).transpose(1, 2))  # (N*K, classes)
            return logits.unflatten(0, (n, k)).mean(dim=1)
        return self.model(clips.transpose(1, 2))


def _torchvision_provider():
    import torchvision

    def make(fn_name):
        def build(num_classes: int, in_channels: int = 3, **args):
            # weights=None: library weights come through model.pretrained (models/download.py), after building.
            model = torchvision.models.get_model(fn_name, weights=None, num_classes=num_classes, **args)
            return adapt_in_channels(model, in_channels)

        build.__doc__ = f"torchvision.models.{fn_name}"
        build.source = lambda: torchvision.models.get_model_builder(
            fn_name
        )  # its module declares model.args (check_args)
        return build

    return {n: make(n) for n in torchvision.models.list_models(module=torchvision.models)}


def _timm_provider():
    if importlib.util.find_spec("timm") is None:
        return {}
    import timm

    def make(name):
        def build(num_classes: int, in_channels: int = 3, **args):
            return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **args)

        build.__doc__ = f"timm.create_model('{name}')"
        build.source = lambda: timm.models.model_entrypoint(name)
        return build

    return {f"timm/{n}": make(n) for n in timm.list_models()}


def _torchvision_video_provider():
    import torchvision

    def make(fn_name):
        def build(num_classes: int, in_channels: int = 3, **args):
            if in_channels != 3:
                raise TypeError(f"torchvision video model {fn_name} takes RGB clips (in_channels=3), not {in_channels}")
            # Clips travel (N, T, C, H, W); torchvision's video models take (N, C, T, H, W).
            return FramesFirst(torchvision.models.get_model(fn_name, weights=None, num_classes=num_classes, **args))

        build.__doc__ = f"torchvision.models.video.{fn_name} (task=video; input (N, T, C, H, W) clips)"
        build.source = lambda: torchvision.models.get_model_builder(fn_name)
        return build

    return {n: make(n) for n in torchvision.models.list_models(module=torchvision.models.video)}


MODELS.add_provider(_torchvision_provider)
MODELS.add_provider(_torchvision_video_provider)
MODELS.add_provider(_timm_provider)


# Arguments torchsprint passes to every builder (or, for torchvision and timm, decides itself): given again in
# model.args they would collide ("got multiple values") or quietly contradict the config.
RESERVED_ARGS = {
    "num_classes": "the dataset's class count",
    "in_channels": "the dataset's channel count",
    "in_chans": "timm's name for the dataset's channel count",
    "weights": "torchvision weights: use model.pretrained",
    "pretrained": "library weights: use model.pretrained",
}


def declared_type(builder, key: str):
    """The type a model builder declares for keyword `key` (bool, int, float), or None when nothing says.

    Looked up in the builder's own signature (the built-in nets), then in the library function a provider's builder
    wraps (`build.source()`, looked up only when checked) and the nn.Module classes of that function's module:
    torchvision's resnet18 takes **kwargs and passes them to ResNet.__init__, which declares
    `zero_init_residual: bool = False`."""
    import inspect
    import sys

    source = builder.source() if hasattr(builder, "source") else None  # a provider's: the library function it wraps
    targets = [builder] + ([source] if source is not None else [])
    if source is not None and (module := sys.modules.get(source.__module__)) is not None:
        targets += [
            c.__init__
            for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == module.__name__
        ]
    for target in targets:
        try:
            param = inspect.signature(target).parameters.get(key)
        except (TypeError, ValueError):
            continue
        if param is None:
            continue
        kind = param.annotation if param.annotation is not inspect.Parameter.empty else type(param.default)
        kind = {"bool": bool, "int": int, "float": float}.get(kind, kind) if isinstance(kind, str) else kind
        if kind in (bool, int, float):
            return kind
    return None


def check_args(name: str, builder, args: dict) -> None:
    """Refuse a model.args value of the wrong kind where the builder declares one. Why: a library tests a flag with
    `if zero_init_residual:`, so `maybe`, `2` or a quoted "false" would silently turn it on."""
    from torchsprint.errors import UsageError

    for key, value in args.items():
        kind = declared_type(builder, key)
        if kind is bool and not isinstance(value, bool):
            raise UsageError(
                f"model.args.{key}={value!r}: model '{name}' takes a boolean there (any other value would "
                f"turn it on); write {key}: true or {key}: false, unquoted."
            )
        if kind in (int, float) and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            raise UsageError(
                f"model.args.{key}={value!r}: model '{name}' takes {'an integer' if kind is int else 'a number'} "
                f"there; write e.g. {key}: {1 if kind is int else 0.5}."
            )


def build_model(model_cfg, num_classes: int, in_channels: int) -> nn.Module:
    """Instantiate `model_cfg.name` for the data's class and channel counts (random initialisation).

    Args:
        model_cfg: the `model` section (name, args, bn_momentum).
        num_classes: output size, from the dataset.
        in_channels: input channels, from the dataset.
    """
    from torchsprint.errors import UsageError

    builder = MODELS.get(model_cfg.name)
    for key in model_cfg.args:
        if key in RESERVED_ARGS:
            raise UsageError(
                f"model.args.{key}: torchsprint sets this itself ({RESERVED_ARGS[key]}); remove it from model.args."
            )
    check_args(model_cfg.name, builder, model_cfg.args)
    try:
        model = builder(num_classes=num_classes, in_channels=in_channels, **model_cfg.args)
    except TypeError as e:
        raise UsageError(f"model '{model_cfg.name}': bad model.args {model_cfg.args}: {e}") from None
    if model_cfg.bn_momentum is not None:
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            raise UsageError(
                f"model.bn_momentum={model_cfg.bn_momentum}: model '{model_cfg.name}' has no BatchNorm "
                "layer; remove model.bn_momentum."
            )
        for m in norms:
            m.momentum = model_cfg.bn_momentum
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen


__all__ = ["MODELS", "build_model", "count_parameters", "adapt_in_channels"]


def min_input_size(model: nn.Module, in_channels: int, limit: int = 1024) -> int | None:
    """The smallest square input side (pixels) `model` accepts, or None when even `limit` fails.

    Found with no-grad forwards of one zero image in eval mode (nothing learnt changes): the first power
    of two that works, then a binary search below it. Called only after a forward failed for its input
    size, to tell the user what the model needs.
    """
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    def ok(side: int) -> bool:
        try:
            with torch.no_grad():
                model(torch.zeros(1, in_channels, side, side, device=device))
            return True
        except RuntimeError:
            return False

    try:
        hi = 1
        while not ok(hi):
            hi *= 2
            if hi > limit:
                return None
        lo = hi // 2  # fails (or 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi
    finally:
        model.train(was_training)
