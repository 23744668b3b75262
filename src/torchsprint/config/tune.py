"""The config schema's `tune` section: what `torchsprint tune` searches (a space of settings) and what it optimizes.

A dimension is one setting (a dotted config key, or one of SHORTCUTS, which set several keys together) and one
distribution: {choice: [a, b, ...]}, {uniform: [low, high]}, {loguniform: [low, high]} or {int: [low, high]}.
An empty space means: the space chosen from the data (commands/tune/space.py), printed with a reason per dimension.
Each value a trial may take is checked by the tune command against the schema before any trial runs.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from torchsprint.config.sections import Section

KINDS = ("choice", "uniform", "loguniform", "int")
# Settings that are not one config key: a trial's image size and its augmentation's strength are written into
# data.train.transforms and data.eval.transforms (the photo defaults' shape: a random resized crop and a flip for
# training, the short side resized to size/0.875 and the centre cut out for evaluation).
SHORTCUTS = {
    "image_size": "the side of the training crop and of the evaluation's centre crop (pixels); writes "
    "data.train.transforms and data.eval.transforms",
    "crop_scale": "the smallest share of the image the training's random resized crop keeps (the augmentation's "
    "strength: lower is stronger); writes data.train.transforms",
}


def check_dimension(key: str, spec: Any) -> dict:
    """One dimension of a space, checked: a dict with exactly one of KINDS and values that form a range.
    Raises ValueError naming the key and what to write."""
    example = f"{key}: {{loguniform: [0.01, 0.3]}} or {key}: {{choice: [a, b]}}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"tune.space.{key}: write one of {', '.join(KINDS)} with its values, e.g. {example}")
    kind, values = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(values, list) or not values:
            raise ValueError(f"tune.space.{key}: choice takes a non-empty list of values, e.g. [32, 64]")
        if len({repr(v) for v in values}) != len(values):
            raise ValueError(f"tune.space.{key}: choice lists a value twice ({values})")
        return {"choice": list(values)}
    if not (isinstance(values, list) and len(values) == 2):
        raise ValueError(f"tune.space.{key}: {kind} takes [low, high], e.g. {{{kind}: [1, 4]}}")
    lo, hi = values
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not numbers or (kind == "int" and not all(isinstance(v, int) for v in values)):
        what = "whole numbers" if kind == "int" else "finite numbers"
        raise ValueError(f"tune.space.{key}: {kind} takes two {what} [low, high], got {values}")
    if not lo < hi:
        raise ValueError(f"tune.space.{key}: {kind} [{lo}, {hi}]: low must be below high")
    if kind == "loguniform" and lo <= 0:
        raise ValueError(f"tune.space.{key}: loguniform [{lo}, {hi}] needs low > 0 (a log scale); use uniform")
    return {kind: [lo, hi]}


def settable(key: str, root: type[BaseModel]) -> bool:
    """Whether `key` (dotted) names a field of the schema `root`: sections down to a field, or any key below a
    free-form dict field (model.args.zero_init_residual, loss.args.gamma, data.options.mode)."""
    cls: Any = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = getattr(cls, "model_fields", None)
        if fields is None or part not in fields:
            return False
        ann = fields[part].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
            continue
        if typing.get_origin(ann) is dict or ann is dict:
            return i + 1 <= len(parts)
        return i == len(parts) - 1
    return False


class TuneConfig(Section):
    space: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The settings to search, each a dotted config key (or image_size, crop_scale) and one of "
        "{choice: [...]}, {uniform: [low, high]}, {loguniform: [low, high]}, {int: [low, high]}. Empty: the space "
        "chosen from the data (the image size up to the images' own, the learning rate around the rule's, the "
        "imbalance counter-measures where classes are imbalanced, the augmentation, label smoothing, the model, "
        "the batch), each dimension printed with why.",
    )
    metric: str | list[str] | None = Field(
        None,
        description="What a trial is scored by: a metric of the run's evaluation (e.g. val/balanced_acc), its "
        "direction that of checkpoint.mode; None: checkpoint.monitor. A list searches several objectives at once "
        "(a Pareto front; train_images_per_s, maximised, may be one), without pruning.",
    )
    sampler: Literal["tpe", "random"] = Field(
        "tpe", description="Optuna's sampler: tpe (TPESampler, multivariate) or random (RandomSampler)."
    )
    pruner: Literal["median", "halving", "none"] = Field(
        "median",
        description="Stop trials that fall behind at the same elapsed time (a tenth of the trial's time, or an "
        "epoch without --trial-time): median (Optuna's MedianPruner, after 3 finished trials), halving "
        "(SuccessiveHalvingPruner), none.",
    )
    seed: int = Field(
        0,
        ge=0,
        description="The sampler's seed (trial n is sampled with a seed drawn from (seed, n): a resumed study "
        "samples what an uninterrupted one would).",
    )

    @field_validator("space")
    @classmethod
    def _space(cls, v: dict) -> dict:
        # The keys themselves are checked against the root schema by config/schema.py's Config (`settable`).
        out = {}
        for key, spec in v.items():
            if key.startswith(("tune.", "run.dir", "run.out_dir", "run.name")):
                raise ValueError(
                    f"tune.space.{key}: the search cannot change where or how it runs; tune a training setting"
                )
            out[key] = check_dimension(key, spec)
        return out

    @field_validator("metric")
    @classmethod
    def _metric(cls, v):
        if isinstance(v, list) and (not v or len(set(v)) != len(v)):
            raise ValueError("tune.metric: a list of different metrics, e.g. [val/balanced_acc, train_images_per_s]")
        return v
