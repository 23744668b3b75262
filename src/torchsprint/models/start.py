"""How a model on photo-sized images starts: published weights fine-tuned where they can be had, as a user of fastai
(`vision_learner` + `fine_tune`), timm (`pretrained=True`) or Ultralytics gets; else from scratch.

Called from config validation through data/detect.py's photo_defaults (`start`), after the transforms and the model
were chosen, so every choice lands in the config (config.yaml keeps it; a resumed run reads it as set) and in
Config.chosen (the start-up summary and decisions.json), each with why and how to override it:

- model.pretrained: where torchsprint picked the model (the user named neither a model nor weights), the model's
  published weights (PHOTO_WEIGHTS) when they are in the cache or can be downloaded now; else none, said in one line
  that names `torchsprint weights get` (from scratch, as before).
- with weights (picked or named): the weights' normalisation appended to the transforms torchsprint picked, the
  fine-tuning learning rate (FINE_TUNE_LR_PER_256 per 256 images of the batch) with no warm-up, and the new head
  trained first with the body frozen for FREEZE_EPOCHS (fastai's fine_tune: `freeze_epochs=1`).
- without: data/detect.py's photo_schedule (the from-scratch lr and warm-up); a torchvision ResNet trained with no
  warm-up starts each residual block's last BatchNorm at zero (model.args.zero_init_residual, ZERO_INIT).
"""

from __future__ import annotations

from dataclasses import replace

from torchsprint.data.detect import Choice, lr_unset, photo_schedule, step_batch
from torchsprint.errors import UsageError

# The photo model's published weights: torchvision's ResNet18_Weights.DEFAULT (IMAGENET1K_V1, 44.7 MB, ImageNet
# top-1 69.8%).
PHOTO_WEIGHTS = "torchvision:DEFAULT"
# Fine-tuning's learning rate per 256 images of the batch, SGD with Nesterov momentum (the default optimizer): 0.01,
# a tenth of the from-scratch rule (data/detect.py PHOTO_LR_PER_256). Kornblith et al. 2019 ("Do Better ImageNet
# Models Transfer Better?") fine-tune with this optimizer at batch 256 over a grid of 0.001-0.1; BENCHMARKS.md
# "Fine-tuning as the photo default" measured 0.01, 0.03 and 0.1 per 256 on generated photos.
FINE_TUNE_LR_PER_256 = 0.01
# Epochs that train the new head alone before the whole network (fastai's fine_tune default, freeze_epochs=1): a
# randomly initialised head's first gradients would otherwise flow into the pretrained body.
FREEZE_EPOCHS = 1
# torchvision's ResNets, which take zero_init_residual: each residual block's last BatchNorm weight starts at zero,
# so every block starts as the identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD"; timm builds its ResNets
# so by default, zero_init_last=True). torchvision leaves it off; on this project's timm comparison (ResNet-18 from
# scratch, lr 0.1, no warm-up) it was the whole accuracy gap (BENCHMARKS.md "torchsprint beside timm's train.py").
ZERO_INIT = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "resnext101_64x4d",
    "wide_resnet50_2",
    "wide_resnet101_2",
)


def photo_start(cfg, chosen: list[Choice]) -> list[Choice]:
    """The choices above, applied to `cfg` where it leaves them unset; `chosen`: what data/detect.py chose before."""
    picked = {c.setting for c in chosen}
    out: list[Choice] = []
    if "model.name" in picked and cfg.model.pretrained is None and "pretrained" not in cfg.model.model_fields_set:
        spec, why = available(PHOTO_WEIGHTS, cfg.model.name)
        if spec is None:
            out.append(
                Choice(
                    "model.pretrained",
                    None,
                    f"from scratch: {why}",
                    f"run `torchsprint weights get "
                    f"{PHOTO_WEIGHTS} --model {cfg.model.name}` where there is network, then run again; or "
                    "set model.pretrained",
                )
            )
        else:
            cfg.model.pretrained = spec
            out.append(
                Choice(
                    "model.pretrained",
                    spec,
                    f"{why}: torchvision's ImageNet weights for {cfg.model.name}, "
                    "fine-tuned (fastai's fine_tune, timm's pretrained=True); from scratch, the same run "
                    'learns far less from a small folder (BENCHMARKS.md "Fine-tuning as the photo default")',
                    "model.pretrained=null trains from scratch; or name other weights",
                )
            )
    if cfg.model.pretrained is None:
        return out + photo_schedule(cfg) + zero_init(cfg)
    return out + fine_tune(cfg, chosen)


def zero_init(cfg) -> list[Choice]:
    """model.args.zero_init_residual=true for a torchvision ResNet trained from scratch without a warm-up (the run
    starts at its peak lr), where model.args leaves it. With a warm-up (the photo defaults' lr rule) it is left off:
    there it slowed learning (BENCHMARKS.md "Zero-initialised residuals: with and without a warm-up")."""
    model = cfg.model
    if model.name not in ZERO_INIT or "zero_init_residual" in model.args or cfg.sched.warmup_epochs > 0:
        return []
    model.args = {**model.args, "zero_init_residual": True}
    return [
        Choice(
            "model.args.zero_init_residual",
            True,
            "from scratch with no warm-up: each residual block's last "
            "BatchNorm starts at zero, so the network starts as a chain of identities (Goyal et al. 2017; timm's "
            "ResNets do so by default) and the first steps at the peak lr do not diverge; on ResNet-18 at lr 0.1 "
            'without warm-up it lifted val top-1 from 0.33-0.44 to 0.96 (BENCHMARKS.md "torchsprint beside timm'
            "'s train.py\")",
            "model.args={zero_init_residual: false}",
        )
    ]


