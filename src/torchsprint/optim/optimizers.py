"""The OPTIMIZERS registry (torch.optim, timm's when installed) and `build_optimizer(cfg.optim, model)`."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from torchsprint.config.fields import default_of
from torchsprint.errors import UsageError
from torchsprint.optim.groups import param_groups
from torchsprint.registry import Registry

OPTIMIZERS = Registry("optimizer", listed="optimizers")


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
    return torch.optim.SGD(
        groups,
        lr=c.lr,
        momentum=c.momentum,
        nesterov=c.nesterov and c.momentum > 0,
        **_impl_kwargs(torch.optim.SGD, c.impl),
        **c.args,
    )


@OPTIMIZERS.register("adam")
def adam(groups, c):
    return torch.optim.Adam(
        groups, lr=c.lr, betas=c.betas, eps=c.eps, **_impl_kwargs(torch.optim.Adam, c.impl), **c.args
    )


@OPTIMIZERS.register("adamw")
def adamw(groups, c):
    return torch.optim.AdamW(
        groups, lr=c.lr, betas=c.betas, eps=c.eps, **_impl_kwargs(torch.optim.AdamW, c.impl), **c.args
    )


@OPTIMIZERS.register("rmsprop")
def rmsprop(groups, c):
    return torch.optim.RMSprop(
        groups, lr=c.lr, momentum=c.momentum, eps=c.eps, **_impl_kwargs(torch.optim.RMSprop, c.impl), **c.args
    )


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
        if inspect.isclass(cls)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
        and name not in _UNSUPPORTED
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
    return {
        f"timm/{name.lower()}": make(cls)
        for name, cls in vars(topt).items()
        if inspect.isclass(cls)
        and issubclass(cls, torch.optim.Optimizer)
        and cls.__module__.startswith("timm.")
        and name not in skip
    }


OPTIMIZERS.add_provider(_timm_optim_provider)

# The optim fields each built-in optimizer reads besides lr, weight decay and impl; another optimizer takes
# its own arguments through optim.args. A non-default value of a field the chosen one does not read is
# refused: it would otherwise be accepted and silently ignored.
OPTIMIZER_FIELDS = {
    "sgd": ("momentum", "nesterov"),
    "adam": ("betas", "eps"),
    "adamw": ("betas", "eps"),
    "rmsprop": ("momentum", "eps"),
}


def check_optim_fields(optim_cfg) -> None:
    """Refuse optimizer-specific settings (momentum, nesterov, betas, eps) the chosen optimizer does not use."""
    name = optim_cfg.name.lower()
    uses = OPTIMIZER_FIELDS.get(name, ())
    for field in ("momentum", "nesterov", "betas", "eps"):
        value = getattr(optim_cfg, field)
        if field not in uses and value != default_of(optim_cfg, field):
            reads = f"it reads {', '.join('optim.' + u for u in uses)}" if uses else "it reads only optim.lr"
            raise UsageError(
                f"optim.{field}={value} does not apply to optimizer {optim_cfg.name} ({reads}); remove it, "
                f"or pass {optim_cfg.name}'s own arguments in optim.args."
            )


# optim.impl=auto on CUDA uses the fused kernels of these: one kernel for the whole update, state on the GPU
# (Precision's sync-free skip of non-finite steps restores device state; see precision.masked_step).
FUSED_ON_CUDA = ("sgd", "adam", "adamw")


def resolve_impl(optim_cfg, groups: list[dict]):
    """optim.impl=auto -> fused for SGD/Adam/AdamW when every parameter is on a CUDA device (the section
    unchanged otherwise, and whenever optim.args picks an implementation itself)."""
    params = [p for g in groups for p in g["params"]]
    if (
        optim_cfg.impl == "auto"
        and optim_cfg.name.lower() in FUSED_ON_CUDA
        and params
        and all(p.is_cuda for p in params)
        and not {"fused", "foreach"} & set(optim_cfg.args)
    ):
        return optim_cfg.model_copy(update={"impl": "fused"})
    return optim_cfg


def impl_in_use(opt: torch.optim.Optimizer, optim_cfg) -> tuple[str, str]:
    """The update implementation the built optimizer runs (read from the optimizer, so it is what ran) and why:
    fused, foreach, for_loop, or PyTorch's default (foreach on CUDA for most torch.optim optimizers, for_loop on
    CPU)."""
    d = opt.defaults
    why = f"optim.impl={optim_cfg.impl}"
    chosen_in_args = sorted({"fused", "foreach"} & set(optim_cfg.args))
    if chosen_in_args:
        why = ", ".join(f"optim.args.{k}={optim_cfg.args[k]}" for k in chosen_in_args)
    elif optim_cfg.impl == "auto":
        why += (
            ": fused kernels for sgd/adam/adamw on CUDA"
            if d.get("fused")
            else ": PyTorch's choice (fused is used for sgd/adam/adamw on CUDA only)"
        )
    if d.get("fused"):
        return "fused", why
    if d.get("foreach") is not None:
        return ("foreach" if d["foreach"] else "for_loop"), why
    return "default", why


def build_optimizer(optim_cfg, model: nn.Module) -> torch.optim.Optimizer:
    """Build `optim_cfg.name` over the model's trainable parameters.

    Args:
        optim_cfg: the `optim` section.
        model: the (unwrapped or wrapped) model; frozen parameters are left out.
    """
    builder = OPTIMIZERS.get(optim_cfg.name.lower())
    check_optim_fields(optim_cfg)
    groups = param_groups(
        model,
        optim_cfg.weight_decay,
        optim_cfg.no_decay_norm_bias,
        optim_cfg.param_groups,
        optim_cfg.layer_decay,
        optim_cfg.lr,
    )
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise UsageError("no trainable parameters: model.freeze / model.train_only froze everything.")
    try:
        return builder(groups, resolve_impl(optim_cfg, groups))
    except (TypeError, ValueError) as e:
        raise UsageError(f"optimizer '{optim_cfg.name}': bad arguments (optim.args={optim_cfg.args}): {e}") from None
