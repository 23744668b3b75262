"""Parameter groups: weight decay off for norms and biases, per-pattern rules, layer-wise LR decay; the
name matcher that freezing (models/init.py) shares."""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from torchsprint.errors import UsageError

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def name_matcher(pattern: str):
    """A predicate on parameter names: a glob (`layer1.*`), or a regex searched in the name with a 're:' prefix."""
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def no_decay_ids(model: nn.Module) -> set[int]:
    """ids of biases, normalisation weights and other 1-d parameters (timm's `param_groups_weight_decay`)."""
    out = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1:
                out.add(id(p))
    return out


_CONTAINERS = (nn.Sequential, nn.ModuleList)


def block_layer_ids(model: nn.Module) -> dict[str, int]:
    """Layer ids for layer-wise lr decay of a model without timm's group_matcher (torchvision models).

    Walks the modules in definition order. An nn.Sequential/nn.ModuleList is opened, and each of its
    children with submodules is one block (a ResNet BasicBlock, an MBConv, a ViT EncoderBlock), as is each
    of its plain layers (a VGG conv); a module that holds such a container (ViT's Encoder) is opened too.
    A container of plain layers inside a container is one block (torchvision's Conv2dNormActivation).
    Consecutive plain layers outside containers share one id (a stem conv + bn), and parameters held
    directly by an opened module (ViT's class token, position embedding) join layer 0, as in timm's
    group_matcher. torchvision's resnet18 gets 10 ids (stem, 8 blocks, fc), the same as timm's resnet18.
    """
    units: list[tuple[list[str], bool]] = []  # (parameter names, loose plain layer) in order
    stem: list[str] = [n for n, _ in model.named_parameters(recurse=False)]  # direct parameters: layer 0

    def visit(module: nn.Module, prefix: str, in_container: bool) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            names = [f"{full}.{n}" for n, _ in child.named_parameters()]
            if not names:
                continue
            grand = list(child.children())
            if isinstance(child, _CONTAINERS):  # opened, unless it is one block of plain layers in a container
                opens = not in_container or any(list(g.children()) for g in grand)  # (conv+bn+act, EfficientNet's stem)
            else:
                opens = not in_container and any(isinstance(g, _CONTAINERS) for g in grand)
            if opens:
                stem.extend(f"{full}.{n}" for n, _ in child.named_parameters(recurse=False))
                visit(child, f"{full}.", isinstance(child, _CONTAINERS))
            else:
                units.append((names, not in_container and not grand))

    visit(model, "", False)
    ids, layer, prev_loose = {}, -1, False
    for names, loose in units:
        if not (loose and prev_loose):
            layer += 1
        prev_loose = loose
        ids.update(dict.fromkeys(names, layer))
    ids.update(dict.fromkeys(stem, 0))
    return ids


def layer_ids(model: nn.Module) -> dict[str, int]:
    """{parameter name: layer id} from the model's timm group_matcher when it has one (timm's own
    `group_parameters(model, model.group_matcher(coarse=False), reverse=True)`, as timm.optim's
    param_groups_layer_decay does), else block_layer_ids."""
    if hasattr(model, "group_matcher"):
        from timm.models import group_parameters

        return group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    return block_layer_ids(model)


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay_norm_bias: bool,
    rules=(),
    layer_decay: float | None = None,
    lr: float = 1.0,
) -> list[dict]:
    """Trainable parameters in optimizer groups, each with its own lr and weight decay.

    Args:
        model: the model (wrapper prefixes in names are ignored for matching).
        weight_decay: the default weight decay.
        no_decay_norm_bias: biases and normalisation weights get no decay (timm's
            `param_groups_weight_decay`; decaying them hurts accuracy, Goyal et al. 2017).
        rules: optim.param_groups entries (pattern, lr_scale, weight_decay); a parameter takes the first
            rule whose pattern matches its name; unmatched parameters keep the defaults. A pattern that
            matches no trainable parameter is an error naming it.
        layer_decay: layer-wise lr decay: layer i of L gets lr_scale layer_decay ** (L - 1 - i) (BEiT,
            timm's param_groups_layer_decay); multiplies a rule's lr_scale.
        lr: the base learning rate; each group's `lr` is lr x its lr_scale, so schedulers (LambdaLR)
            scale every group's own rate.
    Frozen parameters (requires_grad=False) are not given to the optimizer at all. Groups come in order of
    decreasing lr_scale (group 0 carries the unscaled rate the log reports, when some group has it).
    """
    from torchsprint.state.checkpoint import strip_prefixes

    named = list(strip_prefixes(dict(model.named_parameters())).items())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    matchers = [name_matcher(r.pattern) for r in rules]
    for r, m in zip(rules, matchers):
        if not any(m(n) for n, _ in trainable):
            sample = [n for n, _ in trainable][:4]
            raise UsageError(
                f"optim.param_groups: pattern '{r.pattern}' matches no trainable parameter. Parameter names "
                f"look like: {sample}"
            )
    nd = no_decay_ids(model) if no_decay_norm_bias else set()
    layers, n_layers = {}, 1
    if layer_decay is not None:
        from torchsprint.runtime.parallel import unwrap

        layers = layer_ids(unwrap(model))
        n_layers = max(layers.values(), default=0) + 1
    groups: dict[tuple, dict] = {}
    for name, p in trainable:
        rule = next((i for i, m in enumerate(matchers) if m(name)), None)
        scale = 1.0 if rule is None else rules[rule].lr_scale
        layer = layers.get(name, n_layers - 1)
        if layer_decay is not None:
            scale *= layer_decay ** (n_layers - 1 - layer)
        wd = weight_decay if rule is None or rules[rule].weight_decay is None else rules[rule].weight_decay
        if id(p) in nd:
            wd = 0.0
        key = (rule, layer, wd)
        g = groups.setdefault(key, {"params": [], "weight_decay": wd, "lr": lr * scale, "lr_scale": scale})
        g["params"].append(p)
    return sorted(groups.values(), key=lambda g: (-g["lr_scale"], g["weight_decay"] == 0))  # stable: first seen first
