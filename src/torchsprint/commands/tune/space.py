"""The search space of `torchsprint tune`: the user's (`tune.space`) or one chosen from the data, the way the photo
defaults are (data/detect.py), each dimension with the reason it is searched and over what; and the overrides a
trial's values become.

The automatic space, from the resolved config (the defaults' choices) and the training set's class counts:
- optim.lr: log-uniform over 1/4x..4x the rule's learning rate (the rule: data/detect.py's photo_schedule, or the
  config's own), the setting that matters most (Bengio 2012; every tuner's first dimension);
- image_size (photo folders, where the defaults chose the transforms): the sides in SIZES up to the median short
  side of the images (a larger crop only upsamples);
- crop_scale: the augmentation's strength, the smallest share of the image a training crop keeps, 0.08 (torchvision's
  ImageNet recipe, strong) to 0.6 (weak);
- loss.label_smoothing: 0 to 0.2 (0.1 is timm's and torchvision's recipes' value);
- where the training classes' largest / smallest count is IMBALANCED or more: data.sampler (sqrt, balanced,
  shuffle); not the loss-side counter-measures (loss.logit_adjust, loss.class_weights: measured worse, below);
- model.name (photo folders on the defaults' model): the networks in PHOTO_MODELS;
- data.batch_size: 32, 64, 128 where an epoch keeps at least MIN_STEPS steps at the largest (the learning rate's
  dimension is searched beside it, so the pairs the linear rule would tie are both tried).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SIZES = (64, 96, 128, 160, 192, 224, 256, 288, 320, 384)
PHOTO_MODELS = ("resnet18", "mobilenet_v3_large", "resnet34")  # torchvision's, all in the model registry
IMBALANCED = 2.0  # largest / smallest training class: the counter-measures are searched from here on
MIN_STEPS = 8  # optimizer steps an epoch keeps at the largest batch searched
LR_SPAN = 4.0  # the learning rate's range: rule / 4 .. rule x 4


@dataclass(frozen=True)
class Dimension:
    """One searched setting: `key` (a dotted config key or a shortcut of config/tune.py), `kind` (choice, uniform,
    loguniform, int), `values` (the choices, or [low, high]) and why it is searched over these."""

    key: str
    kind: str
    values: list
    why: str

    def suggest(self, trial):
        """The trial's value (optuna.Trial's suggest_* for this kind)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, self.values)
        lo, hi = self.values
        if self.kind == "int":
            return trial.suggest_int(self.key, lo, hi)
        return trial.suggest_float(self.key, lo, hi, log=self.kind == "loguniform")

    def describe(self) -> str:
        what = (
            "one of " + ", ".join(json.dumps(v) for v in self.values)
            if self.kind == "choice"
            else f"{self.kind} {self.values[0]:g}..{self.values[1]:g}"
        )
        return f"{self.key}: {what} ({self.why})"


def user_space(space: dict) -> list[Dimension]:
    """The config's tune.space (already checked by the schema) as dimensions."""
    out = []
    for key, spec in space.items():
        kind, values = next(iter(spec.items()))
        out.append(Dimension(key, kind, list(values), "tune.space"))
    return out


def imbalance(counts: list[int] | None) -> float:
    """The largest over the smallest of the classes' counts that are not empty (1.0 without classes)."""
    present = [n for n in counts or [] if n > 0]
    return max(present) / min(present) if present else 1.0


def crop_of(transforms: list) -> dict | None:
    """The random_resized_crop step of a transforms list (its arguments), or None."""
    for t in transforms:
        if isinstance(t, dict) and "random_resized_crop" in t:
            return dict(t["random_resized_crop"])
    return None


