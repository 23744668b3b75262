"""OPTIMIZERS, SCHEDULERS and LOSSES registries and their builders (one config section each)."""

from __future__ import annotations

import bisect
import fnmatch
import inspect
import math
import re
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


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool, rules=(), layer_decay: float | None = None,
                 lr: float = 1.0) -> list[dict]:
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
    from torchsprint.checkpoint import strip_prefixes

    named = list(strip_prefixes(dict(model.named_parameters())).items())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    matchers = [name_matcher(r.pattern) for r in rules]
    for r, m in zip(rules, matchers):
        if not any(m(n) for n, _ in trainable):
            sample = [n for n, _ in trainable][:4]
            raise UsageError(f"optim.param_groups: pattern '{r.pattern}' matches no trainable parameter. Parameter names "
                             f"look like: {sample}")
    nd = no_decay_ids(model) if no_decay_norm_bias else set()
    layers, n_layers = {}, 1
    if layer_decay is not None:
        from torchsprint.parallel import unwrap

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


def _timm_optim_provider():
    """timm's optimizers (LAMB, LARS, AdamP, Lion, ...) as timm/<class name, lower-cased>, when timm is installed:
    recipes such as "ResNet strikes back" use LAMB, which torch.optim lacks. Each gets lr=optim.lr, the
    parameter groups' weight decay, and optim.args."""
    try:
        import timm.optim as topt
    except ImportError:
        return {}

    def make(cls):
        def build(groups, c):
            return cls(groups, lr=c.lr, **c.args)

        build.__doc__ = f"timm.optim.{cls.__name__}(lr=optim.lr, **optim.args)"
        return build

    # Left out, as torch's LBFGS/Muon are: Lookahead wraps another optimizer, Muon takes only 2-D weights,
    # AdaHessian needs backward(create_graph=True).
    skip = {"Lookahead", "Muon", "Adahessian"}
    return {f"timm/{name.lower()}": make(cls) for name, cls in vars(topt).items()
            if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith("timm.")
            and name not in skip}


OPTIMIZERS.add_provider(_timm_optim_provider)

# The optim fields each built-in optimizer reads besides lr, weight decay and impl; another optimizer takes
# its own arguments through optim.args. A non-default value of a field the chosen one does not read is
# refused: it would otherwise be accepted and silently ignored.
OPTIMIZER_FIELDS = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps"),
                    "rmsprop": ("momentum", "eps")}


def default_of(section, field: str):
    """The schema's default of `section.field` (default factories called), to tell a set value from none."""
    value = type(section).model_fields[field].get_default(call_default_factory=True)
    return tuple(value) if isinstance(getattr(section, field), tuple) and isinstance(value, list) else value


def check_optim_fields(optim_cfg) -> None:
    """Refuse optimizer-specific settings (momentum, nesterov, betas, eps) the chosen optimizer does not use."""
    name = optim_cfg.name.lower()
    uses = OPTIMIZER_FIELDS.get(name, ())
    for field in ("momentum", "nesterov", "betas", "eps"):
        value = getattr(optim_cfg, field)
        if field not in uses and value != default_of(optim_cfg, field):
            reads = f"it reads {', '.join('optim.' + u for u in uses)}" if uses else "it reads only optim.lr"
            raise UsageError(f"optim.{field}={value} does not apply to optimizer {optim_cfg.name} ({reads}); remove it, "
                             f"or pass {optim_cfg.name}'s own arguments in optim.args.")


# optim.impl=auto on CUDA uses the fused kernels of these: one kernel for the whole update, state on the GPU
# (Precision's sync-free skip of non-finite steps restores device state; see precision.masked_step).
FUSED_ON_CUDA = ("sgd", "adam", "adamw")


def resolve_impl(optim_cfg, groups: list[dict]):
    """optim.impl=auto -> fused for SGD/Adam/AdamW when every parameter is on a CUDA device (the section
    unchanged otherwise, and whenever optim.args picks an implementation itself)."""
    params = [p for g in groups for p in g["params"]]
    if (optim_cfg.impl == "auto" and optim_cfg.name.lower() in FUSED_ON_CUDA and params
            and all(p.is_cuda for p in params) and not {"fused", "foreach"} & set(optim_cfg.args)):
        return optim_cfg.model_copy(update={"impl": "fused"})
    return optim_cfg