def available(spec: str, model_name: str) -> tuple[str | None, str]:
    """(`spec`, where it is) when the weights are cached or were downloaded now; (None, why not) otherwise.

    A DDP worker does not download a default: its processes read their configs at once, and a download that worked
    on one and failed on another would give them different models; `torchsprint weights get` first, or one process.
    """
    from torchsprint.models.download import fetch, offline
    from torchsprint.models.weights import locate
    from torchsprint.runtime.core import launch_env

    src = locate(spec, model_name)
    if src.cached is not None:
        return spec, f"in the cache ({src.cached})"
    if (why := offline()) is not None:
        return (
            None,
            f"{model_name}'s published weights are not in the cache ({src.target}) and downloads are off ({why})",
        )
    if launch_env().world_size > 1:
        return None, (
            f"{model_name}'s published weights are not in the cache ({src.target}); a DDP run fine-tunes by "
            "default only from cached weights"
        )
    try:
        path = fetch(spec, model_name)  # its log: what is downloaded from where, on stderr
    except UsageError as e:
        return None, (
            f"{model_name}'s published weights are not in the cache and {getattr(e, 'reason', e)} (a machine "
            "without network: TORCHSPRINT_OFFLINE=1 skips the attempt)"
        )
    return spec, f"downloaded ({path})"


def normalization(spec: str, model_name: str) -> tuple[list[float], list[float]] | None:
    """The mean and std the published weights were trained with (torchvision's weights.transforms(), timm's
    pretrained_cfg); None where a file or URL does not say (a torchsprint run's weights keep its own transforms)."""
    kind, _, name = spec.partition(":")
    try:
        if kind == "torchvision":
            import torchvision

            weights = (
                torchvision.models.get_model_weights(model_name).DEFAULT
                if name == "DEFAULT"
                else torchvision.models.get_weight(name)
            )
            t = weights.transforms()
            return list(t.mean), list(t.std)
        if kind == "timm":
            from timm.models import get_pretrained_cfg

            pc = get_pretrained_cfg(name)
            return (list(pc.mean), list(pc.std)) if pc is not None else None
    except (ImportError, ValueError, KeyError, AttributeError):
        return None  # the run itself says what is wrong with the spec when it loads the weights
    return None


def fine_tune(cfg, chosen: list[Choice]) -> list[Choice]:
    """Normalisation, learning rate and head-first epochs for a run that starts from weights (see the module);
    the transform choices in `chosen` are updated in place when the normalisation joins them."""
    out: list[Choice] = []
    stats = normalization(cfg.model.pretrained, cfg.model.name)
    if stats is not None and any(c.setting == "data.train.transforms" for c in chosen):
        mean, std = stats
        if str(cfg.data.options.get("mode", "RGB")).upper() in ("GRAY", "L"):  # one channel: the channels' average
            mean, std = [sum(mean) / len(mean)], [sum(std) / len(std)]
        step = (
            {"normalize": "imagenet"}
            if (mean, std) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
            else {"normalize": {"mean": [round(m, 6) for m in mean], "std": [round(s, 6) for s in std]}}
        )
        cfg.data.train.transforms = [*cfg.data.train.transforms, step]
        cfg.data.eval.transforms = [*cfg.data.eval.transforms, step]
        said = (
            f"; then the statistics {cfg.model.pretrained} were trained with (mean and std per channel), so the "
            "network sees its inputs as in its pretraining"
        )
        for i, c in enumerate(chosen):  # the transform choices data/detect.py made, now with the normalisation
            if c.setting in ("data.train.transforms", "data.eval.transforms"):
                value = cfg.data.train.transforms if c.setting == "data.train.transforms" else cfg.data.eval.transforms
                chosen[i] = replace(c, value=value, why=c.why + said)
    if lr_unset(cfg):
        batch, which = step_batch(cfg)
        cfg.optim.lr = round(FINE_TUNE_LR_PER_256 * batch / 256, 12)
        out.append(
            Choice(
                "optim.lr",
                cfg.optim.lr,
                f"fine-tuning: {FINE_TUNE_LR_PER_256} per 256 images of the "
                f"batch x {batch} ({which}), a tenth of the from-scratch rule, with no warm-up; a from-scratch "
                "rate would wash out what the weights learned",
                "set optim.lr",
            )
        )
    model = cfg.model
    if (
        "freeze_epochs" not in model.model_fields_set
        and not model.freeze
        and not model.train_only
        and cfg.run.epochs > FREEZE_EPOCHS
    ):
        model.freeze_epochs = FREEZE_EPOCHS
        out.append(
            Choice(
                "model.freeze_epochs",
                FREEZE_EPOCHS,
                f"the new head trains alone for the first "
                f"{FREEZE_EPOCHS} epoch with the pretrained body frozen, then everything (fastai's fine_tune), "
                "so the random head's first gradients do not disturb the body",
                "model.freeze_epochs=0 trains everything from the start",
            )
        )
    return out
