"""Model initialisation in the order checkpoint > pretrained file > random, and freezing by name."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchsprint.checkpoint import strip_prefixes
from torchsprint.errors import UsageError


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or .pt/.pth (weights_only: never executes code from the file)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model.pretrained: file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"model.pretrained: cannot read {path} as weights ({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a torchsprint checkpoint
    elif isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # Lightning and many reference scripts
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UsageError(f"model.pretrained: {path} holds no state dict of tensors.")
    return strip_prefixes(state)


def compare_state(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Keys of `state` against a model's `own` state dict: missing, unexpected and shape-mismatched."""
    return {
        "missing": [k for k in own if k not in state],
        "unexpected": [k for k in state if k not in own],
        "mismatched": [f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                       for k, v in state.items() if k in own and own[k].shape != v.shape],
    }


def _details(report: dict[str, list[str]], n: int = 5) -> str:
    return "; ".join(f"{len(v)} {k}: {', '.join(v[:n])}{' ...' if len(v) > n else ''}" for k, v in report.items() if v)


def load_pretrained(model: nn.Module, path: str | Path, strict: bool = False) -> dict[str, list[str]]:
    """Load what matches from a weights file; return the missing, unexpected and shape-mismatched keys.

    Args:
        model: the freshly built (unwrapped) model.
        path: a .safetensors, .pt or .pth file (a state dict, a torchsprint checkpoint, or a dict
            with a `state_dict` entry); `module.` / `_orig_mod.` prefixes are stripped.
        strict: any missing, unexpected or mismatched key is an error.
    Shape-mismatched tensors (a classifier head for another class count) are skipped, not loaded,
    and keep the model's random initialisation.
    """
    state = read_weights(path)
    own = model.state_dict()
    report = compare_state(own, state)
    if strict and any(report.values()):
        raise UsageError(f"model.pretrained={path} does not match model exactly (model.strict=true): {_details(report)}. "
                         "Set model.strict=false to load what matches and skip the rest.")
    loadable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not loadable:
        raise UsageError(f"model.pretrained={path}: no tensor matches this model by name and shape "
                         f"({_details(report, 3)}). Wrong file or wrong model.name?")
    model.load_state_dict(loadable, strict=False)
    return report


def _matcher(pattern: str):
    from torchsprint.optim import name_matcher

    return name_matcher(pattern)


def apply_freeze(model: nn.Module, freeze: list[str], train_only: list[str]) -> tuple[int, int]:
    """Set requires_grad=False on parameters matching `freeze` (or not matching `train_only`).

    Patterns are globs on parameter names (`layer1.*`) or regexes with a `re:` prefix.
    A pattern that matches no parameter is an error naming it. Returns (trainable, frozen) counts.
    """
    names = [n for n, _ in model.named_parameters()]
    for key, patterns in (("model.freeze", freeze), ("model.train_only", train_only)):
        for pat in patterns:
            if not any(_matcher(pat)(n) for n in names):
                raise UsageError(f"{key}: pattern '{pat}' matches no parameter. Parameter names look like: {names[:4]}")
    frozen_m = [_matcher(p) for p in freeze]
    keep_m = [_matcher(p) for p in train_only]
    for name, p in model.named_parameters():
        frozen = any(m(name) for m in frozen_m) or (bool(keep_m) and not any(m(name) for m in keep_m))
        if frozen:
            p.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def frozen_norm_layers(model: nn.Module) -> list[nn.Module]:
    """BatchNorm layers whose affine parameters are all frozen (kept in eval mode when configured)."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            params = list(m.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                out.append(m)
    return out


def init_model(model: nn.Module, model_cfg, resume_ckpt: dict | None, log) -> str:
    """Initialise in the order: resume checkpoint > model.pretrained file > random. Returns which happened.

    Args:
        model: the freshly built (unwrapped) model, randomly initialised by its constructor.
        model_cfg: the `model` section (name, pretrained, strict).
        resume_ckpt: a loaded checkpoint to resume from, or None.
        log: callable for one-line messages (what was skipped or ignored).
    Returns "checkpoint", "pretrained" or "random".
    """
    if resume_ckpt is not None:
        report = compare_state(model.state_dict(), resume_ckpt["model"])
        if any(report.values()):
            saved = resume_ckpt.get("config", {}).get("model", {})
            raise UsageError(
                f"the checkpoint does not fit this model ({model_cfg.name} {model_cfg.args or ''}); it was saved from "
                f"{saved.get('name', '?')} {saved.get('args') or ''}: {_details(report)}. Resume with the model settings "
                "it was saved with, or start a new run from its weights with model.pretrained=<checkpoint file>."
            )
        model.load_state_dict(resume_ckpt["model"])
        if model_cfg.pretrained:
            log(f"model.pretrained={model_cfg.pretrained} not loaded: the resumed checkpoint's weights come first")
        return "checkpoint"
    if model_cfg.pretrained:
        report = load_pretrained(model, model_cfg.pretrained, model_cfg.strict)
        names = {"missing": "missing (left randomly initialised)", "unexpected": "unexpected (ignored)",
                 "mismatched": "skipped for a shape mismatch (left randomly initialised)"}
        for kind, keys in report.items():
            if keys:
                log(f"pretrained: {len(keys)} key(s) {names[kind]}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}")
        return "pretrained"
    return "random"
