"""Model initialisation in the order checkpoint > pretrained file > random, and freezing by name."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.state.checkpoint import strip_prefixes


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or .pt/.pth (weights_only: never executes code from the file), read as
    models/weights_cache.py checks a download; a file that is not weights is named for what it is (an HTML page)."""
    from torchsprint.models.weights_cache import NotWeights, read_state

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model.pretrained: file not found: {path}")
    try:
        state = read_state(path)
    except NotWeights as e:
        raise UsageError(f"model.pretrained: cannot read {path} as weights: it is {e}.") from None
    return strip_prefixes(state)


def resolve_pretrained(spec: str, model_name: str | None, log=None, key: str = "model.pretrained") -> Path:
    """The weights file behind model.pretrained: a path, or a library's or URL's file in its cache, downloaded into
    that cache first when it is not there (models/download.py: torchvision:, timm:, hf-hub:, http(s)://).

    Offline, or when the download fails, one UsageError names the exact path to put the file at and the URL.
    """
    from torchsprint.models.download import fetch

    return fetch(spec, model_name, key, log)


def compare_state(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Keys of `state` against a model's `own` state dict: missing, unexpected and shape-mismatched."""
    return {
        "missing": [k for k in own if k not in state],
        "unexpected": [k for k in state if k not in own],
        "mismatched": [
            f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
            for k, v in state.items()
            if k in own and own[k].shape != v.shape
        ],
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
        raise UsageError(
            f"model.pretrained={path} does not match model exactly (model.strict=true): {_details(report)}. "
            "Set model.strict=false to load what matches and skip the rest."
        )
    loadable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not loadable:
        raise UsageError(
            f"model.pretrained={path}: no tensor matches this model by name and shape "
            f"({_details(report, 3)}). Wrong file or wrong model.name?"
        )
    model.load_state_dict(loadable, strict=False)
    return report


def _matcher(pattern: str):
    from torchsprint.optim.groups import name_matcher

    return name_matcher(pattern)


def head_keys(report: dict[str, list[str]], own: dict[str, torch.Tensor], num_classes: int | None) -> list[str]:
    """The shape-mismatched keys whose first dimension is the model's class count: a classifier head for another
    count."""
    keys = [m.split(":")[0] for m in report["mismatched"]]
    return [k for k in keys if num_classes is not None and own[k].ndim >= 1 and own[k].shape[0] == num_classes]


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


def init_model(
    model: nn.Module,
    model_cfg,
    resume_ckpt: dict | None,
    log,
    record: dict | None = None,
    num_classes: int | None = None,
) -> str:
    """Initialise in the order: resume checkpoint > model.pretrained file > random. Returns which happened.

    Args:
        model: the freshly built (unwrapped) model, randomly initialised by its constructor.
        model_cfg: the `model` section (name, pretrained, strict).
        resume_ckpt: a loaded checkpoint to resume from, or None.
        log: callable for one-line messages (what was skipped or ignored).
        record: filled with what was loaded from `model.pretrained` (source, file, head replaced, skipped
            keys) for the run's summary.
        num_classes: the run's class count, to say when a classifier head for another count was replaced.
    Returns "checkpoint", "pretrained" or "random".
    """
    if resume_ckpt is not None:
        report = compare_state(model.state_dict(), resume_ckpt["model"])
        if any(report.values()):
            saved = resume_ckpt.get("config", {}).get("model", {})
            raise UsageError(
                f"the checkpoint does not fit this model ({model_cfg.name} {model_cfg.args or ''}); it was saved from "
                f"{saved.get('name', '?')} {saved.get('args') or ''}: {_details(report)}. Resume with the model "
                "settings it was saved with, or start a new run from its weights with "
                "model.pretrained=<checkpoint file>."
            )
        model.load_state_dict(resume_ckpt["model"])
        if model_cfg.pretrained:
            log(f"model.pretrained={model_cfg.pretrained} not loaded: the resumed checkpoint's weights come first")
        return "checkpoint"
    if model_cfg.pretrained:
        path = resolve_pretrained(model_cfg.pretrained, model_cfg.name, log)
        report = load_pretrained(model, path, model_cfg.strict)
        head = head_keys(report, model.state_dict(), num_classes)
        if head:
            shapes = {m.split(":")[0]: m.split(": ", 1)[1] for m in report["mismatched"]}
            log(
                f"[yellow]pretrained: classifier head replaced[/] ({', '.join(head)}: {shapes[head[0]]}): the weights "
                f"are for another class count than this run's {num_classes}; the head starts from random initialisation"
            )
        if record is not None:
            record.update(
                source=model_cfg.pretrained,
                file=str(path),
                head_replaced=head,
                **{k: v[:20] for k, v in report.items()},
            )
        beyond = {**report, "mismatched": [m for m in report["mismatched"] if m.split(":")[0] not in head]}
        if any(beyond.values()):  # one line: what of the file and the model did not meet, beyond the head
            names = {
                "missing": "missing (left randomly initialised)",
                "unexpected": "unexpected (ignored)",
                "mismatched": "skipped for a shape mismatch (left randomly initialised)",
            }
            log(
                "pretrained: not loaded: "
                + "; ".join(
                    f"{len(keys)} key(s) {names[kind]}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
                    for kind, keys in beyond.items()
                    if keys
                )
                + " (model.strict=true makes this an error)"
            )
        return "pretrained"
    return "random"


class HeadOnly:
    """model.freeze_epochs: only the head trains for the first N epochs, then everything trainable.

    Every parameter is in the optimizer from the start; during the head-only epochs the body's parameters have
    requires_grad=False, so they get no gradient and the optimizer skips them (torch optimizers step only
    parameters whose .grad is set: no update, no weight decay, no momentum state). Whether an epoch is head-only
    depends on the epoch number alone (`apply` runs at the start of each epoch), so a run resumed before or after
    the switch sets the same flags as an uninterrupted one, and the optimizer's parameter groups never change
    shape (a checkpoint loads into the same groups; the body's state appears at its first step after the switch).
    With model.freeze_bn_stats (the default), the body's BatchNorm layers also keep their running statistics
    during the head-only epochs (`norms`), as frozen layers do. The off state (N=0) is a no-op object.

    Under DDP (`attach`), the wrapper's gradient reducer is rebuilt whenever the flags change
    (parallel.rebuild_ddp_reducer says why a rebuild and not find_unused_parameters): over the head alone during
    the head-only epochs, over every trainable parameter after the switch. The body then gets no gradient and no
    all-reduce while frozen, exactly as in one process, and the same optimizer behaviour follows. DataParallel
    needs nothing of the kind (it replicates the module, flags included, at every forward) but is refused by
    build_training until it is run on GPUs.
    """

    def __init__(self, body: list[nn.Parameter], body_norms: list[nn.Module], epochs: int, log=lambda *_: None):
        self.body, self.body_norms, self.epochs, self.log = body, body_norms, epochs, log
        self._frozen: bool | None = None
        self.wrapped: nn.Module | None = None

    def attach(self, wrapped: nn.Module) -> None:
        """After parallel.wrap_model: the wrapper whose DDP reducer must follow the flags, and the body's BatchNorm
        layers as wrapped (strategy.sync_bn replaces the BatchNorm modules, keeping their parameters)."""
        if not self.epochs:
            return  # the shared no-op object
        from torchsprint.runtime.parallel import unwrap

        self.wrapped = wrapped
        if self.body_norms:
            ids = {id(p) for p in self.body}
            self.body_norms = [
                m
                for m in unwrap(wrapped).modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
                and (ps := list(m.parameters(recurse=False)))
                and all(id(p) in ids for p in ps)
            ]
        self._frozen = None  # the reducer was built over the flags of now: the next apply rebuilds it for its epoch

    def apply(self, epoch: int) -> None:
        """Set the body's requires_grad for `epoch` (0-based) and say so when it changes."""
        frozen = epoch < self.epochs
        if frozen == self._frozen:
            return
        for p in self.body:
            p.requires_grad_(not frozen)
        if self.wrapped is not None:
            from torchsprint.runtime.parallel import rebuild_ddp_reducer

            rebuild_ddp_reducer(self.wrapped)
        if self._frozen and not frozen:
            self.log(
                f"model.freeze_epochs={self.epochs}: from epoch {epoch + 1} the whole model trains (the schedule "
                "goes on; the body joins at the current learning rate)"
            )
        self._frozen = frozen

    def norms(self, epoch: int) -> list[nn.Module]:
        """The body's BatchNorm layers to keep in eval mode during `epoch` (none after the switch)."""
        return self.body_norms if epoch < self.epochs else []


NO_HEAD_ONLY = HeadOnly([], [], 0)


def head_only(model: nn.Module, model_cfg, log) -> HeadOnly:
    """The HeadOnly schedule of model.freeze_epochs (`model`: the unwrapped module, after apply_freeze).

    The head: the parameters matching model.head (patterns as model.freeze), or else the last nn.Linear module's
    parameters (the classifier of torchvision, timm and the built-in nets). The body: every other trainable one.
    """
    if not model_cfg.freeze_epochs:
        if model_cfg.head:
            raise UsageError(
                "model.head names the head that model.freeze_epochs trains alone; set model.freeze_epochs "
                "(epochs of head-only training), or remove model.head."
            )
        return NO_HEAD_ONLY
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if model_cfg.head:
        for pat in model_cfg.head:
            if not any(_matcher(pat)(n) for n, _ in model.named_parameters()):
                raise UsageError(
                    f"model.head: pattern '{pat}' matches no parameter. Parameter names look like: "
                    f"{[n for n, _ in named][:4]}"
                )
        ms = [_matcher(p) for p in model_cfg.head]
        head = {n for n, _ in named if any(m(n) for m in ms)}
        where = f"model.head={model_cfg.head}"
    else:
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise UsageError(
                f"model.freeze_epochs: model {model_cfg.name} has no nn.Linear layer to take as its head; "
                "name the head's parameters with model.head (patterns as model.freeze, e.g. ['head.*'])."
            )
        name = linears[-1][0]
        head = {f"{name}.{k}" if name else k for k, _ in linears[-1][1].named_parameters()}
        where = f"the last Linear layer ({name})"
    body = [p for n, p in named if n not in head]
    if not head or not body:
        raise UsageError(
            f"model.freeze_epochs: {where} "
            + (
                "holds no trainable parameter"
                if not head
                else "holds every trainable parameter, so nothing would be frozen"
            )
            + "; adjust model.head (or model.freeze / model.train_only)."
        )
    body_ids = {id(p) for p in body}
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and (ps := list(m.parameters(recurse=False)))
        and all(id(p) in body_ids for p in ps)
    ]
    log(
        f"model.freeze_epochs={model_cfg.freeze_epochs}: epochs 1-{model_cfg.freeze_epochs} train only the head, "
        f"{where}: {sum(p.numel() for n, p in named if n in head):,} parameters; then all "
        f"{sum(p.numel() for _, p in named):,}. The learning-rate schedule runs on unchanged over all run.epochs: no "
        "restart or new warm-up at the switch"
    )
    return HeadOnly(body, norms if model_cfg.freeze_bn_stats else [], model_cfg.freeze_epochs, log)