def auto_space(cfg, counts: list[int] | None, train_images: int | None, own_side: int | None) -> list[Dimension]:
    """The space chosen from the data for the resolved config `cfg`: `counts` the training classes' image counts
    (None: not a class-per-image task), `train_images` the training set's size, `own_side` the median short side of
    the images (None: not measured)."""
    chosen = {c["setting"] for c in cfg.chosen()}
    dims = []
    lr = cfg.optim.lr
    rule = "the photo rule's" if "optim.lr" in chosen else "the config's"
    dims.append(
        Dimension(
            "optim.lr",
            "loguniform",
            [round(lr / LR_SPAN, 8), round(lr * LR_SPAN, 8)],
            f"{rule} {lr:g}, 1/{LR_SPAN:g}x to {LR_SPAN:g}x: the setting that matters most",
        )
    )
    crop = crop_of(cfg.data.train.transforms)
    if "data.train.transforms" in chosen and crop is not None and own_side:
        sizes = [s for s in SIZES if s <= own_side]
        if len(sizes) > 1:
            dims.append(
                Dimension(
                    "image_size",
                    "choice",
                    sizes,
                    f"sides up to the images' own (median short side {own_side} px); the defaults chose "
                    f"{crop.get('size')}",
                )
            )
    if crop is not None:
        dims.append(
            Dimension(
                "crop_scale",
                "uniform",
                [0.08, 0.6],
                "the augmentation's strength: the smallest share of the image a training crop keeps (0.08: "
                "torchvision's ImageNet recipe)",
            )
        )
    if counts is not None:
        dims.append(
            Dimension(
                "loss.label_smoothing", "uniform", [0.0, 0.2], "0.1 in timm's and torchvision's recipes; 0 is off"
            )
        )
    if counts and min(counts) > 0 and imbalance(counts) >= IMBALANCED:
        ratio = imbalance(counts)
        why = f"the training classes are imbalanced ({max(counts)} to {min(counts)} images, {ratio:.1f}x)"
        # The loss-side counter-measures (loss.logit_adjust, loss.class_weights) are not searched: measured on two
        # imbalanced sets they cost 5-40 points of top-1 from scratch and from pretrained weights, and stacked on a
        # re-sampler in one trial they over-correct (the first study on midhard: a trial with all three predicted
        # the smallest class alone). BENCHMARKS.md, "Imbalanced classes where the defaults miss the smallest class".
        dims.append(
            Dimension(
                "data.sampler",
                "choice",
                ["sqrt", "balanced", "shuffle"],
                why + ": how often each class is drawn (sqrt: the default's; balanced: equally; shuffle: as found)",
            )
        )
    if "model.name" in chosen:
        dims.append(
            Dimension(
                "model.name",
                "choice",
                list(PHOTO_MODELS),
                f"torchvision networks that train at these sizes on this device; the defaults chose {cfg.model.name}",
            )
        )
    batch = cfg.data.batch_size
    if isinstance(batch, int) and train_images and train_images // 128 >= MIN_STEPS and cfg.strategy.name != "ddp":
        dims.append(
            Dimension(
                "data.batch_size",
                "choice",
                [32, 64, 128],
                f"{train_images} training images keep {train_images // 128}+ steps an epoch at 128; the config has "
                f"{batch}",
            )
        )
    return dims


def overrides_of(params: dict, cfg) -> list[str]:
    """A trial's values as `key=value` overrides (JSON values, which the override parser reads as YAML). The
    shortcuts write the transforms: image_size (the training crop and the evaluation's resize and centre crop, the
    photo defaults' shape: resize to size/0.875) and crop_scale (the training crop's smallest share)."""
    out = [f"{k}={json.dumps(v)}" for k, v in params.items() if k not in ("image_size", "crop_scale")]
    if "image_size" in params or "crop_scale" in params:
        train = [dict(t) if isinstance(t, dict) else t for t in cfg.data.train.transforms]
        crop = crop_of(train)
        if crop is None:
            from torchsprint.errors import UsageError

            raise UsageError(
                "tune.space: image_size and crop_scale set the training's random_resized_crop, which "
                "data.train.transforms does not have: add one, or tune data.train.transforms itself"
            )
        if "image_size" in params:
            crop["size"] = int(params["image_size"])
        if "crop_scale" in params:
            crop["scale"] = [round(float(params["crop_scale"]), 4), 1.0]
        train = [
            {"random_resized_crop": crop} if isinstance(t, dict) and "random_resized_crop" in t else t for t in train
        ]
        out.append(f"data.train.transforms={json.dumps(train)}")
        if "image_size" in params:
            size = int(params["image_size"])
            out.append(f"data.eval.transforms={json.dumps(eval_transforms(cfg.data.eval.transforms, size))}")
    return out


def eval_transforms(transforms: list, size: int) -> list:
    """The evaluation's transforms for a training side of `size`: the resize and centre crop rescaled (resize to
    size/0.875, torchvision's 256 -> 224), other steps kept."""
    out = []
    for t in transforms:
        if isinstance(t, dict) and "resize" in t:
            out.append({"resize": int(size / 0.875) // 2 * 2})
        elif isinstance(t, dict) and "center_crop" in t:
            out.append({"center_crop": size})
        else:
            out.append(t)
    if not any(isinstance(t, dict) and "center_crop" in t for t in out):
        out = [{"resize": int(size / 0.875) // 2 * 2}, {"center_crop": size}, *out]
    return out


def baseline_params(dims: list[Dimension], cfg, counts: list[int] | None) -> dict:
    """The values the config itself gives each dimension, where they lie in its domain: the study's first trial (the
    defaults, or the user's config as it stands), so a search never reports a best worse than what it started from,
    and the trials table shows what each change bought. data.sampler=auto is what the run would make of it."""
    from torchsprint import config
    from torchsprint.data.core import AUTO_SAMPLER, AUTO_SAMPLER_RATIO

    data = config.to_dict(cfg)
    crop = crop_of(cfg.data.train.transforms) or {}
    out = {}
    for d in dims:
        if d.key == "image_size":
            v = crop.get("size")
            v = v[0] if isinstance(v, list | tuple) else v
        elif d.key == "crop_scale":
            v = (crop.get("scale") or [None])[0]
        elif d.key == "data.sampler" and cfg.data.sampler == "auto":
            v = AUTO_SAMPLER if imbalance(counts) >= AUTO_SAMPLER_RATIO else "shuffle"
        else:
            v = data
            for part in d.key.split("."):
                v = v.get(part) if isinstance(v, dict) else None
        if d.kind == "choice":
            if v in d.values:
                out[d.key] = v
        elif isinstance(v, int | float) and not isinstance(v, bool) and d.values[0] <= v <= d.values[1]:
            if d.kind != "int" or float(v).is_integer():
                out[d.key] = int(v) if d.kind == "int" else float(v)
    return out