def build_optimizer(optim_cfg, model: nn.Module) -> torch.optim.Optimizer:
    """Build `optim_cfg.name` over the model's trainable parameters.

    Args:
        optim_cfg: the `optim` section.
        model: the (unwrapped or wrapped) model; frozen parameters are left out.
    """
    builder = OPTIMIZERS.get(optim_cfg.name.lower())
    check_optim_fields(optim_cfg)
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.no_decay_norm_bias, optim_cfg.param_groups,
                          optim_cfg.layer_decay, optim_cfg.lr)
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise UsageError("no trainable parameters: model.freeze / model.train_only froze everything.")
    try:
        return builder(groups, resolve_impl(optim_cfg, groups))
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


# The sched fields each schedule reads besides interval and warm-up (same rule as OPTIMIZER_FIELDS).
SCHEDULE_FIELDS = {"cosine": ("min_lr_ratio",), "step": ("step_size", "gamma"), "multistep": ("milestones", "gamma"),
                   "exponential": ("gamma",), "onecycle": ("pct_start",), "constant": ()}


def check_sched_fields(sched_cfg) -> None:
    """Refuse schedule-specific settings the chosen schedule does not read, and warm-up settings without warm-up."""
    if sched_cfg.name not in SCHEDULE_FIELDS:
        return  # a user's schedule reads what it reads
    uses = SCHEDULE_FIELDS[sched_cfg.name]
    for field in ("min_lr_ratio", "step_size", "milestones", "gamma", "pct_start"):
        value = getattr(sched_cfg, field)
        if field not in uses and value != default_of(sched_cfg, field):
            reads = ", ".join("sched." + u for u in uses) or "no schedule-specific field"
            raise UsageError(f"sched.{field}={value} does not apply to sched.name={sched_cfg.name} (it reads {reads}); "
                             "remove it or pick the schedule it belongs to.")
    if sched_cfg.warmup_epochs == 0 and sched_cfg.warmup_start != default_of(sched_cfg, "warmup_start"):
        raise UsageError(f"sched.warmup_start={sched_cfg.warmup_start} has no effect with sched.warmup_epochs=0; set "
                         "sched.warmup_epochs too, or remove it.")


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
    check_sched_fields(sched_cfg)
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


class WeightedSum(nn.Module):
    """sum_i w_i * loss_i(output, target): the seeds' list of criteria, as one loss."""

    def __init__(self, losses: list[nn.Module], weights: list[float]):
        super().__init__()
        self.losses = nn.ModuleList(losses)
        self.weights = weights

    def forward(self, output, target):
        return sum(w * f(output, target) for f, w in zip(self.losses, self.weights))


TENSOR_ARGS = ("weight", "pos_weight")  # per-class weights: YAML lists become float tensors of num_classes values


def _make_loss(name: str, label_smoothing: float, args: dict, where: str, targets: str | None,
               num_classes: int | None) -> nn.Module:
    import inspect

    builder = LOSSES.get(name)
    known = getattr(builder, "targets", None)
    if targets is not None and known is not None and targets not in known:
        hint = {"class_index": "cross_entropy (or bce_with_logits)", "multi_hot": "bce_with_logits",
                "image": "mse, l1 or smooth_l1"}.get(targets, "another loss")
        raise UsageError(f"{where}: loss {name} compares outputs with {' or '.join(known)} targets, but this task's targets "
                         f"are {targets}. Use {hint}.")
    smooths = getattr(builder, "smoothing", None)
    if smooths is None:  # a user's loss: it smooths if it takes the argument
        smooths = "label_smoothing" in inspect.signature(builder).parameters
    if label_smoothing and not smooths:
        raise UsageError(f"loss.label_smoothing={label_smoothing}: loss {name} has no class labels to smooth (it applies "
                         "to cross_entropy and bce_with_logits). Set loss.label_smoothing=0.")
    args = dict(args)
    for key in TENSOR_ARGS:
        if key in args and not torch.is_tensor(args[key]):
            try:
                args[key] = torch.as_tensor(args[key], dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"{where}.args.{key}: expected a list of numbers, got {args[key]!r}.") from None
            if num_classes is not None and args[key].ndim == 1 and len(args[key]) != num_classes:
                raise UsageError(f"{where}.args.{key}: {len(args[key])} values for {num_classes} classes; give one per class "
                                 "(in the order of the dataset's classes).")
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
        losses = [_make_loss(t.name, loss_cfg.label_smoothing, t.args, f"loss.terms[{i}]", targets, num_classes)
                  for i, t in enumerate(loss_cfg.terms)]
        return WeightedSum(losses, [t.weight for t in loss_cfg.terms])
    return _make_loss(loss_cfg.name, loss_cfg.label_smoothing, loss_cfg.args, "loss", targets, num_classes)


__all__ = ["OPTIMIZERS", "SCHEDULERS", "LOSSES", "build_optimizer", "build_scheduler", "build_loss"]
